"""visualize / visualize_plan: device grids of placed tensors and plans, on concrete and abstract meshes."""

from __future__ import annotations

import io

import pytest
import torch
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard as ts
from testsupport.models import TiedLM
from torchshard import collectives as C

# (shape, spec) on data=4 × model=2 → the device labels of each row of blocks, read left to right
GRIDS = {
    "rows over data, cols over model": ((8, 16), P("data", "model"), [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]),
    "rows over model, cols over data": ((8, 16), P("model", "data"), [["0", "2", "4", "6"], ["1", "3", "5", "7"]]),
    "cols over model only": ((8, 8), P(None, "model"), [["0,2,4,6", "1,3,5,7"]]),
    "replicated": ((8, 8), P(), [["0-7"]]),
    "1-D over data": ((16,), P("data"), [["0,1", "2,3", "4,5", "6,7"]]),
    "1-D over model×data": ((16,), P(("model", "data")), [["0", "2", "4", "6", "1", "3", "5", "7"]]),
}  # fmt: skip


def _cells(text: str) -> list[list[str]]:
    rows = [line.strip() for line in text.splitlines() if line.strip().startswith("│")]
    return [[cell.strip() for cell in row.strip("│").split("│")] for row in rows]


def _placed(shape, spec, mesh):
    return C.shard_map(lambda t: t, mesh=mesh, in_specs=spec, out_specs=spec)(torch.zeros(shape))


@pytest.mark.parametrize("case", GRIDS)
def test_visualize_draws_the_blocks_each_device_holds(case, mesh_dm, capsys):
    shape, spec, expected = GRIDS[case]
    ts.visualize(_placed(shape, spec, mesh_dm))
    out = capsys.readouterr().out
    assert _cells(out) == expected
    assert out.splitlines()[0].startswith(f"{'×'.join(map(str, shape))} float32, {spec} on Mesh(data=4, model=2)")


class _Grid(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.register_buffer("t", torch.zeros(shape))


@pytest.mark.parametrize("abstract", [False, True], ids=["mesh", "abstract_mesh"])
@pytest.mark.parametrize("case", GRIDS)
def test_visualize_plan_grids_match(case, abstract, mesh_dm):
    shape, spec, expected = GRIDS[case]
    mesh = AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2) if abstract else mesh_dm
    out = io.StringIO()
    ts.visualize_plan(ts.plan(_Grid(shape), mesh, [("t", spec)]), grids=True, file=out)
    assert _cells(out.getvalue()) == expected


def test_visualize_writes_to_file_not_stdout(mesh_dm, capsys):
    out = io.StringIO()
    ts.visualize(_placed((8,), P("data"), mesh_dm), file=out)
    assert capsys.readouterr().out == ""
    assert "8 float32, P('data',) on Mesh(data=4, model=2): 2 per device" in out.getvalue()


def test_visualize_plan_lists_each_tensor_once(mesh_dm, capsys):
    rules = ts.Rules([(r"block\.up\.weight", ("model", None)), (r"embed\.weight", ("data", None))])
    ts.visualize_plan(ts.plan(TiedLM(), mesh_dm, rules))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Mesh(data=4, model=2): 10 of 10 tensors shown"
    assert lines[1].split() == ["tensor", "shape", "pieces", "shard", "copies", "bytes/device"]
    rows = {line.split("  ")[0]: line.split() for line in lines[2:-1]}
    assert rows["embed.weight = head.weight"][3:] == ["64×32", "4×1", "16×32", "2", "(model)", "2.00", "KiB"]
    assert rows["block.up.weight"][1:] == ["64×32", "2×1", "32×32", "4", "(data)", "4.00", "KiB"]
    assert rows["pos"][1:] == ["8×32", "1×1", "8×32", "8", "(data,model)", "1.00", "KiB"]
    assert lines[-1].startswith("10 tensors, ") and "8 fully replicated" in lines[-1]


def test_visualize_plan_filters_and_skips_high_rank_grids(mesh_dm, capsys):
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Linear(8, 8))
    ts.visualize_plan(ts.plan(model, mesh_dm, [(r"0\.weight", ("data",))]), names=r"^0\.", grids=True)
    out = capsys.readouterr().out
    assert out.startswith("Mesh(data=4, model=2): 2 of 4 tensors shown")
    assert "0.weight  8×4×3×3  4×1×1×1  2×4×3×3  2 (model)" in out
    assert "(rank 4: no grid; see the pieces column)" in out
    assert "1.weight" not in out


VIS_ERRORS = {
    "rank 3": (lambda mesh: _placed((8, 2, 3), P("data"), mesh), r"rank 3\); only 1-D and 2-D.*t.reshape\(8, -1\)"),
    "rank 0": (lambda mesh: _placed((), P(), mesh), r"rank 0\).*t.reshape\(1\)"),
    "plain tensor": (lambda mesh: torch.zeros(4), r"got a plain cpu tensor, which lives on no mesh; place it first"),
}  # fmt: skip


@pytest.mark.parametrize("case", VIS_ERRORS)
def test_visualize_errors(case, mesh_dm):
    make, message = VIS_ERRORS[case]
    with pytest.raises(ts.ShardingError, match=message):
        ts.visualize(make(mesh_dm))

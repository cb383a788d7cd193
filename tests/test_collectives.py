"""collectives: the shard_map tutorials reproduced in torch, each against eager unsharded torch."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import torchax
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop

import torchshard as ts
from testsupport.helpers import assert_close, to_numpy
from torchshard import collectives as C


def _fsdp_matmul(x, w):
    return x @ C.all_gather(w, "data", axis=0, tiled=True)


def _tp_mlp(x, w1, w2):
    x = C.all_gather(x, "model", axis=1, tiled=True)  # [B, D/m] -> [B, D]
    h = torch.relu(x @ w1)  # [B, D] @ [D, F/m]: each device its columns of the hidden layer
    return C.psum_scatter(h @ w2, "model", scatter_dimension=1, tiled=True)  # partial sums -> [B, D/m]


def _fsdp_tp_mlp(x, w1, w2):
    x = C.all_gather(x, "model", axis=1, tiled=True)
    w1 = C.all_gather(w1, "data", axis=0, tiled=True)
    w2 = C.all_gather(w2, "data", axis=1, tiled=True)
    return C.psum_scatter(torch.relu(x @ w1) @ w2, "model", scatter_dimension=1, tiled=True)


def _normalize(x):
    mean = C.pmean(x.mean(dim=1, keepdim=True), "model")
    var = C.pmean(((x - mean) ** 2).mean(dim=1, keepdim=True), "model")
    return (x - mean) / torch.sqrt(var + 1e-5)


_mlp_truth = lambda x, w1, w2: torch.relu(x @ w1) @ w2  # noqa: E731

CASES = {
    "fsdp_matmul": (_fsdp_matmul, [(8, 16), (16, 4)], (P("data", None), P("data", None)), P("data", None),
                    torch.matmul),
    "tp_mlp": (_tp_mlp, [(4, 16), (16, 32), (32, 16)], (P(None, "model"), P(None, "model"), P("model", None)),
               P(None, "model"), _mlp_truth),
    "fsdp_tp_mlp": (_fsdp_tp_mlp, [(8, 16), (16, 32), (32, 16)],
                    (P("data", "model"), P("data", "model"), P("model", "data")), P("data", "model"), _mlp_truth),
    "pmean_normalize": (_normalize, [(8, 16)], P("data", "model"), P("data", "model"),
                        lambda x: torch.nn.functional.layer_norm(x, (16,))),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_matches_eager_torch(case, mesh_dm):
    fn, shapes, in_specs, out_specs, truth = CASES[case]
    torch.manual_seed(0)
    args = [torch.randn(s) for s in shapes]
    out = C.shard_map(fn, mesh=mesh_dm, in_specs=in_specs, out_specs=out_specs)(*args)
    assert_close(out, truth(*args), what=case)
    assert out.jax().sharding == NamedSharding(mesh_dm, out_specs)


def test_differentiable_under_jax_grad(mesh_dm):
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(4, 16), torch.randn(16, 32), torch.randn(32, 16)
    specs = (P(None, "model"), P(None, "model"), P("model", None))
    mlp = C.shard_map(_tp_mlp, mesh=mesh_dm, in_specs=specs, out_specs=P(None, "model"))
    loss = lambda a, b: (mlp(x, a, b) ** 2).sum()  # noqa: E731
    value, grads = jax.value_and_grad(interop.jax_view(loss), argnums=(0, 1))(w1.numpy(), w2.numpy())
    a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    expected = (_mlp_truth(x, a, b) ** 2).sum()
    expected.backward()
    assert_close(value, expected.detach(), what="loss")
    assert_close(grads[0], a.grad, what="grad w1")
    assert_close(grads[1], b.grad, what="grad w2")


def test_placed_inputs_are_resharded_to_in_specs(mesh_dm):
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    by_columns = C.shard_map(lambda t: t, mesh=mesh_dm, in_specs=P(None, "model"), out_specs=P(None, "model"))
    xs, ws = by_columns(x), by_columns(w)
    assert xs.jax().sharding.spec == P(None, "model")
    f = C.shard_map(_fsdp_matmul, mesh=mesh_dm, in_specs=(P("data", None),) * 2, out_specs=P("data", None))
    assert_close(f(xs, ws), x @ w)


def test_ppermute_ring(mesh_dm):
    n = mesh_dm.shape["data"]
    ring = lambda x: C.ppermute(x, "data", [(i, (i + 1) % n) for i in range(n)])  # noqa: E731
    out = C.shard_map(ring, mesh=mesh_dm, in_specs=P("data"), out_specs=P("data"))(torch.arange(4.0))
    np.testing.assert_array_equal(to_numpy(out), [3.0, 0.0, 1.0, 2.0])


def test_all_to_all_transpose_round_trip(mesh_fsdp):
    x = torch.randn(8, 16)
    to_cols = lambda t: C.all_to_all(t, "data", split_axis=1, concat_axis=0, tiled=True)  # noqa: E731
    to_rows = lambda t: C.all_to_all(t, "data", split_axis=0, concat_axis=1, tiled=True)  # noqa: E731
    cols = C.shard_map(to_cols, mesh=mesh_fsdp, in_specs=P("data", None), out_specs=P(None, "data"))(x)
    rows = C.shard_map(to_rows, mesh=mesh_fsdp, in_specs=P(None, "data"), out_specs=P("data", None))(cols)
    assert_close(cols, x, what="row→column resharding keeps the values")
    assert cols.jax().sharding.spec == P(None, "data")
    assert_close(rows, x, what="round trip")
    transpose = lambda t: to_cols(t).T  # noqa: E731  each device: its column block of x, transposed = rows of x.T
    xt = C.shard_map(transpose, mesh=mesh_fsdp, in_specs=P("data", None), out_specs=P("data", None))(x[:, :8])
    assert_close(xt, x[:, :8].T, what="distributed transpose")


def test_axis_indices(mesh_dm):
    def indices():
        pair = torch.stack([C.axis_index("data"), C.axis_index("model"), C.axis_index(("data", "model"))])
        return pair[None] + 0 * C.axis_size("model")

    out = C.shard_map(indices, mesh=mesh_dm, in_specs=(), out_specs=P(("data", "model")))()
    np.testing.assert_array_equal(to_numpy(out), [[d // 2, d % 2, d] for d in range(8)])


def _draws(seed, mesh, axis="data"):
    def draw():
        with C.use_rng(C.fold_rng(seed, axis)):
            return torch.randn(1, 4)

    return to_numpy(C.shard_map(draw, mesh=mesh, in_specs=(), out_specs=P(("data", "model")))())


def test_fold_rng_differs_across_the_axis_and_repeats_with_the_seed(mesh_dm):
    first = _draws(0, mesh_dm)
    per_data = first[::2]  # devices (d, 0) for d in data; (d, 1) are their model peers
    assert len({tuple(row) for row in per_data}) == 4, "each data index draws differently"
    np.testing.assert_array_equal(first[::2], first[1::2])  # model peers share the data index → same draw
    np.testing.assert_array_equal(_draws(0, mesh_dm), first)
    np.testing.assert_array_equal(_draws(torch.Generator().manual_seed(0), mesh_dm), first)
    assert not np.allclose(_draws(1, mesh_dm), first)
    assert len({tuple(row) for row in _draws(0, mesh_dm, ("data", "model"))}) == 8


def test_fold_rng_key_can_be_folded_again(mesh_dm):
    def keys():
        return C.fold_rng(C.fold_rng(7, "data"), "model")[None]

    out = to_numpy(C.shard_map(keys, mesh=mesh_dm, in_specs=(), out_specs=P(("data", "model")))())
    assert out.shape == (8, 2) and len({tuple(k) for k in out}) == 8


BAD_SPECS = {
    "unknown in axis": ((torch.zeros(8, 4),), P("batch", None), P(),
                        r"unknown mesh axis 'batch'; use one of \['data', 'model'\]"),
    "unknown out axis": ((torch.zeros(8, 4),), P("data"), P("rows"), r"out_specs\[0\].*unknown mesh axis 'rows'"),
    "axis twice": ((torch.zeros(8, 8),), P("data", "data"), P(), r"axis 'data' is used twice"),
    "spec longer than tensor": ((torch.zeros(8),), P("data", None), P(), r"argument 0 \(8,\).*rank 1"),
    "not divisible": ((torch.zeros(6, 4),), P("data", None), P(),
                      r"dim 0 \(size 6\) is not divisible by data \(size 4\)"),
    "spec count": ((torch.zeros(8), torch.zeros(8)), (P("data"),), P(), r"in_specs has 1 entries for 2 item"),
    "not a spec": ((torch.zeros(8),), (3,), P(), r"in_specs\[0\] 3 is not a PartitionSpec"),
    "not a tensor": (([1.0, 2.0],), P(), P(), r"argument 0 is a list; shard_map takes torch tensors"),
    "out spec too long": ((torch.zeros(8),), P("data"), P("data", None), r"output 0 has local shape \(2,\).*2 entries"),
    "out spec count": ((torch.zeros(8),), P("data"), (P(), P()),
                       r"out_specs has 2 entries but the function returned one"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_SPECS)
def test_bad_specs_raise(case, mesh_dm):
    args, in_specs, out_specs, message = BAD_SPECS[case]
    with pytest.raises(ts.ShardingError, match=message):
        C.shard_map(lambda *a: a[0], mesh=mesh_dm, in_specs=in_specs, out_specs=out_specs)(*args)


COLLECTIVE_ERRORS = {
    "unknown axis": (lambda x: C.psum(x, "rows"), r"psum\(axis_name='rows'\): unknown axis.*\['data', 'model'\]"),
    "plain tensor": (lambda x: C.pmean(torch.ones(2, device="cpu"), "data"), r"pmean\(\) got a plain cpu torch tensor"),
    "bad seed": (lambda x: C.fold_rng("seed", "data"), r"give an int seed, a torch.Generator"),
}  # fmt: skip


@pytest.mark.parametrize("case", COLLECTIVE_ERRORS)
def test_collective_errors(case, mesh_dm):
    fn, message = COLLECTIVE_ERRORS[case]
    with pytest.raises(ts.ShardingError, match=message):
        C.shard_map(fn, mesh=mesh_dm, in_specs=P("data"), out_specs=P("data"))(torch.zeros(8))


def test_collective_outside_shard_map():
    with pytest.raises(ts.ShardingError, match=r"axis_index\(axis_name='data'\).*called outside shard_map"):
        C.axis_index("data")


def test_abstract_mesh_cannot_run():
    mesh = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with pytest.raises(ts.ShardingError, match=r"needs a concrete jax.sharding.Mesh"):
        C.shard_map(lambda x: x, mesh=mesh, in_specs=P("data"), out_specs=P("data"))


def test_result_feeds_the_next_shard_map(mesh_dm):
    x = torch.arange(8.0)
    double = C.shard_map(lambda t: t * 2, mesh=mesh_dm, in_specs=P("data"), out_specs=P("data"))
    total = C.shard_map(lambda t: C.psum(t.sum(), "data"), mesh=mesh_dm, in_specs=P("data"), out_specs=P())
    assert float(to_numpy(total(double(x)))) == 56.0
    assert isinstance(jax.device_get(double(x).jax()), np.ndarray)


def test_random_draws_inside_leave_eager_torch_random_ops_working(mesh_fsdp):
    """Dropout inside the mapped function drew from torchax's key under the trace; the key must not leak out."""
    drop = C.shard_map(lambda x: torch.nn.functional.dropout(x, 0.5), mesh=mesh_fsdp, in_specs=P("data"),
                       out_specs=P("data"))  # fmt: skip
    first, second = to_numpy(drop(torch.ones(16, 64))), to_numpy(drop(torch.ones(16, 64)))
    assert set(np.unique(first)) == {0.0, 2.0}
    assert not np.array_equal(first, second)  # the key advances between calls, as torch's generator does
    with torchax.default_env():
        assert torch.randn(3, device="jax").shape == (3,)  # eager: raised UnexpectedTracerError

"""load_safetensors of MoE checkpoints in the hub's per-expert names (transformers' own conversion mapping), and
torchshard's exports of MoE models back into transformers' from_pretrained."""

from __future__ import annotations

import functools
import re

import numpy as np
import optax
import pytest
import safetensors.torch
import torch
from jax.sharding import PartitionSpec as P

import torchshard as ts
from testsupport.helpers import assert_close, jit_forward
from tools.families import build, family, lm_loss
from torchshard import presets
from torchshard._interop import hf_conversion
from torchshard._interop.hf_conversion import Cat, Leaf, Stack

transformers = pytest.importorskip("transformers")
core = pytest.importorskip("transformers.core_model_loading")
# a tiny MoE config leaves out the dense MLP its tp_plan also names
pytestmark = pytest.mark.filterwarnings("ignore::torchshard.UnusedRuleWarning")

MESH_DM = {"data": 4, "model": 2}
MESH_EM = {"expert": 4, "model": 2}
# mixtral: block_sparse_moe.experts.N.w1/w2/w3; qwen2_moe: a shared expert; deepseek_v3: MLA + shared experts
FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3"]


@functools.cache
def _source(model_type: str) -> torch.nn.Module:
    return build(family(model_type), seed=1).eval()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """model type → a folder save_pretrained wrote (the hub's per-expert names), built on first use."""
    folders = {}

    def folder(model_type: str):
        if model_type not in folders:
            folders[model_type] = tmp_path_factory.mktemp(model_type)
            _source(model_type).save_pretrained(folders[model_type])
        return folders[model_type]

    return folder


def _stored_names(folder) -> list[str]:
    return list(safetensors.torch.load_file(folder / "model.safetensors"))


def _assert_state_equal(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype and torch.equal(actual[name], value), name


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (8, 12), generator=torch.Generator().manual_seed(0))


def _eager_logits(model_type: str) -> torch.Tensor:
    with torch.no_grad():
        return _source(model_type)(input_ids=_ids(), use_cache=False).logits


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_hub_format_moe_checkpoint_loads_into_a_meta_built_model(hub, model_type):
    folder = hub(model_type)
    assert any(".experts.0." in n for n in _stored_names(folder))  # per-expert names: the case under test
    with torch.device("meta"):
        model = build(family(model_type), seed=2)
    plan = ts.plan(model, ts.make_mesh(MESH_DM), presets.hf_rules(model, fsdp_min_size=1024))
    ts.load_safetensors(folder, model, plan)
    _assert_state_equal(ts.to_torch_state_dict(model), _source(model_type).state_dict())
    logits = jit_forward(model, output="logits", use_cache=False)(ts.shard_batch(_ids(), plan.mesh))
    assert_close(logits, _eager_logits(model_type))


def _forward(model, ids):
    return {"logits": model(input_ids=ids, use_cache=False).logits}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_hub_format_moe_checkpoint_loads_into_an_expert_parallel_trainer(hub, model_type):
    model = build(family(model_type), seed=2)
    plan = ts.plan(model, ts.make_mesh(MESH_EM), presets.hf_rules(model, expert_axis="expert", fsdp_axis=None))
    trainer = ts.Trainer(model, lm_loss, optax.adamw(1e-3), plan, batch_spec=P("expert"))
    ts.load_safetensors(hub(model_type), trainer)
    _assert_state_equal(ts.to_torch_state_dict(trainer), _source(model_type).state_dict())
    assert_close(trainer.evaluate(_ids(), _forward)["logits"], _eager_logits(model_type))


@pytest.mark.slow
def test_a_torchshard_export_of_an_moe_model_loads_in_from_pretrained(tmp_path):
    model = build(family("qwen2_moe"), seed=2)
    model.load_state_dict(_source("qwen2_moe").state_dict())
    ts.shard(model, ts.plan(model, ts.make_mesh(MESH_DM), presets.hf_rules(model, fsdp_min_size=1024)))
    ts.save_safetensors(tmp_path, model)
    model.config.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_state_equal(back.state_dict(), _source("qwen2_moe").state_dict())


def _recording(shapes: dict[str, tuple[int, ...]]):
    """A read function over arange tensors of ``shapes`` (values: the name's index × 1000 + position), and its log."""
    tensors = {n: torch.arange(float(np.prod(s))).reshape(s) + 1000 * i for i, (n, s) in enumerate(shapes.items())}
    reads: list[tuple[str, tuple]] = []

    def read(name, index):
        reads.append((name, tuple(s.indices(d)[:2] for s, d in zip(index, shapes[name], strict=True))))
        return tensors[name][index]

    return tensors, read, reads


def _experts(count: int = 4) -> tuple[dict, Cat]:
    """gate/up of ``count`` experts, [3, 2] each, as MergeModulelist + Concatenate(dim=1) fuse them: [E, 6, 2]."""
    shapes = {f"e.{i}.{p}": (3, 2) for p in ("gate", "up") for i in range(count)}
    stacks = tuple(Stack(0, tuple(Leaf(f"e.{i}.{p}", (3, 2)) for i in range(count))) for p in ("gate", "up"))
    return shapes, Cat(1, stacks)


def test_an_expert_shard_reads_only_its_experts():
    shapes, node = _experts()
    tensors, read, reads = _recording(shapes)
    part = node.read(read, (slice(2, 4), slice(None), slice(None)))
    whole = torch.cat([torch.stack([tensors[f"e.{i}.{p}"] for i in range(4)]) for p in ("gate", "up")], dim=1)
    assert node.shape == (4, 6, 2) and torch.equal(part, whole[2:4])
    assert sorted(n for n, _ in reads) == ["e.2.gate", "e.2.up", "e.3.gate", "e.3.up"]


def test_a_tensor_parallel_shard_reads_only_the_rows_it_holds():
    shapes, node = _experts()
    tensors, read, reads = _recording(shapes)
    part = node.read(read, (slice(None), slice(2, 4), slice(0, 1)))  # the last gate row and the first up row
    assert torch.equal(part[:, 0], torch.stack([tensors[f"e.{i}.gate"][2, :1] for i in range(4)]))
    assert torch.equal(part[:, 1], torch.stack([tensors[f"e.{i}.up"][0, :1] for i in range(4)]))
    assert sorted(reads) == sorted([(f"e.{i}.gate", ((2, 3), (0, 1))) for i in range(4)]
                                   + [(f"e.{i}.up", ((0, 1), (0, 1))) for i in range(4)])  # fmt: skip


def test_an_empty_slice_keeps_the_dtype_and_shape():
    shapes, node = _experts()
    _, read, _ = _recording(shapes)
    assert node.read(read, (slice(0, 0), slice(None), slice(None))).shape == (0, 6, 2)
    assert node.read(read, (slice(None), slice(6, 6), slice(None))).shape == (4, 0, 2)


def test_experts_are_stacked_in_natural_order_past_ten():
    model = build(family("qwen2_moe"))
    expected = set(model.state_dict())
    names = [f"model.layers.0.mlp.experts.{i}.down_proj.weight" for i in (10, 2, 0, 1, 3, 4, 5, 6, 7, 8, 9)]
    conversion = hf_conversion.convert(model, dict.fromkeys(names, (4, 8)), expected)
    node = conversion.built["model.layers.0.mlp.experts.down_proj"]
    assert [leaf.name.split(".")[5] for leaf in node.parts] == [str(i) for i in range(11)]  # type: ignore[union-attr]


def _with_transpose(model):
    """transformers' mapping for ``model`` with an op load_safetensors does not implement on the experts' down_proj."""
    converter = core.WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj",
                                     [core.MergeModulelist(dim=0), core.Transpose(1, 2)])  # fmt: skip
    return [converter]


def test_an_unknown_conversion_op_is_refused_naming_it_and_the_tensor(hub, monkeypatch):
    monkeypatch.setattr(hf_conversion, "transforms", _with_transpose)
    model = build(family("qwen2_moe"), seed=2)
    plan = ts.plan(model, ts.make_mesh({"data": 8}))
    before = model.model.embed_tokens.weight.detach().clone()
    with pytest.raises(
        ts.ShardingError,
        match=r"model.layers.0.mlp.experts.down_proj \(from model.layers.0.mlp.experts.0.down_proj.weight "
        rf"and {model.config.num_experts - 1} more\): transformers converts it with Transpose",
    ):
        ts.load_safetensors(hub("qwen2_moe"), model, plan)
    assert torch.equal(model.model.embed_tokens.weight, before)  # nothing placed


def test_experts_stored_in_different_dtypes_are_refused(hub, tmp_path):
    tensors = safetensors.torch.load_file(hub("qwen2_moe") / "model.safetensors")
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = build(family("qwen2_moe"), seed=2)
    with pytest.raises(ts.ShardingError, match=r"experts.down_proj: built from stored tensors of dtypes \['BF16', "):
        ts.load_safetensors(tmp_path, model, ts.plan(model, ts.make_mesh({"data": 8})))


def test_a_missing_expert_is_named(hub, tmp_path):
    tensors = safetensors.torch.load_file(hub("qwen2_moe") / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = build(family("qwen2_moe"), seed=2)
    with pytest.raises(ts.ShardingError, match=r"experts.gate_up_proj \(from .*\): its parts have shapes"):
        ts.load_safetensors(tmp_path, model, ts.plan(model, ts.make_mesh({"data": 8})))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft on transformers 5
def test_a_peft_wrapped_moe_model_converts_with_the_wrapped_models_mapping(hub):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(build(family("qwen2_moe"), seed=2), config)
    plan = ts.plan(model, ts.make_mesh({"data": 8}))
    peft_names = [(r"^", "base_model.model."), (r"\.(q_proj|v_proj)\.", r".\1.base_layer.")]
    ts.load_safetensors(hub("qwen2_moe"), model, plan, rename=peft_names, strict=False)  # the adapters keep theirs
    state = ts.to_torch_state_dict(model)
    for name, value in _source("qwen2_moe").state_dict().items():
        for pattern, replacement in peft_names:
            name = re.sub(pattern, replacement, name)
        assert torch.equal(state[name], value), name

"""README.md and the docs pages as written: every ```python block runs, every command they show exists.

A block that continues an earlier example (it uses a ``model`` or ``trainer`` it does not build)
says so in an HTML comment right above it, ``<!-- readme-test: setup=NAME (what it provides) -->``,
invisible on the rendered page; ``SETUPS[NAME]`` builds those names (tiny sizes) and, where the
block only builds something, ``THEN[NAME]`` uses it once. Every other block runs on its own.
A block that takes over ~1.5 s (it compiles a pipeline, launches a process) says ``slow`` there too,
``<!-- readme-test: setup=NAME slow (...) -->`` or ``<!-- readme-test: slow -->``: `dev.py quick` skips it.
A ```py block shows code that needs what this machine lacks (a Hub snapshot of Llama-3-8B,
accelerators): it is compiled, not run.
Shell commands (``python3 dev.py test``, ``python -m torchshard plan ...``, benchmarks) take minutes, so
they are not run here: each command must exist and accept every flag a page gives it (tests/test_fresh_clone.py
runs the README's and the first-run page's in a fresh clone).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optax
import pytest
import torch

import torchshard as ts
from torchshard._multihost import preemption as _preemption

ROOT = Path(__file__).resolve().parents[1]
PAGES = {str(p.relative_to(ROOT)): p.read_text() for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/**/*.md"))]}
BLOCK = re.compile(
    r"(?:<!-- readme-test:(?: setup=(?P<setup>\w+))?(?P<slow> slow\b)?[^>]*-->\n)?"
    r"```(?P<lang>\w*)\n(?P<body>.*?)```",
    re.S,
)
MATCHES = [(page, text, m) for page, text in PAGES.items() for m in BLOCK.finditer(text)]


def _where(page: str, text: str, match: re.Match[str]) -> str:
    return f"{page}:{text[: match.start()].count(chr(10)) + 1}"


# (language, setup, body, "page:line") of every fenced block of every page
BLOCKS = [(m["lang"], m["setup"], m["body"], _where(page, text, m)) for page, text, m in MATCHES]
PYTHON = [(setup, body, where) for lang, setup, body, where in BLOCKS if lang == "python"]
SLOW = {_where(page, text, m) for page, text, m in MATCHES if m["slow"]}
SHOWN = [(body, where) for lang, _, body, where in BLOCKS if lang == "py"]


def _ids(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (8, 16), generator=torch.Generator().manual_seed(0))


def _tiny_llama_config() -> Any:
    import transformers

    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128)  # fmt: skip


def _hf_llama() -> dict[str, Any]:
    import transformers

    model = transformers.LlamaForCausalLM(_tiny_llama_config())  # use_cache=True, as configs default
    mesh = ts.make_mesh({"data": 4, "model": 2})
    plan = ts.plan(model, mesh, ts.presets.hf_rules(model))
    loss_fn = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    return {"ts": ts, "optax": optax, "model": model, "loss_fn": loss_fn, "plan": plan, "ids": _ids()}


def _trainers() -> dict[str, Any]:
    def trainer(mesh_axes: dict[str, int]) -> ts.Trainer:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        plan = ts.plan(model, ts.make_mesh(mesh_axes), ts.presets.fsdp(min_size=64))
        return ts.Trainer(model, lambda m, b: m(b).square().mean(), optax.adamw(1e-3), plan)

    first = trainer({"data": 8})
    first.step(torch.randn(8, 16))
    return {"ts": ts, "trainer": first, "other_trainer": trainer({"data": 4, "model": 2})}


def _dcp() -> dict[str, Any]:
    ns = _trainers()
    return {**ns, "torch_model": torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))}


def _after_dcp(ns: dict[str, Any]) -> None:
    state = ts.to_torch_state_dict(ns["trainer"])
    assert all(torch.equal(ns["plain"]["model"][k], v) for k, v in state.items()) and ns["trainer"].step_count == 1


def _hf_config() -> dict[str, Any]:
    import transformers

    return {"ts": ts, "optax": optax, "transformers": transformers, "config": _tiny_llama_config(), "ids": _ids()}


def _hf_moe() -> dict[str, Any]:
    import transformers

    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, vocab_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)  # fmt: skip
    return {"ts": ts, "model": transformers.MixtralForCausalLM(config)}


def _hf_llama_stack() -> dict[str, Any]:
    import transformers

    config = _tiny_llama_config()
    config.num_hidden_layers = 4  # one layer per stage of a 4-stage pipeline
    loss_fn = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    return {"ts": ts, "optax": optax, "model": transformers.LlamaForCausalLM(config), "loss_fn": loss_fn}


def _context() -> dict[str, Any]:
    import transformers

    model = transformers.LlamaForCausalLM(_tiny_llama_config())  # 2 layers: each adds a ring attention to compile
    loss_fn = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    return {
        "ts": ts,
        "optax": optax,
        "model": model,
        "loss_fn": loss_fn,
        "rules": ts.presets.fsdp("data", min_size=1024),
    }


def _pipeline_init() -> dict[str, Any]:
    from testsupport.models import BlockStack

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        logits = m(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return {"ts": ts, "optax": optax, "build": lambda: BlockStack(depth=8), "loss_fn": loss_fn}


SETUPS: dict[str, Callable[[], dict[str, Any]]] = {
    "pipeline_init": _pipeline_init,
    "hf_llama_stack": _hf_llama_stack,
    "context": _context,
    "hf_llama": _hf_llama,
    "trainers": _trainers,
    "dcp": _dcp,
    "trainer_loop": _trainers,
    "trainer_data": _trainers,
    "hf_config": _hf_config,
    "hf_moe": _hf_moe,
}


def _after_checkpoints(ns: dict[str, Any]) -> None:
    assert ns["other_trainer"].step_count == ns["trainer"].step_count == 1
    assert list(ns["sd"]) == list(ns["trainer"].model.state_dict())
    assert Path("export/model.safetensors.index.json").exists()


def _after_loop(ns: dict[str, Any]) -> None:
    assert ns["ts"].checkpoint_steps("ckpt/") == [3, 5]  # keep_last=2 of the background saves at 3 and 5
    assert ns["trainer"].step_count == 6
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # preempted() caught SIGTERM from its first call on
    _preemption._state["installed"] = False


def _after_data(ns: dict[str, Any]) -> None:
    assert ns["other_trainer"].step_count == 4
    assert torch.equal(ns["fourth"], list(ns["make_loader"](seed=0))[3])  # the uninterrupted run's 4th batch


THEN: dict[str, Callable[[dict[str, Any]], None]] = {
    "hf_llama": lambda ns: ns["trainer"].step(ns["ids"]),  # bf16, remat and scan, from a default config
    "trainers": _after_checkpoints,
    "dcp": _after_dcp,
    "trainer_loop": _after_loop,
    "trainer_data": _after_data,
    "hf_llama_stack": lambda ns: ns["trainer"].step(_ids().repeat(2, 1)),  # 16 rows: 8 micro-batches × data 2
    "context": lambda ns: ns["trainer"].step(_ids()),  # 16 tokens: 2 per device of the ring, balanced
    "pipeline_init": lambda ns: ns["trainer"].step(_ids(64)),  # 8 rows: 4 micro-batches × data 2
}


def test_the_pages_have_python_blocks_and_each_setup_they_name_exists():
    assert len(PYTHON) >= 5
    assert any(where.startswith("README.md:") for _, _, where in PYTHON)
    assert {setup for setup, _, _ in PYTHON if setup} <= set(SETUPS)


@pytest.mark.parametrize(
    ("setup", "body", "where"),
    [pytest.param(*block, marks=pytest.mark.slow if block[2] in SLOW else (), id=block[2]) for block in PYTHON],
)
def test_python_block_runs_as_written(setup, body, where, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # blocks write checkpoints and exports to relative paths
    ns = SETUPS[setup]() if setup else {}
    exec(compile(body, where, "exec"), ns)
    if setup in THEN:
        THEN[setup](ns)


@pytest.mark.parametrize(("body", "where"), SHOWN, ids=[where for _, where in SHOWN])
def test_shown_python_block_compiles(body, where):
    compile(body, where, "exec")


# --- commands: they exist and take the flags shown ------------------------------------------------


def _commands() -> list[str]:
    spans = [span for text in PAGES.values() for span in re.findall(r"`(python3? [^`]+)`", text)]
    lines = [ln.split("#")[0].strip() for lang, _, body, _ in BLOCKS if lang == "bash" for ln in body.splitlines()]
    return sorted({" ".join(c.split()) for c in spans + lines if c.startswith(("python ", "python3 "))})


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}  # private: argparse has no public list


def _launch_options() -> set[str]:
    import torchshard.launch

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        torchshard.launch.parse_args(["--help"])
    return set(re.findall(r"--[\w-]+", out.getvalue()))


def _command_problems(command: str) -> list[str]:
    words = shlex.split(command)[1:]
    if words[:2] == ["dev.py", "run"]:  # python3 dev.py run SCRIPT ARGS: the script's own flags
        words = words[2:]
        if words[0].isupper():  # the usage line itself: `python3 dev.py run SCRIPT [ARGS]`
            return []
    flags = [w for w in words if w.startswith("--")]
    if words[0] == "dev.py":
        dev = runpy.run_path(str(ROOT / "dev.py"), run_name="readme_check")
        return [] if words[1] in dev["ALL_COMMANDS"] else [f"{command}: dev.py has no command {words[1]!r}"]
    if words[:2] == ["-m", "torchshard"]:
        from torchshard.__main__ import build_parser

        plan = build_parser()._subparsers._group_actions[0].choices[words[2]]
        return [f"{command}: no option {f}" for f in flags if f not in _options(plan)]
    if words[:2] == ["-m", "torchshard.launch"]:
        return [f"{command}: no option {f}" for f in flags if f not in _launch_options()]
    if words[:2] == ["-m", "torchshard.lm_eval"]:  # lm_eval's own command line
        import lm_eval._cli.run

        source = Path(lm_eval._cli.run.__file__).read_text()
        return [f"{command}: lm_eval has no option {f}" for f in flags if f'"{f}"' not in source]
    script = ROOT / words[0]
    if not script.is_file():
        return [f"{command}: no file {words[0]}"]
    source = script.read_text()
    return [f"{command}: {words[0]} has no option {f}" for f in flags if f'"{f}"' not in source]


def test_every_command_the_pages_show_exists_with_its_flags():
    commands = _commands()
    assert any("dev.py test" in c for c in commands) and any("-m torchshard plan" in c for c in commands)
    assert [p for c in commands for p in _command_problems(c)] == []


def test_the_docstring_examples_conftest_marks_slow_exist(request):
    """`dev.py quick` leaves these out by name (root conftest.py): a renamed function would silently run again."""
    import importlib

    names = request.config.pluginmanager.get_plugin(str(ROOT / "conftest.py")).SLOW_EXAMPLES
    assert "torchshard._search.search.search" in names
    for name in names:
        module, _, attr = name.rpartition(".")
        assert ">>>" in (getattr(importlib.import_module(module), attr).__doc__ or ""), name


# --- the API reference: generated from each public face's __all__ -----------------------------------------------


def test_the_api_reference_has_a_page_for_every_public_face_and_lists_its_all():
    hooks = runpy.run_path(str(ROOT / "tools" / "docs_hooks.py"))
    faces = {"torchshard", *(f"torchshard.{p.stem}" for p in (ROOT / "torchshard").glob("[a-z]*.py"))}
    marked = {m["module"] for page in PAGES.values() for m in hooks["MARKER"].finditer(page)}
    assert marked == faces
    assert hooks["public_names"]("torchshard") == ts.__all__
    assert hooks["expand"]("<!-- api: torchshard.presets -->").startswith("::: torchshard.presets.")

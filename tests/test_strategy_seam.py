"""The strategy seam: a strategy that is one folder (tests/toy_strategy/) plugs in with one register line.

It then shows up in the Trainer, AbstractTrainer, ``plan --compile``, ``plan --search``, the strategy
matrix test and the API reference.

And the modules that must not know strategies by name (the scan, fit, search, the command line)
import none of their modules (read with ast, like test_layering).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import pathlib
import re
import sys

import jax
import numpy as np
import optax
import pytest
import torch
from toy_strategy import binding
from toy_strategy.option import MARKS, Mark

import torchshard as ts
from testsupport.helpers import torch_losses
from torchshard.__main__ import EXIT_OK, EXIT_USAGE, main
from torchshard._search.search_compile import trainer_options
from torchshard._search.space import ModelDims, SearchLayout, layouts
from torchshard._strategies import RESERVED, STRATEGIES, register, reserve

PACKAGE = pathlib.Path(ts.__file__).parent
TOY = binding.STRATEGY


@pytest.fixture
def toy():
    register(binding.STRATEGY)  # the one line: the toy is the folder tests/toy_strategy/
    MARKS.clear()
    yield TOY
    STRATEGIES.pop(TOY.keyword)


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def test_a_toy_strategy_runs_in_the_step_and_trains_as_eager_torch(toy):
    torch.manual_seed(0)
    model = Stack()
    eager = copy.deepcopy(model)
    batches = [(torch.randn(16, 8), torch.randn(16, 2)) for _ in range(3)]
    plan = ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=16))
    trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1), plan, scan_layers=True, mark=Mark("toy"))
    losses = [float(trainer.step(b)["loss"]) for b in batches]
    assert MARKS and set(MARKS) == {"toy:layers"}  # the hook ran the stack when the step was traced
    assert losses == pytest.approx(torch_losses(eager, loss_fn, torch.optim.SGD(eager.parameters(), 0.1), batches),
                                   rel=1e-4)  # fmt: skip


def test_the_trainer_checks_a_toy_option_and_unknown_keywords(toy):
    plan = ts.plan(Stack(), ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=16))
    with pytest.raises(ts.ArgumentError, match=r"mark.*None or a Mark"):
        ts.Trainer(Stack(), loss_fn, optax.sgd(0.1), plan, scan_layers=True, mark="toy")
    with pytest.raises(ts.ShardingError, match=r"Mark: no scanned stack to mark; pass scan_layers=True"):
        ts.Trainer(Stack(), loss_fn, optax.sgd(0.1), plan, mark=Mark())
    with pytest.raises(TypeError, match=r"Trainer.__init__\(\) got an unexpected keyword argument 'marc'"):
        ts.Trainer(Stack(), loss_fn, optax.sgd(0.1), plan, marc=Mark())


def test_init_sharded_takes_only_strategies_that_lay_out_layers(toy):
    with pytest.raises(ts.ArgumentError, match=r"mark: the model is built the same.*init_sharded takes \['pipeline'\]"):
        ts.init_sharded(Stack, ts.make_mesh({"data": 8}), mark=Mark())
    with pytest.raises(TypeError, match=r"init_sharded\(\) got an unexpected keyword argument 'marc'"):
        ts.init_sharded(Stack, ts.make_mesh({"data": 8}), marc=Mark())


def _never_bound(option, setting):
    raise AssertionError("a refused strategy is never bound")


# fields of the toy's Strategy replaced → what register says; nothing is registered
REFUSED = {
    "taken": ({"keyword": "pipeline"}, r"strategy keyword 'pipeline' is taken by Pipeline; give the strategy another"),
    **{
        keyword: ({"keyword": keyword}, rf"strategy keyword '{keyword}' of Mark is Trainer's own parameter '{keyword}'")
        for keyword in ("donate", "plan", "seed", "remat", "model")
    },
    "not-an-identifier": ({"keyword": "mark-it"}, r"strategy keyword 'mark-it' is not a Python identifier"),
    "bind-none": ({"bind": None},
                  r"strategy 'mark': bind must be a function bind\(option, setting\) -> Bound, got None$"),
    "bind-not-callable": ({"bind": "bind"}, r"strategy 'mark': bind must be a function .*, got 'bind'"),
    "option-not-a-class": ({"option": "Mark"},
                           r"strategy 'mark': option must be the class its keyword takes, got 'Mark'"),
    "every-problem": ({"keyword": "seed", "bind": None},
                      r"(?s)cannot register the strategy \(2 problems\).*'seed' of Mark.*bind must be a function"),
}  # fmt: skip


@pytest.mark.parametrize(("fields", "match"), REFUSED.values(), ids=REFUSED.keys())
def test_register_refuses_a_bad_strategy_before_registering_it(fields, match):
    before = dict(STRATEGIES)
    with pytest.raises(ts.ArgumentError, match=match):
        register(dataclasses.replace(TOY, **{"bind": _never_bound, **fields}))
    assert before == STRATEGIES


def test_register_refuses_what_is_no_strategy():
    with pytest.raises(ts.ArgumentError, match=r"register\(\) takes a torchshard\._train\.strategy\.Strategy, got"):
        register(Mark())


SCHEDULE_REFUSED = {
    "taken": ({"name": "gpipe"}, r"pipeline schedule 'gpipe' is taken by another schedule"),
    "empty-name": ({"name": ""}, r"pipeline schedule name '' must be a non-empty string"),
    "bubble-none": ({"bubble": None}, r"schedule 'toy': bubble must be a function, got None"),
    "loop-not-callable": ({"loop": 3}, r"schedule 'toy': loop must be None or a function"),
    "searched-not-searchable": ({"searched": True, "searchable": False}, r"searched but not searchable"),
    "every-problem": ({"name": "gpipe", "in_flight": 2}, r"(?s)\(2 problems\).*taken.*in_flight must be"),
}


@pytest.mark.parametrize(("fields", "match"), SCHEDULE_REFUSED.values(), ids=SCHEDULE_REFUSED.keys())
def test_the_schedule_registry_refuses_a_bad_schedule_before_registering_it(fields, match):
    from torchshard._strategies.pipeline.schedule import SCHEDULES, Schedule
    from torchshard._strategies.pipeline.schedule import register as register_schedule

    before = dict(SCHEDULES)
    with pytest.raises(ts.ArgumentError, match=match):
        register_schedule(Schedule(**{"name": "toy", "summary": "a toy", **fields}))
    with pytest.raises(ts.ArgumentError, match=r"register takes a Schedule\(name=..., summary=..., ...\), got str"):
        register_schedule("gpipe")  # type: ignore[arg-type]
    assert before == SCHEDULES


def test_reserving_a_parameter_a_strategy_takes_is_refused(toy):
    def build(model, *, mark=None, **strategies):
        return model

    with pytest.raises(ts.ArgumentError, match=r"strategy keyword 'mark' of Mark is build's own parameter 'mark'"):
        reserve(build)
    assert "mark" not in RESERVED


@pytest.mark.parametrize("returned", [None, "marked", Mark()], ids=["none", "str", "the-option"])
def test_a_bind_that_returns_no_bound_is_refused_when_the_trainer_is_built(returned):
    register(dataclasses.replace(TOY, bind=lambda option, setting: returned))
    plan = ts.plan(Stack(), ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=16))
    what = re.escape(f"returned {returned!r} ({type(returned).__name__}), not a Bound")
    try:
        with pytest.raises(ts.ArgumentError, match=rf"strategy 'mark' \(Mark\): bind\(option, setting\) {what}"):
            ts.Trainer(Stack(), loss_fn, optax.sgd(0.1), plan)
    finally:
        STRATEGIES.pop(TOY.keyword)


STACK_PY = (
    "import torch\n\n"
    "class Stack(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())\n"
    "                                          for _ in range(3))\n\n"
    "    def forward(self, x):\n"
    "        for layer in self.layers:\n"
    "            x = layer(x)\n"
    "        return x\n\n"
    "def loss(model, batch):\n"
    "    return model(batch).square().mean()\n"
)


def test_plan_lists_and_accepts_the_toy_flag(toy, capsys, tmp_path, monkeypatch):
    (tmp_path / "stack.py").write_text(STACK_PY)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--mark TAG" in capsys.readouterr().out
    argv = ["plan", "stack.py:Stack", "--mesh", "data=8", "--preset", "fsdp", "--batch", "16x8:float32", "--loss",
            "stack.py:loss", "--scan", "--mark", "hello"]  # fmt: skip
    assert main(argv) == EXIT_USAGE
    assert "--mark given without --compile" in capsys.readouterr().err
    assert main([*argv, "--compile", "--format", "json"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["compile"]["mark"] == {"tag": "hello"} and data["compile"]["pipeline"] is None
    assert set(MARKS) == {"hello:layers"}
    assert main([*argv, "--compile"]) == EXIT_OK
    assert "scan_layers=True, mark hello; batch" in capsys.readouterr().out


def test_search_candidates_give_the_toy_its_option(toy):
    assert trainer_options(Stack(), SearchLayout(mesh=(("data", 8),)))["mark"] == Mark("searched")
    assert trainer_options(Stack(), SearchLayout(mesh=(("data", 1),)))["mark"] is None


def test_the_toys_search_choice_is_a_search_keyword_and_a_flag(toy, capsys):
    dims = ModelDims(layers=3, heads=None, kv_heads=None, experts=None, hidden=8)
    fixed = {"remat": (None,), "scan": (True,), "precision": ("bf16",), "microbatches": (1,)}
    found = layouts(2, dims, (4, 8), tags=("searched", "other"), **fixed)
    tags = [lay.option("tag") for lay in found if lay.degree("data") == 2]
    assert tags == ["searched", "other"] and all(lay.option("tag") is None for lay in found if lay.degree("data") == 1)
    other = next(lay for lay in found if lay.option("tag") == "other")
    assert trainer_options(Stack(), other)["mark"] == Mark("other") and other.label() == "data=2 scan bf16"
    with pytest.raises(
        ts.ArgumentError, match=r"search: tags=\['nope'\]: choose one or more of \['searched', 'other'\]"
    ):
        ts.inspect.search(Stack, devices=2, batch=(4, 8), tags=("nope",))
    with pytest.raises(TypeError, match=r"search\(\) got an unexpected keyword argument 'tagz'"):
        ts.inspect.search(Stack, devices=2, batch=(4, 8), tagz=("searched",))
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--tags TAGS" in capsys.readouterr().out


# the strategies' own modules: every module of a strategy's folder (the registry, _strategies/__init__.py, is not one)
STRATEGY_MODULES = {
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts) for p in (PACKAGE / "_strategies").glob("*/**/*.py")
} | {f"torchshard._strategies.{p.name}" for p in (PACKAGE / "_strategies").iterdir() if p.is_dir()}
UNAWARE = ["_train/scan.py", "_report/fit.py", "_report/cli.py", "__main__.py",
           *(str(p.relative_to(PACKAGE)) for p in sorted((PACKAGE / "_search").glob("*.py")))]  # fmt: skip


def _imported(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize("module", UNAWARE)
def test_the_scan_fit_search_and_cli_import_no_strategy_module(module):
    named = sorted(_imported(PACKAGE / module) & STRATEGY_MODULES)
    assert named == [], f"{module} imports {named}; read the strategies from torchshard._strategies.STRATEGIES"


@pytest.mark.parametrize("folder", sorted(p.name for p in (PACKAGE / "_strategies").iterdir() if p.is_dir()
                                          and not p.name.startswith("_")))  # fmt: skip
def test_no_strategy_imports_another(folder):
    mine = f"torchshard._strategies.{folder}"
    others = {m for m in STRATEGY_MODULES if not (m == mine or m.startswith(mine + "."))}
    for path in sorted((PACKAGE / "_strategies" / folder).rglob("*.py")):
        named = sorted(_imported(path) & others)
        assert named == [], f"{path.relative_to(PACKAGE)} imports another strategy's {named}: share through _train"


# the strategies torchshard registers itself (the toy's bind lives in tests/toy_strategy/, not in torchshard)
OWN = [keyword for keyword, s in STRATEGIES.items() if s.bind.__module__.startswith("torchshard.")]
PARTS = ("__init__.py", "option.py", "binding.py")  # every strategy's folder has these (docs/strategies/writing.md)


def _shape_problems(strategy) -> list[str]:
    """How the folder whose ``binding`` defines ``strategy`` differs from the shape every strategy's folder has."""
    root = strategy.bind.__module__.split(".")[0]
    owners = sorted(n for n, m in list(sys.modules.items()) if n.split(".")[0] == root
                    and getattr(m, "__dict__", {}).get("STRATEGY") is strategy)  # fmt: skip
    if len(owners) != 1 or not owners[0].endswith(".binding"):
        return [f"its STRATEGY is defined in {owners}, not in one folder's binding.py"]
    package, folder = owners[0].removesuffix(".binding"), pathlib.Path(sys.modules[owners[0]].__file__).parent
    files = {p.name for p in folder.glob("*.py")}
    problems = [f"{folder.name}/ has no {part}" for part in PARTS if part not in files]
    defined = strategy.option.__module__
    if defined.split(".")[0] == root and defined != f"{package}.option":  # a class of its own, not str or object
        problems.append(f"its option {strategy.option.__name__} is defined in {defined}, not in {package}.option")
    searched = strategy.searched is not None or strategy.axis is not None or bool(strategy.search_options)
    if searched != ("search.py" in files):
        problems.append(f"{folder.name}/search.py must exist exactly when the strategy is searched ({searched})")
    flagged = strategy.flag is not None
    if flagged != ("flag.py" in files):
        problems.append(f"{folder.name}/flag.py must exist exactly when the strategy has a flag ({flagged})")
    return problems


@pytest.mark.parametrize("keyword", OWN)
def test_every_strategy_torchshard_registers_is_a_folder_of_the_same_shape(keyword):
    strategy = STRATEGIES[keyword]
    home = re.fullmatch(r"torchshard\._strategies\.\w+\.binding", strategy.bind.__module__)
    assert home, f"strategy {keyword!r}: its bind is in {strategy.bind.__module__}, not in a _strategies/<folder>/"
    problems = _shape_problems(strategy)
    assert problems == [], f"strategy {keyword!r}: " + "; ".join(problems)


def test_the_toy_is_a_folder_of_the_same_shape(toy):
    assert _shape_problems(toy) == []


def test_an_abstract_trainer_takes_the_toy_and_compiles_its_hook(toy):
    with torch.device("meta"):
        meta = Stack()
    plan = ts.plan(meta, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=16))
    abstract = ts.inspect.AbstractTrainer(meta, loss_fn, optax.sgd(0.1), plan, scan_layers=True, mark=Mark("abs"))
    batch = (jax.ShapeDtypeStruct((16, 8), np.float32), jax.ShapeDtypeStruct((16, 2), np.float32))
    assert abstract.lower(batch).compile().memory_analysis() is not None
    assert set(MARKS) == {"abs:layers"} and abstract.strategies["mark"].option == Mark("abs")


@pytest.mark.slow  # a search compiles a candidate in a child process
def test_plan_search_gives_the_toy_its_option(toy):
    from testsupport.models import tiny_llama

    best = ts.inspect.search(tiny_llama(meta=True), devices=2, batch=(4, 16), remat=(None,), scan=(True,),
                             precision=("bf16",), microbatches=(1,), max_compiles=1)  # fmt: skip
    marked = [c for c in best if c.mesh.get("data", 1) > 1]
    assert marked and all(c.options["mark"] == {"tag": "searched"} for c in marked)
    assert all(c.options["mark"] is None for c in best if c.mesh.get("data", 1) == 1)


def test_the_strategy_matrix_test_names_the_toy_until_it_has_rows(toy):
    import test_matrix

    assert test_matrix.rowless_strategies() == ["mark"]


def test_the_api_reference_lists_the_toy_from_its_register_line(tmp_path):
    from tools import docs_hooks

    registry = tmp_path / "registry.py"
    registry.write_text(docs_hooks.REGISTRY.read_text() + "\nfrom toy_strategy import binding as marked\n"
                        "register(marked.STRATEGY)\n")  # fmt: skip
    table = docs_hooks.strategy_table(docs_hooks.registered(registry, (docs_hooks.ROOT, PACKAGE.parent / "tests")))
    assert "| `mark=` | `Mark` | `--mark` | its option |" in table
    assert "| `pipeline=` | `Pipeline` | `--pipeline` | a mesh axis and its option |" in table


def test_the_writing_a_strategy_page_shows_the_toys_own_code():
    page = (PACKAGE.parent / "docs" / "strategies" / "writing.md").read_text()
    toy = "".join(p.read_text() for p in sorted((PACKAGE.parent / "tests" / "toy_strategy").glob("*.py")))
    blocks = re.findall(r"```py\n(.*?)```", page, re.S)
    assert len(blocks) >= 4 and all(block in toy or block.strip() == "register(binding.STRATEGY)" for block in blocks)

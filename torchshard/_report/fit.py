"""Will it fit: ``plan --compile`` compiles the real training step for simulated devices and reports its memory."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import optax
import torch

from torchshard._base.format import columns, fmt_bytes
from torchshard._bridge.env import backend_started
from torchshard._report.compiled import CompiledMemory, memory
from torchshard._report.inspection import collectives
from torchshard._report.memory import training_memory
from torchshard._report.usage import UsageError
from torchshard._sharding.mesh import use_cpu_devices
from torchshard._sharding.plan import ShardingPlan
from torchshard._strategies import STRATEGIES, flagged
from torchshard._train.precision import master_dtype, named_policy
from torchshard._train.remat import DEFAULT_POLICY, Remat
from torchshard._trainer.abstract import AbstractTrainer

EXIT_DOES_NOT_FIT = 3
OPTIMIZERS: dict[str, Callable[[float], optax.GradientTransformation]] = {
    "adamw": optax.adamw,
    "adam": optax.adam,
    "sgd": optax.sgd,
}
_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 0}  # optimizer-state copies of each trainable parameter
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "half": torch.float16,
           "float": torch.float32, "long": torch.int64, "int": torch.int32}  # fmt: skip
# options that only mean something with --compile (their argparse defaults are None), strategies' flags too
COMPILE_ONLY = (
    "batch",
    "scan",
    "remat",
    "remat_policy",
    "precision",
    "optimizer",
    "grad_accum",
    "batch_spec",
    "loss",
    "device_memory",
)


def compile_only() -> list[str]:
    """The argparse names of every option that only means something with ``--compile``."""
    return [*COMPILE_ONLY, *(s.keyword for s in flagged())]


def parse_size(text: str) -> int:
    """``"80GiB"`` → bytes; decimal units (``GB``) are powers of 1000, binary ones (``GiB``) of 1024.

    Examples:
        >>> parse_size("80GiB") == 80 * 2**30, parse_size("1.5 GB"), parse_size("4096")
        (True, 1500000000, 4096)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise UsageError(f"--device-memory {text!r}: write a size such as 80GiB, 40GB or 17179869184")
    return int(float(match.group(1)) * _UNITS[unit])


def _dtype(name: str, text: str) -> torch.dtype:
    dtype = _DTYPES.get(name, getattr(torch, name, None))
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--batch {text!r}: {name!r} is not a torch dtype (int64, int32, float32, bfloat16, ...)")
    return dtype


def parse_batch(text: str) -> list[torch.Tensor]:
    """``"256x4096"`` → one int64 ``meta`` tensor [256, 4096]; ``"32x16:float32,32:int64"`` → one per leaf.

    Examples:
        >>> [(tuple(t.shape), t.dtype) for t in parse_batch("8x128,8:bf16")]
        [((8, 128), torch.int64), ((8,), torch.bfloat16)]
    """
    leaves = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        dims, _, name = part.partition(":")
        sizes = dims.lower().split("x")
        if not all(s.strip().isdigit() and int(s) > 0 for s in sizes):
            raise UsageError(f"--batch {text!r}: write each leaf as sizes joined by x, e.g. 256x4096 or 32x16:float32")
        dtype = _dtype(name.strip(), text) if name.strip() else torch.int64
        leaves.append(torch.empty([int(s) for s in sizes], dtype=dtype, device="meta"))
    if not leaves:
        raise UsageError("--batch is empty; write BxS for token ids, e.g. --batch 256x4096")
    return leaves


def parse_batch_spec(text: str | None, mesh: Any, default_axis: str) -> Any:
    """``--batch-spec data,context`` → ``("data", "context")``; ``none`` → replicated; unset → the FSDP axis."""
    if text is None:
        return (default_axis,) if default_axis in mesh.shape else ()
    if text.strip().lower() == "none":
        return ()
    return tuple(None if a.strip().lower() == "none" else a.strip() for a in text.split(","))


def strategy_options(args: argparse.Namespace, axes: dict[str, int]) -> dict[str, Any]:
    """Each registered strategy's option its ``--KEYWORD`` flag asks for (absent: None), parsed against ``--mesh``.

    Raises:
        UsageError: a flag's mistake, as its strategy says it.
    """
    options = {}
    for strategy in flagged():
        assert strategy.flag is not None
        text = getattr(args, strategy.keyword, None)
        try:
            options[strategy.keyword] = None if text is None else strategy.flag.parse(text, axes)
        except ValueError as err:
            raise UsageError(str(err)) from err
    return options


def devices_for(axes: dict[str, int]) -> list[Any]:
    """The simulated CPU devices ``--compile`` builds the mesh from: one per mesh position."""
    if any(n < 1 for n in axes.values()):
        raise UsageError(f"--compile: give every mesh axis a positive size (got {axes}); -1 needs real devices")
    return simulated_devices(math.prod(axes.values()))


def simulated_devices(n: int) -> list[Any]:
    """``n`` CPU devices to compile for: JAX is asked for them before its backend starts, else the first ``n``."""
    if not backend_started():
        jax.config.update("jax_platforms", "cpu")  # simulate on CPU devices even where accelerators exist
        use_cpu_devices(n)
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise UsageError(
            f"--compile needs {n} CPU devices, but JAX already started with {len(devices)} in this process; run "
            f"python -m torchshard plan ... --compile in a fresh process"
        )
    return devices[:n]


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A causal LM's next-token loss with ``ids`` as its own labels (transformers shifts them inside)."""
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _takes(function: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def loss_for(model: torch.nn.Module, target: str | None, load: Callable[[str], Any]) -> Callable[..., Any]:
    """``--loss MODULE:FN``, else `lm_loss` for a model whose forward takes ``input_ids`` and ``labels``."""
    if target is not None:
        fn = load(target)
        if not callable(fn):
            raise UsageError(f"--loss {target!r} is a {type(fn).__name__}, not a function loss_fn(model, batch)")
        return fn
    if _takes(model.forward, "input_ids") and _takes(model.forward, "labels"):
        return lm_loss
    raise UsageError(
        f"--compile: {type(model).__name__}.forward takes no input_ids and labels, so there is no default loss; pass "
        f"--loss MODULE:FN, where FN(model, batch) returns the loss tensor and batch is what --batch describes"
    )


def trainer_options(args: argparse.Namespace, mesh: Any) -> dict[str, Any]:
    """The Trainer keyword arguments the command line asks for."""
    return strategy_options(args, dict(mesh.shape)) | {
        "batch_spec": parse_batch_spec(args.batch_spec, mesh, args.fsdp_axis),
        "grad_accum_steps": args.grad_accum or 1,
        "precision": named_policy(args.precision),
        "remat": Remat(args.remat, policy=args.remat_policy or DEFAULT_POLICY) if args.remat else None,
        "scan_layers": bool(args.scan),
    }


class Progress:
    """Stage lines on stderr; on a terminal the running stage's seconds tick (a compile takes minutes)."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, what: str) -> Iterator[None]:
        begun = time.perf_counter()
        stop = threading.Event()
        live = self.stream.isatty()
        self.stream.write(f"{what} ...{'' if live else chr(10)}")
        self.stream.flush()
        ticker = threading.Thread(target=self._tick, args=(what, begun, stop), daemon=True)
        if live:
            ticker.start()
        try:
            yield
        finally:
            stop.set()
            if live:
                ticker.join()
            self.stream.write(f"{chr(13) if live else ''}{what}: {time.perf_counter() - begun:.1f} s\n")
            self.stream.flush()

    def _tick(self, what: str, begun: float, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            self.stream.write(f"\r{what} ... {time.perf_counter() - begun:.0f} s")
            self.stream.flush()


def _notes(caught: list[warnings.WarningMessage]) -> None:
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)


def expected_arguments(plan: ShardingPlan, model: torch.nn.Module, args: argparse.Namespace, batch: Any) -> int:
    """What the plan says the step's arguments take per device: params, optimizer state, buffers, batch."""
    mem = training_memory(plan, model, param_dtype=master_dtype(args.precision))
    state = _MOMENTS[args.optimizer or "adamw"] * mem.grads
    batch_bytes = sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(batch))
    return mem.params + state + mem.buffers + batch_bytes


def compile_report(
    args: argparse.Namespace, model: torch.nn.Module, plan: ShardingPlan, *, load: Callable[[str], Any]
) -> dict[str, Any]:
    """Builds the abstract Trainer the options describe, compiles its step and returns the JSON-ready figures.

    ``load`` resolves ``--loss MODULE:FN``.
    """
    leaves = parse_batch(args.batch)
    batch = leaves[0] if len(leaves) == 1 else tuple(leaves)
    loss_fn = loss_for(model, args.loss, load)
    optimizer = OPTIMIZERS[args.optimizer or "adamw"](1e-4)  # the learning rate changes no buffer
    options = trainer_options(args, plan.mesh)
    progress = Progress()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = AbstractTrainer(model, loss_fn, optimizer, plan, **options)
        shapes = trainer.abstract_batch(batch)
        with progress.stage("tracing and lowering the training step"):
            lowered = trainer.lower(batch)
        begun = time.perf_counter()
        with progress.stage(f"compiling it for {plan.mesh.size} simulated devices"):
            compiled = lowered.compile()
        compile_seconds = time.perf_counter() - begun
    _notes(caught)
    figures = memory(compiled)
    laid_out = any(s.lays_out and options.get(s.keyword) is not None for s in STRATEGIES.values())
    # bytes per step over each axis group, loops counted (the compile's simulated devices form a concrete mesh)
    traffic = collectives(compiled, mesh=plan.mesh if isinstance(plan.mesh, jax.sharding.Mesh) else None).per_axes
    stored = master_dtype(args.precision)
    staged = (
        {}
        if not laid_out
        else {  # the plan table and memory as the Trainer lays them out (a pipeline's stages)
            "tensors": trainer.plan.rows(),
            "per_device_bytes": dict(training_memory(trainer.plan, model, param_dtype=stored).rows()),
        }
    )
    return staged | {
        "compiled": {f: getattr(figures, f) for f in CompiledMemory.__dataclass_fields__},
        "compile": {
            "devices": plan.mesh.size,
            "batch": [[*t.shape, str(t.dtype).removeprefix("torch.")] for t in leaves],
            "batch_spec": str(trainer.batch_spec),
            "scan_layers": options["scan_layers"],
            "remat": None
            if options["remat"] is None
            else {"modules": list(options["remat"].modules), "policy": options["remat"].policy},
            "precision": args.precision or "fp32",
            "optimizer": args.optimizer or "adamw",
            "grad_accum_steps": options["grad_accum_steps"],
            **_strategy_figures(options, trainer),
            "plan_argument_bytes": expected_arguments(trainer.plan, model, args, shapes),
            "collective_bytes_per_step": dict(sorted(traffic.items())),
            "seconds": round(time.perf_counter() - progress.start, 1),
            "compile_seconds": round(compile_seconds, 1),
        },
    }


def _strategy_figures(options: dict[str, Any], trainer: AbstractTrainer) -> dict[str, Any]:
    """Each flagged strategy's figures for the report (None where its flag was not given)."""
    figures = {}
    for strategy in flagged():
        assert strategy.flag is not None
        option = options.get(strategy.keyword)
        figures[strategy.keyword] = None if option is None else strategy.flag.figures(option, trainer)
    return figures


def verdict(data: dict[str, Any], device_memory: int) -> dict[str, Any]:
    """``--device-memory``: whether the compiled peak fits, and by how much."""
    peak = data["compiled"]["peak_bytes"]
    return {"bytes": device_memory, "fits": peak <= device_memory, "margin_bytes": device_memory - peak}


def _options_line(c: dict[str, Any]) -> str:
    batch = " + ".join(f"{leaf[-1]}[{', '.join(map(str, leaf[:-1]))}]" for leaf in c["batch"])
    remat = f", remat {' | '.join(c['remat']['modules'])} ({c['remat']['policy']})" if c["remat"] else ""
    accum = f", grad_accum_steps={c['grad_accum_steps']}" if c["grad_accum_steps"] > 1 else ""
    staged = "".join(s.flag.summary(c[s.keyword]) for s in flagged() if s.flag is not None and c.get(s.keyword))
    return (
        f"  {c['optimizer']}, {c['precision']}, scan_layers={c['scan_layers']}{remat}{accum}{staged}; "
        f"batch {batch} over {c['batch_spec']}"
    )


def compiled_lines(data: dict[str, Any]) -> list[str]:
    """The compiled figures as text, the plan's figure for the arguments, then the verdict of ``--device-memory``."""
    c, figures = data["compile"], data["compiled"]
    head = (
        f"compiled training step per device (XLA:CPU on {c['devices']} simulated devices, compiled in "
        f"{c['compile_seconds']:.0f} s):"
    )
    rows = [(what, fmt_bytes(n)) for what, n in CompiledMemory(**figures).rows()]
    share = figures["argument_bytes"] / max(c["plan_argument_bytes"], 1)
    check = (
        f"  (the plan's params + optimizer state + buffers + batch: {fmt_bytes(c['plan_argument_bytes'])}; "
        f"compiled arguments / plan = {share:.3f})"
    )
    lines = [head, _options_line(c), *columns(rows, indent="  "), check]
    if traffic := c.get("collective_bytes_per_step"):
        over = ", ".join(f"{axes} {fmt_bytes(n)}" for axes, n in traffic.items())
        lines.append(f"  collectives per step (result bytes per device, loop trip counts applied): {over}")
    if "device_memory" in data:
        lines.append(verdict_line(data["device_memory"], figures["peak_bytes"]))
    return lines


def verdict_line(fit: dict[str, Any], peak: int) -> str:
    """``fits in 80.00 GiB per device: ...`` or ``does not fit ...``, with the margin."""
    size, margin = fmt_bytes(fit["bytes"]), fit["margin_bytes"]
    if fit["fits"]:
        share = margin / fit["bytes"] if fit["bytes"] else 0.0
        return f"fits in {size} per device: peak {fmt_bytes(peak)}, margin {fmt_bytes(margin)} ({share:.1%})"
    return f"does not fit in {size} per device: peak {fmt_bytes(peak)} is {fmt_bytes(-margin)} over"

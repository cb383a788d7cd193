"""Train a byte-level GPT on the Python standard library's own source, FSDP × TP over 8 simulated CPU devices.

The text is every ``.py`` file of the running interpreter's standard library (read from
``sysconfig.get_paths()["stdlib"]`` in sorted order; about one file in twenty, chosen by a hash
of its path, is held out for validation). The model is a plain-torch GPT (learned positions,
pre-norm blocks, causal attention, GELU MLP) over bytes, so its vocabulary is 256. On the mesh
``data=4 × model=2`` the attention's q/k/v and the MLP's up projection are column-parallel and
the attention's output and the MLP's down projection row-parallel over ``"model"`` (each device
owns whole heads), and ``presets.fsdp("data")`` shards every big weight's other dim over
``"data"``. AdamW follows a linear-warmup + cosine schedule (optax). Validation
(``trainer.evaluate``) and sampling (``ts.generate``) run on the mesh, compiled, on the trainer's
own state: no CPU copy of the weights. Rows are packed: each file in a window is a document, its
positions restart at 0 and attention stays inside it (``ts.document_mask``). ``--context N``
splits each sequence over N devices (context parallelism over ``data × context × model``).

Everything a run writes lands in ``--out``: ``config.json`` (the settings that shape the run),
``metrics.jsonl`` (one JSON object per step: step, loss, tokens_per_s, lr, grad_norm, and
val_loss every ``--val-every`` steps), ``loss.png``, ``checkpoints/step_*`` and ``sample.txt``
(text the trained model generates from ``--prompt``). Tokens per second (and MFU, where the
device has a known peak) come from the Trainer's own run metrics (``log_every=1``) through a
tracker of the script's own, which also feeds the progress bar; ``--tensorboard DIR`` sends them
to TensorBoard as well, and ``--profile`` writes a ``jax.profiler`` trace of steps 10-12 (the
last steps of a shorter run, never its first, compiling one) to ``--out``/profile. The batch of step ``s`` is a pure
function of ``(seed, s)``, so ``--resume`` continues from the latest checkpoint with the batches
an uninterrupted run would have seen, and its losses are the uninterrupted run's.

Run::

    python examples/train_lm.py --steps 60 --out /tmp/train_lm            # 3.3M parameters, 32 × 128 bytes a step
    python examples/train_lm.py --steps 100 --out /tmp/train_lm --resume  # continue the same run to step 100
    python examples/train_lm.py --steps 60 --out /tmp/train_cp --context 2  # each sequence over 2 devices
    python examples/train_lm.py --steps 60 --out /tmp/train_tb --tensorboard /tmp/train_tb/tb --profile
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import torchshard as ts

DEVICES, MODEL_AXIS = 8, 2  # "model" splits heads; the rest is data (and, with --context N, the sequence)
VOCAB = 256  # bytes
VAL_EVERY_NTH_FILE = 20
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "__pycache__"}
# (input bytes, their positions in their files, next bytes), [batch, seq] int64 each; a file's last
# byte has no next byte of its own, so its target is IGNORE
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
IGNORE = -100  # F.cross_entropy's ignore_index

# Settings that shape the trajectory (model, data, optimizer): a run records them in config.json
# and --resume takes them from there, so a resumed run is the run it continues.
RUN_DEFAULTS: dict[str, Any] = {
    "layers": 4,
    "d_model": 256,
    "heads": 4,
    "seq": 128,
    "batch": 32,
    "lr": 3e-3,
    "warmup": None,  # resolved from decay_steps
    "decay_steps": None,  # resolved from --steps
    "weight_decay": 0.1,
    "seed": 0,
}


# ---------------------------------------------------------------------------------------------- data


def stdlib_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The standard library's ``.py`` files in a fixed order (installed packages and caches left out)."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED_FOLDERS]  # never walked into
        found += [pathlib.Path(folder, n) for n in names if n.endswith(".py")]
    return sorted((p for p in found if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def is_validation(relative: str) -> bool:
    """Holds out a file by a hash of its path: stable however many files the interpreter ships."""
    return zlib.crc32(relative.encode()) % VAL_EVERY_NTH_FILE == 0


class Corpus(NamedTuple):
    """Training and validation text as flat byte arrays, split by file, and where each file starts in them."""

    train: np.ndarray
    val: np.ndarray
    train_files: int
    val_files: int
    root: str
    train_starts: np.ndarray
    val_starts: np.ndarray

    def digest(self) -> str:
        """Identifies the text, so a resumed run can check that it trains on the same bytes."""
        return f"{zlib.crc32(self.train.tobytes()):08x}-{zlib.crc32(self.val.tobytes()):08x}"


def load_corpus(root: pathlib.Path | None = None) -> Corpus:
    """Reads the standard library under ``root`` (default: this interpreter's) into a `Corpus`."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for path in stdlib_files(root):
        parts[is_validation(path.relative_to(root).as_posix())].append(path.read_bytes())
    as_array = lambda chunks: np.frombuffer(b"".join(chunks), dtype=np.uint8)  # noqa: E731
    starts = lambda chunks: np.cumsum([0, *map(len, chunks[:-1])])  # noqa: E731
    train, val = parts[False], parts[True]
    return Corpus(as_array(train), as_array(val), len(train), len(val), str(root), starts(train), starts(val))


def windows(text: np.ndarray, files: np.ndarray, rng: np.random.Generator, *, batch: int, seq: int) -> Batch:
    """``batch`` random windows of ``seq + 1`` bytes, packed: each file in a window is a document of its own.

    Positions restart at 0 where a file starts (the window's first bytes count from 0 too), and a
    file's last byte gets no target: the next file's first byte is not its continuation.
    """
    begins = rng.integers(0, len(text) - seq - 1, size=batch)
    index = begins[:, None] + np.arange(seq + 1)
    file_start = np.maximum(files[np.searchsorted(files, index, side="right") - 1], begins[:, None])
    position, rows = index - file_start, text[index].astype(np.int64)
    targets = np.where(position[:, 1:] == 0, IGNORE, rows[:, 1:])
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (rows[:, :-1], position[:, :-1], targets))  # type: ignore[return-value]


def train_batch(corpus: Corpus, step: int, *, seed: int, batch: int, seq: int) -> Batch:
    """The batch of ``step``: a pure function of (seed, step), so a resumed run sees the same batches."""
    return windows(corpus.train, corpus.train_starts, np.random.default_rng([seed, 1, step]), batch=batch, seq=seq)


def val_batches(corpus: Corpus, n: int, *, seed: int, batch: int, seq: int) -> list[Batch]:
    """A fixed validation set: the same windows at every evaluation."""
    rng = np.random.default_rng([seed, 2])
    return [windows(corpus.val, corpus.val_starts, rng, batch=batch, seq=seq) for _ in range(n)]


# --------------------------------------------------------------------------------------------- model


# [batch, heads, seq, head_dim]: whole heads on each device; with --context N the sequence stays split
HEADS = ("data", "model", None, None)
CONTEXT_HEADS = ("data", "model", "context", None)


class Attention(nn.Module):
    """Causal self-attention; q/k/v split by output (whole heads) and o by input over ``"model"``."""

    def __init__(self, d: int, heads: int, spec: tuple[str | None, ...] = HEADS) -> None:
        super().__init__()
        self.heads, self.spec = heads, spec
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        return ts.constrain(x.view(b, s, self.heads, d // self.heads).transpose(1, 2), self.spec)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, spec: tuple[str | None, ...] = HEADS) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, heads, spec), nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte embeddings plus learned positions, pre-norm blocks, a final norm and a byte head.

    Given ``positions`` (each packed document counting from 0), attention stays inside each
    document (`torchshard.document_mask`); without them the row is one causal sequence.
    """

    def __init__(self, *, layers: int, d_model: int, heads: int, seq: int, context: int = 1) -> None:
        super().__init__()
        spec = CONTEXT_HEADS if context > 1 else HEADS
        self.tok, self.pos = nn.Embedding(VOCAB, d_model), nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, spec) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        mask = None if positions is None else ts.document_mask(positions)
        positions = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def build_model(cfg: dict[str, Any], *, context: int = 1) -> GPT:
    """The run's GPT, initialised from its seed (the same weights every time, whatever ``context``)."""
    torch.manual_seed(cfg["seed"])
    return GPT(layers=cfg["layers"], d_model=cfg["d_model"], heads=cfg["heads"], seq=cfg["seq"], context=context)


def mesh_axes(context: int) -> dict[str, int]:
    """The 8 devices as data × model, with ``--context N`` data × context × model."""
    data = DEVICES // (MODEL_AXIS * context)
    return (
        {"data": data, "context": context, "model": MODEL_AXIS} if context > 1 else {"data": data, "model": MODEL_AXIS}
    )


def rules() -> ts.Rules:
    """Megatron TP inside each block over ``"model"``, FSDP of every big weight over ``"data"``."""
    block = r"blocks\.\d+\."
    tp = ts.presets.tensor_parallel(
        colwise=[block + r"attn\.(q|k|v)", block + r"mlp\.up"], rowwise=[block + r"attn\.o", block + r"mlp\.down"]
    )
    return tp + ts.presets.fsdp("data")


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats per byte) over the bytes that have a next byte in their file."""
    x, positions, y = batch
    return F.cross_entropy(model(x, positions).reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE)


def lr_schedule(cfg: dict[str, Any]) -> Callable[[Any], Any]:
    """Linear warmup to ``lr``, then cosine decay to ``lr / 10`` at ``decay_steps``; flat after that.

    optax calls a schedule with the number of updates made so far, so step ``s`` (1-based) gets
    ``base(s)``: the first step already learns, and step ``warmup`` reaches the peak.
    """
    base = optax.warmup_cosine_decay_schedule(0.0, cfg["lr"], cfg["warmup"], cfg["decay_steps"], cfg["lr"] / 10)
    return lambda count: base(count + 1)


def optimizer(cfg: dict[str, Any]) -> optax.GradientTransformation:
    adamw = optax.adamw(lr_schedule(cfg), b1=0.9, b2=0.95, weight_decay=cfg["weight_decay"])
    return optax.chain(optax.clip_by_global_norm(1.0), adamw)


# ------------------------------------------------------------------------------------------ arguments


def positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"  # argparse names the type in its error
    return parse


def non_negative(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"must be ≥ 0, got {text}")
        return value

    parse.__name__ = f"non-negative {kind.__name__}"
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Model, data and optimizer flags are recorded in DIR/config.json; --resume reads them from there "
        "(repeating a flag with the same value is fine, a different value is an error).",
    )
    run = parser.add_argument_group("run")
    run.add_argument(
        "--out",
        metavar="DIR",
        type=pathlib.Path,
        required=True,
        help="directory for metrics, plot, checkpoints, sample",
    )
    run.add_argument(
        "--steps",
        metavar="N",
        type=positive(int),
        default=60,
        help="train until step N; a resumed run counts the steps before (default: 60)",
    )
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    run.add_argument(
        "--val-every", metavar="K", type=positive(int), default=20, help="validation loss every K steps (default: 20)"
    )
    run.add_argument(
        "--val-batches", metavar="N", type=positive(int), default=4, help="batches per validation (default: 4)"
    )
    run.add_argument(
        "--ckpt-every", metavar="K", type=positive(int), default=20, help="checkpoint every K steps (default: 20)"
    )
    run.add_argument("--keep-last", metavar="N", type=positive(int), default=2, help="checkpoints kept (default: 2)")
    run.add_argument(
        "--sample-bytes", metavar="N", type=non_negative(int), default=200, help="bytes generated (default: 200)"
    )
    run.add_argument(
        "--context",
        metavar="N",
        type=int,
        choices=(1, 2, 4),
        default=1,
        help="split each sequence over N devices (context parallelism: data × context × model); default 1",
    )
    run.add_argument("--tensorboard", metavar="DIR", type=pathlib.Path, help="also log the metrics to TensorBoard")
    run.add_argument("--profile", action="store_true", help="trace steps 10-12 with jax.profiler into --out/profile")
    run.add_argument("--prompt", metavar="TEXT", default="def ", help="text the sample starts from (default: 'def ')")
    run.add_argument(
        "--temperature",
        metavar="T",
        type=non_negative(float),
        default=0.8,
        help="sampling temperature, 0 is greedy (default: 0.8)",
    )
    shaping = parser.add_argument_group("model, data and optimizer (recorded in DIR/config.json)")
    shaping.add_argument("--layers", metavar="N", type=positive(int), help="transformer blocks (default: 4)")
    shaping.add_argument("--d-model", metavar="D", type=positive(int), help="width (default: 256)")
    shaping.add_argument(
        "--heads", metavar="H", type=positive(int), help="attention heads, a multiple of 2 (default: 4)"
    )
    shaping.add_argument("--seq", metavar="S", type=positive(int), help="context length in bytes (default: 128)")
    shaping.add_argument(
        "--batch", metavar="B", type=positive(int), help="sequences per step, a multiple of 4 (default: 32)"
    )
    shaping.add_argument("--lr", metavar="LR", type=positive(float), help="peak learning rate (default: 3e-3)")
    shaping.add_argument(
        "--warmup", metavar="N", type=non_negative(int), help="warmup steps (default: decay steps / 10, ≤ 100)"
    )
    shaping.add_argument("--decay-steps", metavar="N", type=positive(int), help="cosine ends here (default: --steps)")
    shaping.add_argument(
        "--weight-decay", metavar="WD", type=non_negative(float), help="AdamW weight decay (default: 0.1)"
    )
    shaping.add_argument(
        "--seed", metavar="SEED", type=non_negative(int), help="init, batch order and sampling (default: 0)"
    )
    return parser


def read_config(out: pathlib.Path) -> dict[str, Any] | None:
    path = out / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


def resolve_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The run's settings: defaults, then a resumed run's config.json, then the flags given."""
    given = {k: getattr(args, k) for k in RUN_DEFAULTS if getattr(args, k) is not None}
    stored = read_config(args.out) if args.resume else None
    if args.resume and stored is None:
        parser.error(f"--resume: {args.out / 'config.json'} does not exist; start the run without --resume")
    if args.resume and ts.checkpoint_steps(args.out / "checkpoints") == []:
        parser.error(f"--resume: no checkpoint under {args.out / 'checkpoints'} yet; delete {args.out} and start again")
    if not args.resume and (args.out / "config.json").exists():
        parser.error(f"{args.out} already holds a run; pass --resume to continue it, or choose another --out")
    stored_run = (stored or {}).get("run", {})
    clashes = [
        f"the run has --{k.replace('_', '-')} {stored_run[k]}, not {v}"
        for k, v in given.items()
        if k in stored_run and stored_run[k] != v
    ]
    if clashes:
        parser.error(f"--resume: {'; '.join(clashes)} (see {args.out / 'config.json'}); drop these flags")
    cfg = {**RUN_DEFAULTS, **stored_run, **given}
    cfg["decay_steps"] = cfg["decay_steps"] or args.steps
    cfg["warmup"] = min(100, cfg["decay_steps"] // 10) if cfg["warmup"] is None else cfg["warmup"]
    check_config(cfg, parser, context=args.context)
    return cfg


def check_config(cfg: dict[str, Any], parser: argparse.ArgumentParser, *, context: int = 1) -> None:
    problems, axes = [], mesh_axes(context)
    if cfg["d_model"] % cfg["heads"]:
        problems.append(f"--d-model {cfg['d_model']} is not divisible by --heads {cfg['heads']}")
    if cfg["heads"] % axes["model"]:
        problems.append(f"--heads {cfg['heads']} is not a multiple of the model axis ({axes['model']})")
    if cfg["batch"] % axes["data"]:
        problems.append(f"--batch {cfg['batch']} is not a multiple of the data axis ({axes['data']})")
    if context > 1 and cfg["seq"] % (2 * context):
        problems.append(f"--seq {cfg['seq']} does not split into 2 × {context} balanced chunks for --context {context}")
    if cfg["warmup"] >= cfg["decay_steps"]:
        problems.append(f"--warmup {cfg['warmup']} must be below --decay-steps {cfg['decay_steps']}")
    if problems:
        parser.error("; ".join(problems))


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parses and checks every flag, and the state of --out, before anything starts JAX."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.prompt:
        parser.error("--prompt must not be empty")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    return args, resolve_config(args, parser)


# -------------------------------------------------------------------------------------------- the run


class Metrics:
    """``metrics.jsonl``: one JSON object per step, appended (and flushed) as the run goes."""

    def __init__(self, path: pathlib.Path, *, keep_through: int) -> None:
        # a run killed after its last checkpoint logged steps the resumed run will redo: drop them
        self.path = path
        kept = [row for row in self.rows() if row["step"] <= keep_through]
        path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        self._file = path.open("a")

    def rows(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def evaluate(trainer: ts.Trainer, batches: list[Batch]) -> float:
    """Mean loss over ``batches``, each one compiled call on the mesh (eval mode; the state is untouched)."""
    return float(np.mean([float(trainer.evaluate(b)["loss"]) for b in batches]))  # float(): one batch in flight


class Latest:
    """A tracker of the script's own (``log`` and ``close``, as ``ts.track.Tracker``): the Trainer's latest metrics."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics = dict(metrics)

    def close(self) -> None:
        pass


def profiled_steps(start: int, steps: int) -> range:
    """Steps 10-12, or the last three of a shorter run, never the first step of this process (it compiles)."""
    first = max(start + 2, min(10, steps - 2))
    return range(first, min(first + 3, steps + 1))


def train(
    trainer: ts.Trainer, corpus: Corpus, cfg: dict[str, Any], args: argparse.Namespace, metrics: Metrics, latest: Latest
) -> None:
    """Steps ``trainer`` to ``args.steps``, logging every step, validating, checkpointing and profiling as asked."""
    start, schedule = trainer.step_count, jax.jit(lr_schedule(cfg))  # one compile, not one per jnp op
    held_out = val_batches(corpus, args.val_batches, seed=cfg["seed"], batch=cfg["batch"], seq=cfg["seq"])
    profiled = profiled_steps(start, args.steps) if args.profile else range(0)
    with (
        tqdm(total=args.steps, initial=start, desc="train", unit="step", dynamic_ncols=True) as bar,
        contextlib.ExitStack() as profiling,
    ):
        for step in range(start + 1, args.steps + 1):
            if step == profiled.start:
                profiling.enter_context(trainer.profile(args.out / "profile"))
            batch = train_batch(corpus, step, seed=cfg["seed"], batch=cfg["batch"], seq=cfg["seq"])
            out = trainer.step(batch)  # log_every=1: the Trainer waits for it and logs its metrics to `latest`
            row = {"step": step, "loss": float(out["loss"]), "tokens_per_s": latest.metrics["tokens_per_s"],
                   "lr": float(schedule(step - 1)), "grad_norm": float(out["grad_norm"])}  # fmt: skip
            if "mfu" in latest.metrics:
                row["mfu"] = latest.metrics["mfu"]
            if step == profiled.stop - 1:
                profiling.close()
            if step % args.val_every == 0 or step == args.steps:
                row["val_loss"] = evaluate(trainer, held_out)
                trainer.log({"val_loss": row["val_loss"]})  # to the trackers (TensorBoard) too
            metrics.write(row)
            if step % args.ckpt_every == 0 or step == args.steps:
                ts.save(args.out / "checkpoints", trainer, keep_last=args.keep_last)
            shown = {"loss": "{:.4g}", "val_loss": "{:.4g}", "tokens_per_s": "{:,.0f}", "mfu": "{:.1%}"}
            bar.set_postfix({k.replace("_per_s", "/s"): form.format(row[k]) for k, form in shown.items() if k in row})
            bar.update()


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    """Train loss per step and validation loss where measured, as a PNG (matplotlib is imported only here)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", linewidth=1)
    val = [r for r in rows if "val_loss" in r]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="byte-level GPT on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def generate(trainer: ts.Trainer, prompt: bytes, *, n: int, temperature: float, context: int, seed: int) -> bytes:
    """Samples ``n`` bytes after ``prompt`` on the mesh (`ts.generate`), filling a window of ``context`` bytes.

    The model's positions end at ``context``: the first call continues the prompt to a full window,
    each later one continues the last ``context - chunk`` bytes by ``chunk`` (one compiled program
    serves all of those). The model constrains its activations' rows over "data", so as many rows
    are sampled as that axis has devices (independently), and the first is kept.
    """
    tokens, chunk = torch.tensor([list(prompt)] * trainer.mesh.shape["data"]), max(1, context // 4)
    while tokens.shape[1] < len(prompt) + n:
        room = context - min(tokens.shape[1], context - chunk)  # new bytes this call: the rest of the window
        window = tokens[:, tokens.shape[1] - (context - room) :]
        out = ts.generate(trainer, window, max_new_tokens=room, temperature=temperature, seed=seed + tokens.shape[1])
        tokens = torch.cat([tokens, out[:, window.shape[1] :]], dim=1)
    return bytes(tokens[0, : len(prompt) + n].tolist())


def start_run(args: argparse.Namespace, cfg: dict[str, Any], corpus: Corpus) -> None:
    """Writes config.json for a new run, or checks that a resumed one trains on the same text."""
    if args.resume:
        recorded = json.loads((args.out / "config.json").read_text())["data"]["digest"]  # parse_args saw it exists
        if recorded != corpus.digest():
            sys.exit(
                f"error: --resume: the standard library under {corpus.root} is not the text the run in "
                f"{args.out} trained on (digest {corpus.digest()}, the run has {recorded}); "
                f"resume with the Python that started it"
            )
        return
    args.out.mkdir(parents=True, exist_ok=True)
    data = {
        "root": corpus.root,
        "digest": corpus.digest(),
        "train_bytes": len(corpus.train),
        "val_bytes": len(corpus.val),
        "train_files": corpus.train_files,
        "val_files": corpus.val_files,
    }
    (args.out / "config.json").write_text(json.dumps({"run": cfg, "data": data}, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    ts.use_cpu_devices(8)
    corpus = load_corpus()
    print(
        f"text: {corpus.train_files} files ({len(corpus.train) / 1e6:.1f} MB) to train on, "
        f"{corpus.val_files} ({len(corpus.val) / 1e6:.1f} MB) held out, from {corpus.root}",
        flush=True,
    )
    start_run(args, cfg, corpus)

    model = build_model(cfg, context=args.context)
    mesh = ts.make_mesh(mesh_axes(args.context))
    plan = ts.plan(model, mesh, rules())
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters; {plan!r}", flush=True)
    split = {"context": ts.ContextParallel(), "batch_spec": ("data", "context")} if args.context > 1 else {}
    latest = Latest()
    trackers = [latest, *([ts.track.TensorBoard(args.tensorboard)] if args.tensorboard else [])]
    trainer = ts.Trainer(
        model, loss_fn, optimizer(cfg), plan, seed=cfg["seed"], log_every=1, trackers=trackers, **split
    )
    if args.resume:
        ts.load(args.out / "checkpoints", trainer)  # the latest complete step, optimizer state and RNG key too
        print(f"resumed at step {trainer.step_count}", flush=True)

    metrics = Metrics(args.out / "metrics.jsonl", keep_through=trainer.step_count)
    began = time.perf_counter()
    try:
        train(trainer, corpus, cfg, args, metrics, latest)
    finally:
        metrics.close()
        trainer.close()
    rows = metrics.rows()
    plot(rows, args.out / "loss.png")
    if rows:
        first, last = rows[0], rows[-1]
        print(
            f"loss {first['loss']:.4f} (step {first['step']}) → {last['loss']:.4f} (step {last['step']}); "
            f"this run: {time.perf_counter() - began:.1f} s",
            flush=True,
        )

    sample = generate(
        trainer,
        args.prompt.encode(),
        n=args.sample_bytes,
        temperature=args.temperature,
        context=cfg["seq"],
        seed=cfg["seed"],
    )
    (args.out / "sample.txt").write_bytes(sample)
    print(f"--- sample ({args.sample_bytes} bytes after {args.prompt!r}, temperature {args.temperature}) ---")
    print(sample.decode("utf-8", errors="replace"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

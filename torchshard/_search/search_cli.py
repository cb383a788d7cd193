"""``python -m torchshard plan MODEL:FACTORY --search``: the plan search's flags, table and JSON."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

from torchshard._base.errors import ArgumentError
from torchshard._base.format import columns, fmt_bytes
from torchshard._hlo.hardware import PROFILES, Hardware, hardware, load_profiles
from torchshard._report.cli import parse_device_memory
from torchshard._report.fit import parse_batch, simulated_devices
from torchshard._report.usage import UsageError
from torchshard._search.search import REMATS, Candidate, search
from torchshard._search.space import DATA, allowed, mesh_axes, search_choices
from torchshard._train.precision import PRECISIONS
from torchshard._train.remat import POLICY_NAMES
from torchshard._train.search_seam import SearchOption

NO_REMAT = "none"  # --remat-policies' word for no remat
REMAT_CHOICES = (NO_REMAT, *POLICY_NAMES)
SCANS = {"true": True, "false": False}


def _flag(option: SearchOption) -> str:
    return option.name.replace("_", "-")


_AXES = " x ".join("data/FSDP" if a == DATA else a for a in mesh_axes())
_CHOSEN = ", ".join(["remat policy", "scan", "precision", *(f"--{_flag(o)}" for o in search_choices())])
SEARCH_HELP = textwrap.fill(
    f"--search enumerates the meshes ({_AXES} degrees dividing the model's head counts, layers, experts, "
    f"sequence and --devices) and options ({_CHOSEN}), drops those whose params + grads + AdamW alone "
    "exceed --device-memory, compiles each mesh's first layout (in order of a rough estimate) and "
    "refines the best ones option by option, and ranks those that fit by a step time estimated from the "
    "compiled FLOPs, bytes accessed and collectives per mesh axis over --hardware's links (hosts: "
    "--hosts, else the profile's devices per host). Exit code 3 when no compiled configuration fits.",
    width=99,
    break_on_hyphens=False,
)


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--search`` flags of ``plan``."""
    s = parser.add_argument_group("plan search (see below)")
    s.add_argument("--search", action="store_true", help="search meshes and options (needs --devices, --batch)")
    s.add_argument("--devices", type=positive_int, help="devices to search meshes for (>= 1), e.g. 64")
    s.add_argument("--hardware", default="h100", help=f"profile: {', '.join(PROFILES)} (default: h100)")
    s.add_argument("--hardware-file", metavar="FILE.json", help="more profiles: a list of Hardware fields")
    s.add_argument(
        "--hosts",
        type=positive_int,
        help="hosts the devices span (>= 1, dividing --devices; default: the profile's devices per host)",
    )
    s.add_argument(
        "--max-compiles", type=positive_int, default=20, help="compile at most this many layouts (>= 1; default: 20)"
    )
    s.add_argument(
        "--remat-policies",
        default=",".join(NO_REMAT if r is None else r for r in REMATS),
        help=f"remat policies to try, of {','.join(REMAT_CHOICES)} (default: %(default)s)",
    )
    s.add_argument("--precisions", default="bf16,fp32", help="precisions to try")
    s.add_argument("--scans", default="true,false", help="scan_layers values to try")
    for option in search_choices():  # the strategies' own (`SearchOption`)
        takes = allowed(option)
        shown = "" if takes is None else f", of {','.join(map(str, takes))} (default: %(default)s)"
        s.add_argument(f"--{_flag(option)}", default=",".join(map(str, option.tried())), help=option.help + shown)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the flag in its usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a count >= 1, e.g. 8") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; give a count >= 1, e.g. 8")
    return value


def _values(text: str, flag: str, choices: Sequence[str] | None, problems: list[str]) -> tuple[str, ...]:
    """The comma-separated values of ``flag``; any not in ``choices``, or none at all, goes on ``problems``."""
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if choices is not None and v not in choices]
    if bad or not values:
        what = f"{', '.join(map(repr, bad))} not among them" if bad else "no value"
        fix = f"choose one or more of {','.join(choices)}" if choices else "give one or more, comma-separated"
        problems.append(f"{flag} {text!r}: {what}; {fix}")
    return tuple(v for v in values if v not in bad)


def _counts(text: str, flag: str, problems: list[str]) -> tuple[int, ...]:
    """The comma-separated counts of ``flag``, each >= 1; the others go on ``problems``."""
    values = _values(text, flag, None, problems)
    bad = [v for v in values if not (v.isdecimal() and int(v) >= 1)]
    if bad:
        problems.append(f"{flag} {text!r}: {', '.join(map(repr, bad))} not counts >= 1; give counts such as 1,2,4")
    return tuple(int(v) for v in values if v not in bad)


def search_options(args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    """The option values the flags ask to enumerate; what is wrong with them goes on ``problems``."""
    remat = _values(args.remat_policies, "--remat-policies", REMAT_CHOICES, problems)
    scans = _values(args.scans.lower(), "--scans", tuple(SCANS), problems)
    chosen: dict[str, Any] = {
        "remat": tuple(None if r == NO_REMAT else r for r in remat),
        "precision": _values(args.precisions, "--precisions", tuple(PRECISIONS), problems),
        "scan": tuple(SCANS[s] for s in scans),
    }
    for option in search_choices():
        text, flag = getattr(args, option.name), f"--{_flag(option)}"
        takes = allowed(option)
        if takes is None:
            chosen[option.name] = _counts(text, flag, problems)
        else:
            chosen[option.name] = _values(text, flag, tuple(map(str, takes)), problems)
    return chosen


def _checked(args: argparse.Namespace) -> tuple[Any, Hardware, int | None, dict[str, Any]]:
    """Every flag of ``--search`` checked before anything runs: (batch leaves, hardware, device memory, options).

    Raises:
        UsageError: listing every bad flag, each with its fix.
    """
    problems: list[str] = []
    if args.devices is None or args.batch is None:
        problems.append("--search needs --devices N and --batch BxS, e.g. --devices 64 --batch 64x8192")
    leaves, hw, memory = None, None, None
    if args.batch is not None:
        leaves = _attempt(lambda: parse_batch(args.batch), problems)
        if leaves is not None and (len(leaves) != 1 or leaves[0].dim() != 2):
            problems.append(f"--search --batch {args.batch!r}: give BxS token ids, e.g. 64x8192")
    extra = _attempt(lambda: load_profiles(args.hardware_file), problems) if args.hardware_file else {}
    if extra is not None:  # a bad --hardware-file is its own problem, not also an unknown --hardware
        hw = _attempt(lambda: hardware(args.hardware, extra=extra or None), problems)
    if args.device_memory is not None:
        memory = _attempt(lambda: parse_device_memory(args.device_memory), problems)
    if args.hosts is not None and args.devices is not None and args.devices % args.hosts:
        divisors = [n for n in range(1, args.devices + 1) if args.devices % n == 0]
        problems.append(f"--hosts {args.hosts} does not divide --devices {args.devices}; give one of {divisors}")
    options = search_options(args, problems)
    if problems:
        raise UsageError(f"plan --search: {len(problems)} bad flag(s):\n" + "\n".join(f"  - {p}" for p in problems))
    assert leaves is not None and hw is not None  # else a problem was raised above
    return leaves, hw, memory, options


def _attempt[T](parse: Callable[[], T], problems: list[str]) -> T | None:
    """``parse()``, or None with its error's message on ``problems``."""
    try:
        return parse()
    except (UsageError, ArgumentError) as err:
        problems.append(str(err))
        return None


class Bar:
    """A tqdm bar on stderr over the compiles (lines of text where tqdm is not installed)."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, done: int, total: int, what: str) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            print(f"[{done}/{total}] {what}", file=sys.stderr, flush=True)
            return
        if self.bar is None:
            self.bar = tqdm(total=total, unit="compile", file=sys.stderr)
        self.bar.set_description_str(what)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.bar.close()


def search_command(args: argparse.Namespace, load: Any, build: Any) -> tuple[str, bool]:
    """Runs the search the flags describe; returns the table (or JSON) and whether any configuration fits."""
    leaves, hw, memory, options = _checked(args)
    simulated_devices(args.devices)  # before the model is built: JAX must start with them
    begun = time.perf_counter()
    rows, seq = leaves[0].shape
    found = search(
        build(load(args.target)),
        devices=args.devices,
        batch=(rows, seq),
        hardware_name=hw,
        device_memory=memory,
        hosts=args.hosts,
        max_compiles=args.max_compiles,
        progress=Bar(),
        **options,
    )
    fits = any(c.fits for c in found)
    top = found[: args.top]
    if args.format == "json":
        return json.dumps([c.to_json() for c in top], indent=2), fits
    seconds = time.perf_counter() - begun
    failed = sum(c.note.startswith("failed:") for c in found)
    head = (
        f"{len(found)} configurations of {args.devices} x {hw.name}, {sum(c.peak_bytes is not None for c in found)}"
        f" compiled{f', {failed} failed' if failed else ''} in {seconds:.0f} s; the best {len(top)}:"
    )
    return "\n".join([head, *table(top)]), fits


def table(found: list[Candidate]) -> list[str]:
    """One row per candidate: configuration, peak per device, fits, step time, tokens/s, MFU, dominant cost."""
    rows = [("#", "configuration", "peak/device", "fits", "step", "tokens/s", "MFU", "dominant")]
    for i, c in enumerate(found, 1):
        if c.step_seconds is None:
            rows.append((str(i), c.layout.label(), "-", "-", "-", "-", "-", c.note))
            continue
        speed = (f"{c.step_seconds * 1e3:.3g} ms", f"{c.tokens_per_second:,.0f}", f"{c.mfu:.1%}", c.dominant)
        rows.append((str(i), c.layout.label(), fmt_bytes(c.peak_bytes or 0), "yes" if c.fits else "no", *speed))
    return columns(rows, indent="  ")

"""``python -m torchshard plan MODEL:FACTORY --search``: the plan search's flags, table and JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from torchshard._base.errors import ArgumentError
from torchshard._base.format import columns, fmt_bytes
from torchshard._hlo.hardware import PROFILES, hardware, load_profiles
from torchshard._report.fit import parse_batch, parse_size, simulated_devices
from torchshard._report.usage import UsageError
from torchshard._search.search import REMATS, Candidate, search
from torchshard._search.space import PRECISIONS, variants

SEARCH_HELP = """\
--search enumerates the meshes (stage x data/FSDP x context x expert x model degrees dividing the
model's head counts, layers, experts, sequence and --devices) and options (micro-batches, remat
policy, scan, precision, pipeline schedule), drops those whose params + grads + AdamW alone
exceed --device-memory, compiles each mesh's first layout (in order of a rough estimate) and
refines the best ones option by option, and ranks those that fit by a step time estimated from the
compiled FLOPs, bytes accessed and collectives per mesh axis over --hardware's links (hosts:
--hosts, else the profile's devices per host). Exit code 3 when no compiled configuration fits."""


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--search`` flags of ``plan``."""
    s = parser.add_argument_group("plan search (see below)")
    s.add_argument("--search", action="store_true", help="search meshes and options (needs --devices, --batch)")
    s.add_argument("--devices", type=positive_int, help="devices to search meshes for (>= 1), e.g. 64")
    s.add_argument("--hardware", default="h100", help=f"profile: {', '.join(PROFILES)} (default: h100)")
    s.add_argument("--hardware-file", metavar="FILE.json", help="more profiles: a list of Hardware fields")
    s.add_argument(
        "--hosts", type=positive_int, help="hosts the devices span (>= 1; default: the profile's devices per host)"
    )
    s.add_argument(
        "--max-compiles", type=positive_int, default=20, help="compile at most this many layouts (>= 1; default: 20)"
    )
    s.add_argument("--remat-policies", default="none,nothing_saveable,dots_saveable", help="remat values to try")
    s.add_argument("--microbatches", default="1,2,4", help="grad accumulation / micro-batches per stage to try")
    s.add_argument("--precisions", default="bf16,fp32", help="precisions to try")
    s.add_argument("--scans", default="true,false", help="scan_layers values to try")
    tried, allowed = variants()
    s.add_argument(
        "--schedules",
        default=",".join(tried),
        help=f"pipeline schedules to try on stage meshes, of {','.join(allowed)} (default: %(default)s)",
    )


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the flag in its usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a count >= 1, e.g. 8") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; give a count >= 1, e.g. 8")
    return value


def _values(text: str, flag: str, convert: Any, allowed: Any = None) -> tuple[Any, ...]:
    try:
        values = tuple(convert(v.strip()) for v in text.split(",") if v.strip())
    except (KeyError, ValueError) as err:
        raise UsageError(f"{flag} {text!r}: {err}") from err
    bad = [v for v in values if allowed is not None and v not in allowed]
    if bad or not values:
        raise UsageError(f"{flag} {text!r}: choose from {list(allowed or [])}")
    return values


def search_options(args: argparse.Namespace) -> dict[str, Any]:
    """The option values the flags ask to enumerate."""
    return {
        "remat": _values(args.remat_policies, "--remat-policies", lambda v: None if v == "none" else v, REMATS),
        "microbatches": _values(args.microbatches, "--microbatches", int),
        "precision": _values(args.precisions, "--precisions", str, tuple(PRECISIONS)),
        "scan": _values(args.scans, "--scans", lambda v: {"true": True, "false": False}[v.lower()]),
        "schedules": _values(args.schedules, "--schedules", str, variants()[1]),
    }


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
    if args.devices is None or args.batch is None:
        raise UsageError("--search needs --devices N and --batch BxS, e.g. --devices 64 --batch 64x8192")
    leaves = parse_batch(args.batch)
    if len(leaves) != 1 or leaves[0].dim() != 2:
        raise UsageError(f"--search --batch {args.batch!r}: give BxS token ids, e.g. 64x8192")
    try:
        hw = hardware(args.hardware, extra=load_profiles(args.hardware_file) if args.hardware_file else None)
    except ArgumentError as err:
        raise UsageError(str(err)) from err
    simulated_devices(args.devices)  # before the model is built: JAX must start with them
    begun = time.perf_counter()
    rows, seq = leaves[0].shape
    found = search(
        build(load(args.target)),
        devices=args.devices,
        batch=(rows, seq),
        hardware_name=hw,
        device_memory=parse_size(args.device_memory) if args.device_memory else None,
        hosts=args.hosts,
        max_compiles=args.max_compiles,
        progress=Bar(),
        **search_options(args),
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

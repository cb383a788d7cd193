"""``python -m torchshard plan``: dry-run a sharding plan on the meta device and report per-device memory."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from torchshard._base.errors import ShardingError
from torchshard._report.cli import PRESETS, UsageError, run_plan

EXIT_OK, EXIT_INVALID_PLAN, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchshard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="dry-run a sharding plan on the meta device")
    p.add_argument("target", metavar="MODULE:FACTORY", help="e.g. mypkg.models:build or models.py:MLP")
    p.add_argument("--mesh", required=True, help="axis sizes in mesh order, e.g. data=8,model=8")
    p.add_argument("--rules", metavar="FILE.py", help="a Python file defining RULES (tried before --preset's)")
    p.add_argument("--preset", choices=PRESETS, help="fsdp | tp (HF tp plan or common names) | fsdp+tp | hf")
    p.add_argument("--fsdp-axis", default="data", help="mesh axis of the fsdp presets (default: data)")
    p.add_argument("--tp-axis", default="model", help="mesh axis of the tp presets (default: model)")
    p.add_argument("--default", choices=("replicate", "error"), default="replicate", help="unmatched tensors")
    p.add_argument("--compare", metavar="PRESET|FILE.py", help="list the tensors whose spec differs under this")
    p.add_argument("--format", choices=("table", "compact", "json", "markdown"), default="table")
    p.add_argument("--top", type=int, default=5, help="how many replicated tensors to list (default: 5)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 for a valid plan, 1 with the full `ShardingError` for an invalid one, 2 for usage errors."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a dry run must not grab accelerator memory
    args = build_parser().parse_args(argv)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # MODULE:FACTORY names modules of the working directory
    try:
        print(run_plan(args))
    except ShardingError as err:
        print(f"error: invalid sharding plan\n{err}", file=sys.stderr)
        return EXIT_INVALID_PLAN
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

"""``python -m torchshard plan``: dry-run a sharding plan on the meta device and report per-device memory.

With ``--compile`` it also compiles the real training step for the mesh on simulated CPU devices
and reports what XLA assigns each device: will it fit?
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from torchshard._base.errors import ShardingError
from torchshard._report.cli import PRESET_HELP, PRESETS, UsageError, build_on_meta, load_factory, run_plan
from torchshard._report.fit import EXIT_DOES_NOT_FIT, OPTIMIZERS
from torchshard._search.search_cli import SEARCH_HELP, add_search_arguments, search_command
from torchshard._strategies import flagged
from torchshard._train.precision import PRECISIONS
from torchshard._train.remat import DEFAULT_POLICY, POLICY_NAMES

EXIT_OK, EXIT_INVALID_PLAN, EXIT_USAGE = 0, 1, 2

_PRESETS_EPILOG = "presets:\n" + "\n".join(
    textwrap.fill(text, width=100, initial_indent=f"  {name:<9}", subsequent_indent=" " * 11)
    for name, text in PRESET_HELP.items()
)
_COMPILE_HELP = """\
--compile builds an AbstractTrainer (the Trainer's own step, state as shapes: no array of the
model is allocated) on as many simulated CPU devices as the mesh has, compiles its step with XLA
and prints per device: arguments, temporaries, outputs, aliased (donated) and
peak = arguments + outputs - aliased + temporaries. The batch is --batch: BxS is int64 token ids
[B, S], and a transformers causal LM is trained on model(input_ids=ids, labels=ids).loss; for
other models give the leaves (e.g. --batch 32x16:float32,32:int64, a tuple) and --loss MODULE:FN
with FN(model, batch) -> loss tensor. XLA:CPU's buffer assignment is what is measured: GPU and
TPU compilers fuse and schedule differently (and keep bf16 matmuls in bf16, which XLA:CPU
upcasts), so keep a margin. Exit code 3 when --device-memory is given and the peak exceeds it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchshard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser(
        "plan",
        help="dry-run a sharding plan on the meta device (--compile: compile the step; will it fit?)",
        description=__doc__,
        epilog=f"{_PRESETS_EPILOG}\n\n{_COMPILE_HELP}\n\n{SEARCH_HELP}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="MODULE:FACTORY", help="e.g. mypkg.models:build or models.py:MLP")
    p.add_argument("--mesh", help="axis sizes in mesh order, e.g. data=8,model=8 (required without --search)")
    p.add_argument("--rules", metavar="FILE.py", help="a Python file defining RULES (tried before --preset's)")
    p.add_argument("--preset", choices=PRESETS, help=f"{' | '.join(PRESETS)} (see presets: below)")
    p.add_argument("--fsdp-axis", default="data", help="mesh axis of the fsdp presets (default: data)")
    p.add_argument("--tp-axis", default="model", help="mesh axis of the tp presets (default: model)")
    p.add_argument("--default", choices=("replicate", "error"), default="replicate", help="unmatched tensors")
    p.add_argument("--compare", metavar="PRESET|FILE.py", help="list the tensors whose spec differs under this")
    p.add_argument("--format", choices=("table", "compact", "json", "markdown"), default="table")
    p.add_argument("--top", type=int, default=5, help="how many replicated tensors to list (default: 5)")
    c = p.add_argument_group("compiled memory (see below)")
    c.add_argument("--compile", action="store_true", help="compile the training step on simulated devices")
    c.add_argument("--batch", metavar="BxS", help="the global batch: BxS token ids, or leaves AxB:dtype,...")
    c.add_argument("--loss", metavar="MODULE:FN", help="loss_fn(model, batch) (default: a causal LM's own loss)")
    c.add_argument("--batch-spec", help="mesh axes of the batch dims, e.g. data or data,context (default: FSDP axis)")
    c.add_argument("--scan", action="store_true", default=None, help="Trainer(scan_layers=True)")
    c.add_argument("--remat", metavar="REGEX", help="Trainer(remat=Remat(REGEX)), e.g. 'model\\.layers\\.\\d+'")
    c.add_argument("--remat-policy", choices=POLICY_NAMES, help=f"a Remat policy (default: {DEFAULT_POLICY})")
    c.add_argument("--precision", choices=tuple(PRECISIONS), help="bf16/fp16: MixedPrecision (fp32 master weights)")
    c.add_argument("--optimizer", choices=tuple(OPTIMIZERS), help="optax optimizer (default: adamw)")
    c.add_argument("--grad-accum", type=int, metavar="K", help="Trainer(grad_accum_steps=K)")
    for strategy in flagged():  # each strategy's own flag, --KEYWORD
        assert strategy.flag is not None
        flag = f"--{strategy.keyword.replace('_', '-')}"
        c.add_argument(flag, dest=strategy.keyword, metavar=strategy.flag.metavar, help=strategy.flag.help)
    c.add_argument("--device-memory", metavar="SIZE", help="e.g. 80GiB: say whether the peak fits (exit 3 if not)")
    add_search_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 for a valid plan, 1 with the full `ShardingError` for an invalid one, 2 for usage errors,
    3 when ``--device-memory`` is given and the compiled step does not fit in it."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a dry run must not grab accelerator memory
    args = build_parser().parse_args(argv)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # MODULE:FACTORY names modules of the working directory
    if not args.search and args.mesh is None:
        build_parser().error("the following arguments are required: --mesh (or use --search)")
    try:
        text, fits = search_command(args, load_factory, build_on_meta) if args.search else run_plan(args)
    except ShardingError as err:
        print(f"error: invalid sharding plan\n{err}", file=sys.stderr)
        return EXIT_INVALID_PLAN
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(text)
    return EXIT_OK if fits else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())

"""A picture of a run's TensorBoard scalars, read back with TensorBoard's own reader (docs/metrics.md shows one).

python3 dev.py run examples/train_lm.py --steps 40 --layers 2 --d-model 128 --out runs/tb --tensorboard runs/tb/tb
python3 dev.py run tools/plot_tensorboard.py runs/tb/tb docs/tensorboard_scalars.png
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAGS = (
    ("loss", "loss (nats/byte)", 1.0),
    ("tokens_per_s", "tokens/s", 1.0),
    ("step_time_s", "step time (s)", 1.0),
    ("memory_peak_bytes", "peak memory per device (MiB)", 2.0**-20),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir", help="the TensorBoard log directory a Trainer's TensorBoard tracker wrote")
    parser.add_argument("png", help="the picture to write")
    args = parser.parse_args(argv)
    events = EventAccumulator(args.logdir)
    events.Reload()
    fig, axes = plt.subplots(1, len(TAGS), figsize=(14, 3))
    for ax, (tag, label, scale) in zip(axes, TAGS, strict=True):
        scalars = [e for e in events.Scalars(tag) if tag == "loss" or e.step > 1]  # step 1 includes compiling
        ax.plot([e.step for e in scalars], [e.value * scale for e in scalars], linewidth=1, label=tag)
        if tag == "loss" and "val_loss" in events.Tags()["scalars"]:
            val = events.Scalars("val_loss")
            ax.plot([e.step for e in val], [e.value for e in val], "o-", label="val_loss")
            ax.legend()
        ax.set(title=label, xlabel="step")
        ax.grid(alpha=0.3)
    fig.suptitle("a Trainer's run metrics, read back from its TensorBoard event file", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Trackers a `Trainer` logs its metrics to (``Trainer(log_every=N, trackers=[...])``), and their protocol."""

from torchshard._trainer.trackers import JSONL, TensorBoard, Tracker, Trackio, WandB

__all__ = ["JSONL", "TensorBoard", "Tracker", "Trackio", "WandB"]

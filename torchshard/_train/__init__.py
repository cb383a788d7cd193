"""The Trainer: its argument checks, the pure jitted step, scan over layers, remat, mixed precision, prefetch.

May import _parallel and everything below it (trainer.py itself reaches _parallel only through strategies.py).
"""

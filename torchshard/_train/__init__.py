"""The pure step and what it is made of: the loss traced on bound arrays, scan over layers, remat, mixed precision,
batching, the train-state layout, and the strategy seam (what a strategy binds to and gives the step).

May import _hlo and everything below it.
"""

"""Text generation on the mesh: compiled prefill and decoding, KV caches as arrays, sampling.

May import _train and everything below it.
"""

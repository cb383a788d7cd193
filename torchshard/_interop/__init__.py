"""Other libraries' checkpoint formats (torch.distributed.checkpoint), read into and written from shards.

May import _ckpt and everything below it.
"""

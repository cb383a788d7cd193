"""Multi-process test script for the launcher: ``crash`` fails on rank 1 while rank 0 sleeps; ``sleep`` idles."""

from __future__ import annotations

import os
import sys
import time

from torchshard import distributed

if __name__ == "__main__":
    mode, rank = sys.argv[1], distributed.process_index()
    print(f"ready {rank} pid {os.getpid()}", flush=True)
    if mode == "crash" and rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(120)

"""Launcher test script that hangs after joining the run: rank 0 in ``time.sleep``, rank 1 in a deadlock."""

from __future__ import annotations

import threading
import time

from torchshard import distributed


def sleep_forever() -> None:
    time.sleep(600)


def deadlock() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns: the main thread waits on itself


if __name__ == "__main__":
    rank = distributed.process_index()
    print(f"ready {rank}", flush=True)
    sleep_forever() if rank == 0 else deadlock()

"""Processes agree on a flag through JAX's coordination service, without a device collective.

A background checkpoint write runs beside the training step: a collective from its thread could
interleave with the step's collectives differently on each process. The coordination service's
key-value store is a separate channel, safe from any thread.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import jax

_TIMEOUT_MS = 30 * 60 * 1000  # a slow shared filesystem may hold one process's write for long
_uses: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def _client() -> Any:
    from jax._src import distributed  # the client jax.distributed.initialize connected; no public accessor

    return distributed.global_state.client


def gathered(name: str, value: str) -> list[str]:
    """Every process's ``value`` at ``name``, by process index; a barrier too.

    Every process must call it with the same names in the same order (the n-th use of a name on
    one process meets the n-th on the others).
    """
    if jax.process_count() == 1:
        return [value]
    with _lock:
        _uses[name] += 1
        key = f"torchshard/{name}/{_uses[name]}"
    client = _client()
    client.key_value_set(f"{key}/{jax.process_index()}", value)
    return [client.blocking_key_value_get(f"{key}/{i}", _TIMEOUT_MS) for i in range(jax.process_count())]


def flagged_processes(name: str, flag: bool) -> list[int]:
    """Every process reports ``flag`` at ``name``; each gets the list of processes that raised it (a barrier too)."""
    return [i for i, value in enumerate(gathered(name, "1" if flag else "0")) if value == "1"]

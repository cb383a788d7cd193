"""prefetch: place the next batches on the mesh in the background while the current step runs."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from torchshard._base.validate import instance_problems, int_problems, raise_for_arguments
from torchshard._trainer.trainer import Trainer

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _fill(batches: Iterable[Any], trainer: Trainer, out: queue.Queue[Any], stop: threading.Event, local: bool) -> None:
    try:
        for batch in batches:
            placed = trainer.place_batch(batch, local=local)
            while not stop.is_set():
                try:
                    out.put(placed, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if stop.is_set():
                return
        out.put(_DONE)
    except BaseException as error:  # handed to the consumer, raised where it asks for the batch
        out.put(_Failed(error))


def prefetch(batches: Iterable[Any], trainer: Trainer, *, size: int = 2, local: bool = False) -> Iterator[Any]:
    """Yields each batch already placed on ``trainer``'s mesh, placing up to ``size`` ahead in a thread.

    Reading a batch from a torch ``DataLoader`` and copying it to the devices then overlaps the
    step before it, so feeding data costs no step time. Batches come out in order; an error
    raised by the loader or by placement is raised where that batch would have been yielded.

    Args:
        batches: any iterable of batches (a torch ``DataLoader``, a generator, a list...).
        trainer: the `Trainer` whose ``batch_spec`` and mesh place them.
        size: how many placed batches to keep ready.
        local: each batch holds only this process's rows (multi-process runs; see
            `torchshard.distributed.local_batch_slice`); the placed batches are global.

    Returns:
        An iterator of placed batches, for ``trainer.step(batch)``.

    Raises:
        ArgumentError: ``trainer`` is not a Trainer or ``size`` is not an int ≥ 1.

    Examples:
        >>> import optax
        >>> model = torch.nn.Linear(16, 4)
        >>> trainer = ts.Trainer(model, lambda m, b: m(b).square().mean(), optax.sgd(0.1),
        ...                      ts.plan(model, ts.make_mesh({"data": 8})))
        >>> loader = (torch.randn(32, 16) for _ in range(3))
        >>> [float(trainer.step(batch)["loss"]) > 0 for batch in prefetch(loader, trainer)]
        [True, True, True]
    """
    problems = instance_problems("trainer", trainer, Trainer, "a torchshard.Trainer")
    problems += int_problems("size", size, minimum=1)
    raise_for_arguments(problems, header="invalid prefetch() arguments")
    return _consume(batches, trainer, size, local)


def _consume(batches: Iterable[Any], trainer: Trainer, size: int, local: bool) -> Iterator[Any]:
    ready: queue.Queue[Any] = queue.Queue(maxsize=size)
    stop = threading.Event()
    worker = threading.Thread(target=_fill, args=(batches, trainer, ready, stop, local), daemon=True)
    worker.start()
    try:
        while (item := ready.get()) is not _DONE:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:  # the consumer stopped early (break, error): let the thread end
        stop.set()
        worker.join(timeout=5)

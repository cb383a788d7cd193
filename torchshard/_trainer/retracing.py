"""A jitted step that is traced again when a plain torch tensor it read as a constant has been written since."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torchshard._bridge.captures import Captures, changed, recording

logger = logging.getLogger("torchshard")


class Retracing:
    """``make()``'s jitted function, made anew when a tensor captured by its trace was written in place.

    A ``loss_fn`` (or a model) that reads a CPU tensor from outside the model, such as class
    weights or a mask kept as a plain attribute, sees its values as they were when the step was
    traced: they are a constant of the compiled program. Eager torch reads them at every call, so
    after an in-place write (``weights.copy_(new)``, ``mask[:n] = False``) the step is traced again
    and says so. Rebinding a name to a new tensor is not seen: pass values that change in the batch.

    Args:
        make: a new jitted function each call (a fresh function object: JAX's trace cache is keyed on it).
    """

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._fn = make()
        self._captures: Captures = []

    def current(self) -> Any:
        """The jitted function, made again first if a tensor its trace captured has changed."""
        if (what := changed(self._captures)) is not None:
            logger.info("%s was written in place since the step was traced: tracing the step again", what)
            self._fn, self._captures = self._make(), []
        return self._fn

    def __call__(self, *args: Any) -> Any:
        fn = self.current()
        with recording(self._captures):
            return fn(*args)

    def lower(self, *args: Any) -> Any:
        fn = self.current()
        with recording(self._captures):
            return fn.lower(*args)

    def trace(self, *args: Any) -> Any:
        fn = self.current()
        with recording(self._captures):
            return fn.trace(*args)

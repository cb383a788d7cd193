"""A Trainer method that is one of its parts' methods: the part's signature and docstring, kept in one place."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, Concatenate, overload


class Forward[Owner, Part, **P, R]:
    """``owner.name(...)`` calls ``method`` on ``part(owner)``: a public method whose home is one of the owner's parts.

    The part's method keeps the docstring and its example (run there), and the owner shows it
    (``help(Trainer.log)``, ``inspect.signature``) without a copy that could drift.

    Args:
        part: the owner's part that ``method`` belongs to.
        method: the part class's method (unbound).
    """

    def __init__(self, part: Callable[[Owner], Part], method: Callable[Concatenate[Part, P], R]) -> None:
        self.part, self.method = part, method
        functools.update_wrapper(self, method)  # type: ignore[arg-type]  # __doc__, __name__, __wrapped__...

    @overload
    def __get__(self, owner: None, cls: type[Any]) -> Forward[Owner, Part, P, R]: ...

    @overload
    def __get__(self, owner: Owner, cls: type[Any] | None = None) -> Callable[P, R]: ...

    def __get__(self, owner: Owner | None, cls: type[Any] | None = None) -> Any:
        if owner is None:
            return self  # read on the class: this, with the method's docstring
        return types.MethodType(self.method, self.part(owner))

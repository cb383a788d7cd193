"""The loaders' ``rename=``: checkpoint names mapped to the model's by a callable or ``(regex, replacement)`` pairs."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from torchshard._base.errors import ArgumentError
from torchshard._base.validate import regex_problem

Rename = Callable[[str], "str | None"] | Sequence[tuple[str, str]]


def rename_problems(rename: Any) -> list[str]:
    """What is wrong with ``rename=``: neither None, a callable, nor a list of (regex, replacement) pairs."""
    if rename is None or callable(rename):
        return []
    fix = "rename must be a callable name → name (None drops it) or a list of (regex, replacement) pairs"
    if isinstance(rename, str | bytes) or not isinstance(rename, Sequence):
        return [f"rename is a {type(rename).__name__}; {fix}"]
    problems = []
    for i, pair in enumerate(rename):
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            problems.append(f"rename[{i}] = {pair!r:.60} is not a (regex, replacement) pair of strings; {fix}")
        elif (problem := regex_problem(pair[0])) is not None:
            problems.append(f"rename[{i}] regex {pair[0]!r} {problem}")
    return problems


def renamer(rename: Rename | None) -> Callable[[str], str | None]:
    """``rename`` as one function name → name (None drops it); the user's callable is wrapped by `called`."""
    if rename is None:
        return lambda name: name
    if callable(rename):
        return lambda name: called(rename, name)
    table = [(re.compile(pattern), replacement) for pattern, replacement in rename]

    def apply(name: str) -> str:
        for pattern, replacement in table:
            name = pattern.sub(replacement, name)
        return name

    return apply


def called(rename: Callable[[str], str | None], name: str) -> str | None:
    """``rename(name)``; what it raises becomes an `ArgumentError` naming the call (the original is its cause).

    Examples:
        >>> def rename(name):
        ...     raise KeyError(name)
        >>> called(rename, "lm_head.weight")
        Traceback (most recent call last):
        ...
        torchshard._base.errors.ArgumentError: rename=rename raised KeyError: 'lm_head.weight' for the checkpoint ...
    """
    try:
        return rename(name)
    except Exception as err:  # the user's code: said where it was called, its exception kept as the cause
        who = getattr(rename, "__qualname__", None) or repr(rename)
        raise ArgumentError(
            f"rename={who:.60} raised {type(err).__name__}: {err} for "
            f"the checkpoint name {name!r}; nothing was loaded: fix it (return None to drop a tensor, a str to map it)"
        ) from err


def model_names(stored: Sequence[str], rename: Rename | None) -> tuple[dict[str, str], list[str]]:
    """Model name → checkpoint name, and the names two checkpoint tensors were renamed to."""
    rename_one = renamer(rename)
    found: dict[str, str] = {}
    problems = []
    for name in stored:
        new = rename_one(name)
        if new is None:
            continue
        if not isinstance(new, str):
            problems.append(f"rename({name!r}) returned a {type(new).__name__}, not a str or None")
        elif new in found:
            problems.append(f"{found[new]!r} and {name!r} are both renamed to {new!r}; rename one of them otherwise")
        else:
            found[new] = name
    return found, problems

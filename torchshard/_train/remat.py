"""Activation checkpointing: chosen modules' forwards run under ``jax.checkpoint`` with a named policy."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import torch

from torchshard._base.errors import ShardingError
from torchshard._base.validate import closest_names, compiled, raise_for_arguments, regex_problem
from torchshard._bridge.env import continue_from, current_key
from torchshard._bridge.module_call import Forward, PureForward, module_arrays, split
from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import set_array

if TYPE_CHECKING:
    from torchshard._train.scan import ScanGroup

# policies that take where to offload to: they are given the device → pinned host pair
_OFFLOAD = ("offload_dot_with_no_batch_dims",)
POLICIES = tuple(
    sorted(
        name
        for name in dir(jax.checkpoint_policies)
        if not name.startswith("_") and (name.endswith("saveable") or name in _OFFLOAD)
    )
)


# torchshard's name for the policy to train with on GPUs (MaxText's configs call it "minimal"): keep every matmul
# against a weight, recompute the cheap rest (norms, activations, rotary, softmax) and attention's forward, whose
# scores are what flash attention exists not to keep
MATMULS = "matmuls"
# every name ``Remat(policy=)`` takes: jax's policies and torchshard's own (command lines offer these)
POLICY_NAMES = (*POLICIES, MATMULS)
# Remat's policy where none is named: jax's that saves nothing, so the backward recomputes every forward
DEFAULT_POLICY = "nothing_saveable"


def _policy_problems(policy: Any) -> list[str]:
    """Why ``policy`` is neither a name of `POLICY_NAMES` nor a function ``jax.checkpoint`` can call as a policy."""
    valid = f"one of {list(POLICY_NAMES)} or a function policy(prim, *avals, **params) -> bool"
    if isinstance(policy, str) and policy in POLICY_NAMES:
        return []
    if isinstance(policy, str) or not callable(policy):
        return [f"remat policy {policy!r} is not {valid}"]
    if isinstance(policy, type):
        return [f"remat policy {policy!r} is a class, not a policy function; use {valid}"]
    try:  # jax.checkpoint calls policy(primitive, *its input avals, **its params)
        inspect.signature(policy).bind(None, None, None, params=None)
    except TypeError:
        return [
            f"remat policy {policy!r:.60} cannot be called as policy(prim, *avals, **params) (a factory such as "
            f"jax.checkpoint_policies.save_only_these_names makes a policy when called); use {valid}"
        ]
    except ValueError:
        pass  # no signature to read (a builtin): jax.checkpoint is the judge
    return []


@dataclasses.dataclass(frozen=True)
class Remat:
    """Activation checkpointing for `Trainer` (``remat=``): which modules, and what their backward may reuse.

    The forward of every module whose ``named_modules()`` name ``re.fullmatch``-es one of
    ``modules`` runs under ``jax.checkpoint``: its activations are recomputed in the backward
    instead of kept, except what ``policy`` saves. Losses and gradients are unchanged. With
    ``scan_layers``, a pattern naming the scanned layers checkpoints the scan's body (XLA on CPU
    honours checkpoints only inside such loops).

    Args:
        modules: one regex or several, over module names such as ``model.layers.3``.
        policy: a name of `POLICY_NAMES`: a ``jax.checkpoint_policies`` name, ``"nothing_saveable"``
            (recompute all), ``"dots_saveable"`` (keep matmul outputs), ``"dots_with_no_batch_dims_saveable"``,
            ``"everything_saveable"``, or ``"offload_dot_with_no_batch_dims"`` (keep matmul outputs in
            pinned host memory, on backends that have it); ``"matmuls"``, the one to train with on
            GPUs (``dots_with_no_batch_dims_saveable``): keep every matmul against a weight, recompute
            norms, activations, rotary, softmax and attention's forward; or a policy function
            ``policy(prim, *avals, **params) -> bool``, as ``jax.checkpoint`` calls it.

    Raises:
        ArgumentError: a pattern that is not a valid regex; a policy that is no name of `POLICY_NAMES`
            and no policy function (a number, a class, a policy factory not yet called), the valid
            ones listed. Checked here, before any Trainer traces anything.

    Examples:
        >>> Remat(r"model\\.layers\\.\\d+", policy="dots_saveable").modules
        ('model\\\\.layers\\\\.\\\\d+',)
    """

    modules: str | Sequence[str]
    policy: str | Callable[..., Any] = DEFAULT_POLICY

    def __post_init__(self) -> None:
        patterns = (self.modules,) if isinstance(self.modules, str) else tuple(self.modules)
        object.__setattr__(self, "modules", patterns)
        problems = [f"remat pattern {p!r} is not a string" for p in patterns if not isinstance(p, str)]
        problems += [f"remat pattern {p!r} {why}" for p in patterns if isinstance(p, str) and (why := regex_problem(p))]
        if not patterns:
            problems.append("remat names no module pattern; pass e.g. r'model\\.layers\\.\\d+'")
        problems += _policy_problems(self.policy)
        raise_for_arguments(problems, header="invalid Remat")

    def jax_policy(self) -> Callable[..., Any]:
        """The policy as ``jax.checkpoint`` takes it."""
        if callable(self.policy):
            return self.policy
        name = "dots_with_no_batch_dims_saveable" if self.policy == MATMULS else self.policy
        policy = getattr(jax.checkpoint_policies, name)
        return policy("device", "pinned_host") if name in _OFFLOAD else policy


RematLike = str | Sequence[str] | Remat | None


def as_remat(remat: RematLike) -> Remat | None:
    """``Trainer(remat=...)`` as a `Remat` (a pattern or list of patterns means the default policy)."""
    if remat is None or isinstance(remat, Remat):
        return remat
    if isinstance(remat, str) or (isinstance(remat, Sequence) and all(isinstance(p, str) for p in remat)):
        return Remat(remat)
    raise_for_arguments(
        [f"remat={remat!r} must be a module-name regex, a list of them, or torchshard.Remat(modules, policy=...)"],
        header="invalid Trainer arguments",
    )
    return None


def remat_targets(model: torch.nn.Module, remat: Remat) -> list[str]:
    """Names of the modules to checkpoint (outermost only); a pattern matching none is a `ShardingError`."""
    names = [name for name, _ in model.named_modules() if name]
    problems = []
    for pattern in remat.modules:
        if not any(compiled(pattern).fullmatch(n) for n in names):
            close = closest_names(pattern, names)
            problems.append(f"remat pattern {pattern!r} matches no module of {type(model).__name__}; closest: {close}")
    if problems:
        raise ShardingError(problems, header=f"invalid remat for {type(model).__name__} ({len(problems)} problem(s))")
    chosen = [n for n in names if any(compiled(p).fullmatch(n) for p in remat.modules)]
    return [n for n in chosen if not any(n.startswith(outer + ".") for outer in chosen)]


def checkpointed(module: torch.nn.Module, forward: Forward, policy: Callable[..., Any]) -> Forward:
    """``forward`` of ``module`` run under ``jax.checkpoint``; buffers it updates are written back."""

    def call(*args: Any, **kwargs: Any) -> Any:
        inputs, spec = split((args, kwargs))
        state, buffers = module_arrays(module)
        pure = PureForward(module, forward, spec, buffers)
        # the key goes in and comes out: dropout draws what it would unwrapped, and the same when recomputed
        out, new_buffers, key, hooked = jax.checkpoint(pure.__call__, policy=policy)(state, inputs, current_key())
        continue_from(key)
        tensors = named_tensors(module)
        for name, array in new_buffers.items():
            set_array(tensors[name], array)
        pure.replay_hooks(hooked)  # what submodules' hooks record (MoE router logits) comes from outside the body
        return pure.rebuild(out)

    return call


def scan_remat(groups: tuple[ScanGroup, ...], targets: list[str], remat: Any) -> tuple[dict[str, Any], list[str]]:
    """Remat targets that are scanned blocks become their scan body's policy; the rest stay module targets.

    Every block of a scan runs one body, so a pattern must name all blocks of a scanned list, or
    the same submodule of all of them.
    """
    policies, rest, problems = {}, [], []
    for group in groups:
        blocks = {group.block(i) for i in range(group.count)}
        chosen = blocks & set(targets)
        if chosen and chosen != blocks:
            problems.append(f"remat names {sorted(chosen)} but not every block of the scanned {group.prefix}")
        if chosen:
            policies[group.prefix] = remat.jax_policy()
        inside = {_relative(group, t) for t in targets if t.startswith(group.prefix + ".") and t not in blocks}
        for index, name in inside:
            if any((i, name) not in inside for i in range(group.count)):
                problems.append(f"remat names {group.block(index)}.{name} but not the same module of every block")
    rest = [t for t in targets if not any(t == g.block(i) for g in groups for i in range(g.count))]
    if problems:
        raise ShardingError(problems, header="remat cannot apply to scanned layers unevenly: all blocks run one body")
    return policies, rest


def _relative(group: ScanGroup, name: str) -> tuple[int, str]:
    key, _, rest = name[len(group.prefix) + 1 :].partition(".")
    index = group.index(key)
    assert index is not None  # a module inside the scanned container is inside one of its blocks
    return index, rest

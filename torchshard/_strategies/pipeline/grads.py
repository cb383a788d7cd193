"""The gradient of a step under a 1F1B pipeline: the model cut at its stack into a prefix, the stack and a loss tail.

``loss_fn`` is a black box that calls the model, so the step traces it twice: once stopped at
the stack's first call (the prefix: embeddings, masks; its vjp taken over the whole batch), and
once per micro-batch inside the pipeline loop with the stack's output given (the tail: final
norm, head and loss, whose vjp starts that micro-batch's backward at the last stage). Like
``grad_accum_steps``, the step's loss is the mean of ``loss_fn`` over the micro-batches.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from torchshard._base.errors import ShardingError
from torchshard._base.specs import entry_axes
from torchshard._bridge.module_call import PureForward
from torchshard._strategies.pipeline import ticks as one_f_one_b
from torchshard._strategies.pipeline.loop import LayerFn, batch_axes
from torchshard._strategies.pipeline.schedules import SCHEDULES
from torchshard._strategies.pipeline.stages import Stages
from torchshard._train.scan import ScanGroup
from torchshard._train.state import Arrays
from torchshard._train.step import Runtime, micro_batches

# None: the stack runs as it is; a _Capture: it stops the loss at the stack; an array: the stack returns it
_STACK: contextvars.ContextVar[Any] = contextvars.ContextVar("torchshard_1f1b_stack", default=None)


class _Stop(Exception):
    """Raised at the stack's first call to end the prefix's trace there."""


@dataclasses.dataclass
class _Capture:
    layer_fn: LayerFn | None = None
    h: jax.Array | None = None
    others: Sequence[jax.Array] = ()
    output: Any = None  # the structure of a block's output (`PureForward.output`), for the tail's rebuild
    given: jax.Array | None = None  # in the tail: the stack's output for the micro-batch
    policy: Any = None  # remat of the blocks: a jax.checkpoint policy for each layer
    schedule: str = "1f1b"  # how errors name the Pipeline


@contextlib.contextmanager
def _stack_is(value: Any) -> Iterator[None]:
    token = _STACK.set(value)
    try:
        yield
    finally:
        _STACK.reset(token)


def intercepted(
    pure: PureForward,
    layer: Mapping[str, jax.Array],
    layer_fn: LayerFn,
    h: jax.Array,
    others: Sequence[jax.Array],
    key: jax.Array,
    policy: Any = None,
) -> Any:
    """What a pipelined stack returns while a 1F1B step traces its prefix or tail: None when it runs as usual.

    Raises:
        _Stop: in the prefix, after recording the stack's inputs.
        ShardingError: in the tail, the stack got a hidden state of another shape than the prefix's.
    """
    mode = _STACK.get()
    if mode is None:
        return None
    if mode.given is None:
        # the block's output structure; constants among the call arguments (a mask built from no input) stay
        # constants, so that what the layers check of them (context parallelism's window) is what they will see
        traced = [isinstance(x, jax.core.Tracer) for x in others]
        shaped = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
        args = jax.tree.map(shaped, (dict(layer), h, [x for x, t in zip(others, traced, strict=True) if t], key))

        def block(layer: Any, h: jax.Array, given: list[jax.Array], key: jax.Array) -> Any:
            it = iter(given)
            return layer_fn(layer, h, [next(it) if t else x for x, t in zip(others, traced, strict=True)], key)

        jax.eval_shape(block, *args)
        mode.layer_fn, mode.h, mode.others, mode.output, mode.policy = layer_fn, h, tuple(others), pure.output, policy
        raise _Stop
    if mode.given.shape != h.shape:
        raise ShardingError(
            f"Pipeline(schedule={mode.schedule!r}): the stack got a hidden state {list(h.shape)} for one micro-batch, "
            f"expected {list(mode.given.shape)}; the model's code before the stack must treat rows independently"
        )
    pure.output = mode.output
    return mode.given.astype(h.dtype), key


@dataclasses.dataclass(frozen=True)
class Gradient:
    """``value_and_grad(runtime.loss, has_aux=True)`` for a step whose schedule runs its own loop (`Schedule.loop`)."""

    runtime: Runtime
    stages: Stages
    group: ScanGroup

    def __call__(self, params: Arrays, buffers: Arrays, frozen: Arrays, batch: Any, key: jax.Array):
        # the strategies' trace-time checks (context parallelism's "no SDPA call") see prefix, stages and tail as one
        with self.runtime.tracing():
            return self._grads(params, buffers, frozen, batch, key)

    def _grads(self, params: Arrays, buffers: Arrays, frozen: Arrays, batch: Any, key: jax.Array):
        group, m = self.group, self.stages.microbatches
        stacked = {group.stacked(s): s for s in group.suffixes}
        capture = _Capture(schedule=self.stages.schedule)

        def prefix(p: Arrays):
            with _stack_is(capture), contextlib.suppress(_Stop):
                self.runtime.loss(p, buffers, frozen, batch, key)
            assert capture.h is not None  # a loss_fn that skips the stack fails in ScanRun.finish
            floats = [x for x in capture.others if one_f_one_b.floating(x)]
            return (capture.h, floats), [x for x in capture.others if not one_f_one_b.floating(x)]

        # the stack's inputs as the vjp returns them (what the trace captured may be its own tracers)
        (h, floats), prefix_pull, ints = jax.vjp(prefix, params, has_aux=True)
        assert capture.layer_fn is not None
        floats_it, ints_it = iter(floats), iter(ints)
        others = [next(floats_it) if one_f_one_b.floating(x) else next(ints_it) for x in capture.others]
        gathered = lambda arrays: _gathered(arrays, self.runtime.shardings, self.stages)  # noqa: E731
        tail_params = gathered({k: v for k, v in params.items() if k not in stacked})
        fixed_params = {k: v for k, v in params.items() if k in stacked}
        frozen = {**frozen, **gathered({k: v for k, v in frozen.items() if k not in stacked})}
        split = micro_batches(batch, m)

        def tail(i: jax.Array, h_mb: jax.Array) -> tuple[Any, jax.Array]:
            mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), split)

            def loss(tp: Arrays, h_mb: jax.Array):
                with _stack_is(dataclasses.replace(capture, given=h_mb)):
                    value, (new_buffers, aux) = self.runtime.loss(
                        {**tp, **fixed_params}, buffers, frozen, mb, jax.random.fold_in(key, i)
                    )
                _check_buffers(new_buffers, buffers, self.stages.schedule)
                return value, aux

            value, pull, aux = jax.vjp(loss, tail_params, h_mb, has_aux=True)
            d_tail, d_h = pull(jnp.asarray(1 / m, value.dtype))
            return (value / m, jax.tree.map(lambda a: a / m, aux), d_tail), d_h

        trainable = frozenset(s for k, s in stacked.items() if k in params)
        weights, cast_pull = jax.vjp(
            lambda w: self.runtime.cast_state(w, frozen, buffers, group), {k: params[k] for k in stacked if k in params}
        )
        loop = SCHEDULES[self.stages.schedule].loop
        assert loop is not None  # the binding asks for this gradient only then
        result: one_f_one_b.Result = loop()(
            self.stages,
            capture.layer_fn,
            weights,
            trainable,
            h,
            others,
            key,
            tail,
            context=self.runtime.around_layers,
            policy=capture.policy,
        )
        loss, aux, d_tail = result.sums
        d_prefix = prefix_pull((result.h, [d for d in result.others if d is not None]))[0]
        # the layer's buffers (XIELU's beta and eps in Apertus) come out of the cast with the weights: no gradient
        d_stack = cast_pull({s: result.weights.get(s, jnp.zeros_like(w)) for s, w in weights.items()})[0]
        grads = {k: d_prefix[k] + d_tail.get(k, 0) + d_stack.get(k, 0) for k in params}
        return (loss, (buffers, aux)), grads


def _gathered(arrays: Arrays, shardings: Mapping[str, NamedSharding], stages: Stages) -> Arrays:
    """``arrays`` gathered over the pipeline's batch axes once, before the loop: the tail runs in every tick, and
    FSDP-sharded head weights would be all-gathered in each (other axes, e.g. tensor parallelism, stay)."""
    batch = batch_axes(stages)
    out = {}
    for k, v in arrays.items():
        sharding = shardings.get(k)
        if sharding is None or not batch:
            out[k] = v
            continue
        dims = [_drop(entry, batch) for entry in sharding.spec]
        out[k] = jax.lax.with_sharding_constraint(v, NamedSharding(sharding.mesh, PartitionSpec(*dims)))
    return out


def _drop(entry: Any, axes: tuple[str, ...]) -> Any:
    kept = tuple(a for a in entry_axes(entry) if a not in axes)
    return kept[0] if len(kept) == 1 else (kept or None)


def _check_buffers(new: Arrays, old: Arrays, schedule: str) -> None:
    changed = sorted(k for k, v in new.items() if v is not old.get(k))
    if changed:
        raise ShardingError(
            f"Pipeline(schedule={schedule!r}): the model updates buffer(s) {changed} outside its stack (e.g. BatchNorm "
            f"running stats), which a loss computed per micro-batch at the last stage cannot carry; use "
            f"schedule='gpipe'"
        )


def gradient(stages: Stages, group: ScanGroup) -> Callable[[Runtime], Gradient]:
    """The step's gradient function for a 1F1B or zero-bubble pipeline of ``group``, given the step's `Runtime`."""
    return lambda runtime: Gradient(runtime, stages, group)

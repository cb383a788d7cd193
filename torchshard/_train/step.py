"""The pure training step: bind arrays into the torch module, differentiate the loss, apply optax."""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
import torch
from jax.sharding import NamedSharding

from torchshard._base.errors import ShardingError
from torchshard._base.reported import collecting
from torchshard._bridge.env import env, seeded
from torchshard._bridge.forwards import replaced_forwards
from torchshard._bridge.scopes import named_scopes
from torchshard._bridge.tensors import bound, is_jax_tensor, unwrap, wrap
from torchshard._train.batching import BatchLayout
from torchshard._train.kv_cache import no_kv_cache
from torchshard._train.precision import MixedPrecision, cast_on_shards
from torchshard._train.remat import checkpointed
from torchshard._train.scan import ScanGroup, ScanRun, blocks_of, layer_slices
from torchshard._train.state import Arrays, TrainState
from torchshard._train.traced_errors import traced_value_message

LossFn = Callable[[torch.nn.Module, Any], Any]
RESERVED_METRICS = ("loss", "grad_norm", "skipped")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor) and not is_jax_tensor(value):
        return f"a plain {value.device.type} torch tensor (computed outside the step, so it has no gradient)"
    return f"a {type(value).__name__} ({value!r:.40})"


def loss_and_aux(out: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """What ``loss_fn`` returned, checked: a scalar floating loss tensor and named scalar metrics."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            raise ShardingError(
                f"loss_fn returned a tuple of {len(out)}; return the loss tensor, or (loss, {{name: metric}})"
            )
        loss, aux = out
    else:
        loss, aux = out, {}
    if not is_jax_tensor(loss):
        raise ShardingError(
            f"loss_fn returned {_describe(loss)} as the loss; return the loss tensor computed from the model's "
            f"output (not loss.item() or float(loss)), or nothing trains"
        )
    value = unwrap(loss)
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.floating):
        raise ShardingError(
            f"loss_fn must return a floating scalar loss, got a {value.dtype} tensor of shape {tuple(value.shape)}; "
            f"reduce it (e.g. .mean())"
        )
    return value.astype(jnp.float32), _metrics(aux)


def _metrics(aux: Mapping[Any, Any]) -> dict[str, jax.Array]:
    problems = [f"metric {k!r}: names must be strings" for k in aux if not isinstance(k, str)]
    problems += [f"metric {k!r} would replace the step's own {k!r}; rename it" for k in aux if k in RESERVED_METRICS]
    values = {k: unwrap(v) if is_jax_tensor(v) else v for k, v in aux.items()}
    for k, v in values.items():
        if not isinstance(v, int | float | jax.Array):
            problems.append(f"metric {k!r} is {_describe(v)}; metrics are scalar tensors or numbers")
        elif jnp.shape(v) != ():
            problems.append(
                f"metric {k!r} has shape {tuple(jnp.shape(v))}; metrics are scalars (reduce it, e.g. .mean())"
            )
    if problems:
        raise ShardingError(problems, header=f"loss_fn's metrics are invalid ({len(problems)} problem(s))")
    return {k: jnp.asarray(v) for k, v in values.items()}


def _culprit(trace: types.TracebackType | None, model: torch.nn.Module) -> str:
    """The innermost module of ``model`` whose code is on the traceback, as ``Class 'name'``."""
    names = {id(m): n for n, m in model.named_modules()}
    found = "loss_fn"
    while trace is not None:
        owner = trace.tb_frame.f_locals.get("self")
        if id(owner) in names:
            found = f"{type(owner).__name__} {names[id(owner)] or '(the model)'!r}"
        trace = trace.tb_next
    return found


def _from_numerics_library(err: BaseException) -> bool:
    trace, last = err.__traceback__, ""
    while trace is not None:
        last = trace.tb_frame.f_code.co_filename
        trace = trace.tb_next
    # torchshard's own op lowerings count: they check operands as torch's kernels do
    libraries = ("/jax/", "/jaxlib/", "/torchax/", "/opt_einsum/", "/numpy/", "/torchshard/_bridge/ops/")
    return any(part in last for part in libraries)


def _leaves(batch: Any) -> str:
    leaves = jax.tree.leaves(batch)
    described = (
        f"#{i} {str(getattr(x, 'dtype', '?')).removeprefix('torch.')}{list(getattr(x, 'shape', ()))}"
        for i, x in enumerate(leaves)
    )
    return ", ".join(described)


def call_loss(loss_fn: LossFn, model: torch.nn.Module, batch: Any) -> Any:
    """``loss_fn(model, batch)`` while tracing, with the errors tracing causes translated to what to do."""
    try:
        return loss_fn(model, batch)
    except (jax.errors.JAXTypeError, jax.errors.JAXIndexError) as err:
        if (message := traced_value_message(err, _culprit(err.__traceback__, model))) is None:
            raise
        raise ShardingError(message) from err
    except (TypeError, ValueError) as err:
        if isinstance(err, ShardingError) or not _from_numerics_library(err):
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        raise ShardingError(
            f"loss_fn failed in {_culprit(err.__traceback__, model)} on batch leaves {_leaves(batch)}: "
            f"{type(err).__name__}: {first}; check the batch's shapes and dtypes against the model"
        ) from err


@contextlib.contextmanager
def _forwards(model: torch.nn.Module, remat: Sequence[str], policy: Any, runs: Sequence[ScanRun]) -> Iterator[None]:
    """Inside the block, remat targets run checkpointed and scanned blocks run through their scan."""
    with replaced_forwards() as replace:
        for name in remat:
            module = model.get_submodule(name)
            replace(module, checkpointed(module, module.forward, policy))
        for run in runs:
            for i, block in enumerate(blocks_of(model, run.group)):
                replace(block, run.hook(i))
        yield


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Binds jax arrays into the torch module for one traced call and reads updated buffers back.

    Physical names (what the train state is keyed by) are the module's canonical tensor names,
    except for scanned blocks, whose tensors are stacked under ``prefix.*.suffix``.
    """

    model: torch.nn.Module
    loss_fn: LossFn
    precision: MixedPrecision | None = None
    shardings: Mapping[str, NamedSharding] = dataclasses.field(default_factory=dict)
    groups: tuple[ScanGroup, ...] = ()
    remat: tuple[str, ...] = ()
    remat_policy: Any = None
    body_policies: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    batch: BatchLayout | None = None  # constrains scanned hidden states like the batch's rows
    # entered around each trace of the loss: the strategies' (e.g. context-parallel attention's SDPA lowering)
    tracing: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    def _cast(self, arrays: Arrays) -> Arrays:
        if self.precision is None:
            return arrays
        return {k: cast_on_shards(v, self.shardings.get(k), self.precision) for k, v in arrays.items()}

    def cast_state(self, params: Arrays, frozen: Arrays, buffers: Arrays, group: ScanGroup) -> dict[str, jax.Array]:
        """``group``'s stacked arrays as its blocks see them (cast by the precision policy), by suffix."""
        state = {**self._cast({**params, **frozen}), **buffers}
        return {s: state[group.stacked(s)] for s in group.suffixes if group.stacked(s) in state}

    @contextlib.contextmanager
    def around_layers(self) -> Iterator[None]:
        """What a block's forward is traced inside when a strategy runs it outside ``loss_fn`` (a 1F1B stage)."""
        with env(), torch.device("jax"), _forwards(self.model, self.remat, self.remat_policy, ()), self.tracing():
            yield

    def _inputs(self, batch: Any) -> Any:
        if self.precision is None or not self.precision.cast_inputs:
            return batch
        return jax.tree.map(self.precision.compute, batch)

    def _runs(self, state: Arrays, batch: Any = None) -> list[ScanRun]:
        runs = []
        hidden = self.batch.hidden(batch) if self.batch is not None else None
        for group in self.groups:
            blocks = blocks_of(self.model, group)
            stacked = {s: state[group.stacked(s)] for s in group.suffixes}
            policy = self.body_policies.get(group.prefix)
            runs.append(ScanRun(group, blocks[0], blocks[0].forward, stacked, policy, hidden))
        return runs

    def _values(self, state: Arrays) -> dict[str, torch.Tensor]:
        stacked = {key for g in self.groups for key, _ in g.members()}
        values = {k: wrap(v) for k, v in state.items() if k not in stacked}
        for group in self.groups:  # per-layer slices, for code that reads a layer's weights outside its forward
            values |= layer_slices(group, state)
        return values

    def run(
        self,
        fn: LossFn,
        params: Arrays,
        buffers: Arrays,
        frozen: Arrays,
        batch: Any,
        key: jax.Array,
        *,
        training: bool = False,
    ):
        """``fn(model, batch)`` with the module bound to these arrays: (what it returned, new buffers, reported).

        Raises:
            ShardingError: ``training`` and the forward wrote a parameter in place (see `_written_parameters`).
        """
        state = {**self._cast({**params, **frozen}), **buffers}
        # torch randomness (dropout, torch.rand) draws from torchax's key: this step's, for this trace
        # only; factory calls without a device make traced tensors, not CPU ones frozen at trace time
        with seeded(key), env(), torch.device("jax"):
            values = self._values(state)
            before = {k: unwrap(values[k]) for k in (*params, *frozen) if k in values}
            runs = self._runs(state, batch)
            with (
                bound(self.model, values),
                _forwards(self.model, self.remat, self.remat_policy, runs),
                no_kv_cache(self.model),
                named_scopes(self.model),  # HLO and profiles name the user's layers
                self.tracing(),
                collecting() as reported,  # e.g. the tokens an expert capacity dropped
            ):
                out = call_loss(fn, self.model, jax.tree.map(wrap, self._inputs(batch)))
            for run in runs:
                run.finish()
        if training and (written := [k for k, array in before.items() if unwrap(values[k]) is not array]):
            raise ShardingError(_written_parameters(self.model, written))
        new_buffers = {k: unwrap(values[k]) for k in buffers if k in values}
        for run in runs:
            new_buffers |= {
                run.group.stacked(s): a for s, a in run.new_buffers.items() if run.group.stacked(s) in buffers
            }
        return out, new_buffers, {k: jnp.asarray(v, jnp.float32) for k, v in reported.items()}

    def loss(self, params: Arrays, buffers: Arrays, frozen: Arrays, batch: Any, key: jax.Array):
        """``loss_fn(model, batch)`` with the module bound to these arrays: (loss, (new buffers, aux))."""
        out, new_buffers, reported = self.run(self.loss_fn, params, buffers, frozen, batch, key, training=True)
        loss, aux = loss_and_aux(out)
        return loss, (new_buffers, aux | reported)


def _written_parameters(model: torch.nn.Module, names: Sequence[str]) -> str:
    """Why a forward that writes its own parameters in place cannot be trained as it is, and the fix."""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"loss_fn: {type(model).__name__}'s forward writes parameter(s) {shown} in place (e.g. under torch.no_grad, "
        "as transformers' RWKV rescales its weights when it switches between train and eval mode). The Trainer's "
        "step is a pure function of the parameters: the write would not persist, every step would redo it, and "
        "the gradient would be taken through it, unlike eager torch. Make the write once, eagerly, before "
        "building the Trainer (e.g. run one forward in the mode you will train in), or turn the behaviour off "
        "(RWKV: config.rescale_every=0)."
    )


def micro_batches(batch: Any, k: int) -> Any:
    """[B, ...] → [k, B/k, ...] taking rows i, i+k, ...: each device keeps its own rows (no transfer)."""

    def split(x: jax.Array) -> jax.Array:
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.bool_(True)


def clip_grad_norm(grads: Any, norm: jax.Array, max_norm: float) -> Any:
    """``grads`` scaled as ``torch.nn.utils.clip_grad_norm_`` does: by ``max_norm / (norm + 1e-6)``, at most 1."""
    scale = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step as a pure function of (state, frozen params, batch, base key)."""

    runtime: Runtime
    optimizer: optax.GradientTransformation
    grad_accum_steps: int
    batch: BatchLayout  # each micro-batch is constrained to it
    skip_nonfinite: bool = False
    # a strategy's own value_and_grad of runtime.loss (a 1F1B pipeline's), made from the runtime
    gradient: Callable[[Runtime], Callable[..., Any]] | None = None
    max_grad_norm: float | None = None  # clips the gradients' global norm as torch's clip_grad_norm_ does

    def grads(self, state: TrainState, frozen: Arrays, batch: Any, key: jax.Array):
        """(mean loss, mean grads, new buffers, mean aux) over ``grad_accum_steps`` micro-batches."""
        if self.gradient is not None:
            grad_fn = self.gradient(self.runtime)
        else:
            grad_fn = jax.value_and_grad(self.runtime.loss, has_aux=True)
        k = self.grad_accum_steps
        if k == 1:
            (loss, (buffers, aux)), grads = grad_fn(state.params, state.buffers, frozen, batch, key)
            return loss, grads, buffers, aux

        def micro(carry, xs):
            index, micro_batch = xs
            buffers, grad_sum, loss_sum = carry
            micro_batch = jax.tree.map(self.batch.constrain, micro_batch)
            micro_key = jax.random.fold_in(key, index)
            (loss, (buffers, aux)), grads = grad_fn(state.params, buffers, frozen, micro_batch, micro_key)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (buffers, grad_sum, loss_sum + loss), aux

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        xs = (jnp.arange(k), micro_batches(batch, k))
        (buffers, grad_sum, loss_sum), aux = jax.lax.scan(micro, (state.buffers, zeros, jnp.float32(0)), xs)
        aux = jax.tree.map(lambda a: a.mean(0), aux)
        return loss_sum / k, jax.tree.map(lambda g: g / k, grad_sum), buffers, aux

    def __call__(self, state: TrainState, frozen: Arrays, batch: Any, base_key: jax.Array):
        key = jax.random.fold_in(jax.random.wrap_key_data(base_key), state.step)
        loss, grads, buffers, aux = self.grads(state, frozen, batch, jax.random.key_data(key))
        norm = optax.tree.norm(grads)
        if self.max_grad_norm is not None:
            grads = clip_grad_norm(grads, norm, self.max_grad_norm)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": norm, **aux}
        if self.skip_nonfinite:  # a non-finite step changes nothing but the step counter (and so the next key)
            ok = jnp.isfinite(loss) & _all_finite(grads)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
            params, opt_state, buffers = (
                keep(params, state.params),
                keep(opt_state, state.opt_state),
                keep(buffers, state.buffers),
            )
            metrics["skipped"] = jnp.where(ok, 0.0, 1.0)
        return TrainState(params, buffers, opt_state, state.step + 1), metrics

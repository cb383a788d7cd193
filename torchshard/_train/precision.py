"""Mixed precision: fp32 master weights and optimizer state, bf16 forward and backward inside the step."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax.sharding import NamedSharding

from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.layer_view import LayerView
from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import is_jax_tensor, jax_dtype, rebind, unwrap
from torchshard._sharding.placement import put
from torchshard._sharding.plan import ShardingPlan


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Where each dtype is used in a `Trainer` step: storage (``param_dtype``) and compute (``compute_dtype``).

    Parameters and optimizer state are stored in ``param_dtype`` (the master copy, also what
    checkpoints and `to_torch_state_dict` hold). Inside the jitted step each floating parameter
    is cast to ``compute_dtype`` on its own shard, so FSDP all-gathers move the small dtype;
    the forward and backward run in it, and the cast's gradient hands optax gradients in
    ``param_dtype``. Integer tensors and buffers are never cast.

    PyTorch FSDP2 users: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` on fp32 modules is
    ``MixedPrecision(compute_dtype=torch.bfloat16, param_dtype=torch.float32)`` here (FSDP2's
    ``param_dtype`` is the compute dtype; its sharded storage dtype is the module's own), and its
    ``cast_forward_inputs=True`` is ``cast_inputs=True``.

    Args:
        compute_dtype: dtype of the forward and backward (``torch.bfloat16`` or ``torch.float16``...).
        param_dtype: dtype parameters and optimizer state are stored and updated in.
        cast_inputs: cast floating batch tensors to ``compute_dtype`` before ``loss_fn`` sees them.

    Raises:
        ArgumentError: a dtype that is not a floating torch dtype.

    Examples:
        >>> policy = MixedPrecision()
        >>> policy.compute_dtype, policy.param_dtype
        (torch.bfloat16, torch.float32)
    """

    compute_dtype: torch.dtype = torch.bfloat16
    param_dtype: torch.dtype = torch.float32
    cast_inputs: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        problems = [
            f"{name}={value!r} must be a floating torch dtype such as torch.bfloat16 or torch.float32"
            for name, value in (("compute_dtype", self.compute_dtype), ("param_dtype", self.param_dtype))
            if not isinstance(value, torch.dtype) or not value.is_floating_point
        ]
        if not isinstance(self.cast_inputs, bool):
            problems.append(f"cast_inputs={self.cast_inputs!r} must be True or False")
        raise_for_arguments(problems, header="invalid MixedPrecision")

    def compute(self, x: jax.Array) -> jax.Array:
        """``x`` in the compute dtype if it is floating; integers and booleans unchanged."""
        return _cast(x, jax_dtype(self.compute_dtype))

    def stored(self, x: jax.Array) -> jax.Array:
        """``x`` in the storage dtype if it is floating; integers and booleans unchanged."""
        return _cast(x, jax_dtype(self.param_dtype))


# a precision's name (``plan --precision``, ``plan --search --precisions``) → the compute dtype of the MixedPrecision
# policy it stands for (None: float32 throughout, no policy): the one home of those names
PRECISIONS: dict[str, torch.dtype | None] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def named_policy(name: str | None) -> MixedPrecision | None:
    """The `MixedPrecision` a precision's name (of `PRECISIONS`) stands for; None for ``"fp32"`` or no name.

    Examples:
        >>> named_policy("bf16").compute_dtype, named_policy("fp32")
        (torch.bfloat16, None)
    """
    dtype = PRECISIONS[name or "fp32"]
    return None if dtype is None else MixedPrecision(dtype)


def master_dtype(name: str | None) -> torch.dtype | None:
    """The dtype parameters are stored in under the precision named: fp32 master weights under a policy, else
    None (the model's own dtype).

    Examples:
        >>> master_dtype("bf16"), master_dtype("fp32")
        (torch.float32, None)
    """
    policy = named_policy(name)
    return None if policy is None else policy.param_dtype


def compute_width(name: str) -> int:
    """Bytes per activation element under the precision named (of `PRECISIONS`)."""
    dtype = PRECISIONS[name]
    return 4 if dtype is None else dtype.itemsize


def _cast(x: jax.Array, dtype: Any) -> jax.Array:
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
        return x
    return x.astype(dtype)


def cast_on_shards(x: jax.Array, sharding: NamedSharding | None, policy: MixedPrecision) -> jax.Array:
    """The compute-dtype copy of a parameter (a traced value), kept on the parameter's own shards.

    Pinning the cast to the parameter's sharding makes GSPMD convert each shard before any
    all-gather, so FSDP moves the small dtype (and the gradient comes back in it, converted
    to the storage dtype on the shard).
    """
    cast = policy.compute(x)
    if cast is x or sharding is None:
        return cast
    return put(cast, sharding)


def stored_dtypes(plan: ShardingPlan, precision: MixedPrecision | None) -> dict[str, torch.dtype]:
    """The torch dtype each tensor of ``plan`` is stored in: floating params in the policy's master dtype."""
    dtypes = {n: e.dtype for n, e in plan.entries.items()}
    if precision is None:
        return dtypes
    params = {n for n, e in plan.entries.items() if e.kind == "param"}
    return {n: precision.param_dtype if n in params and d.is_floating_point else d for n, d in dtypes.items()}


def store_params(model: torch.nn.Module, plan: ShardingPlan, precision: MixedPrecision) -> None:
    """Rebinds ``model``'s params (as placed by ``plan``) to copies in the policy's master dtype."""
    # layers a Trainer stacks (on the host, or views of a stack init_sharded built) are cast as they are stacked
    params = {
        n: t
        for n, t in named_tensors(model).items()
        if not isinstance(t, LayerView) and n in plan and plan.entries[n].kind == "param" and is_jax_tensor(t)
    }
    arrays = {n: unwrap(t) for n, t in params.items()}
    stored = jax.jit(lambda t: jax.tree.map(precision.stored, t))(arrays)
    rebind(params, stored)

"""What to tell a user whose model needs a tensor's value, or a value-dependent shape, inside the jitted step."""

from __future__ import annotations

import types

import jax

# tracing raises these where the model asks a traced tensor for its value
_VALUE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)
# the torch call behind each JAX function whose result's shape depends on its input's values,
# keyed by the torchax lowering on the traceback (None: JAX's own name says enough)
_SHAPED_BY_VALUES = {
    "_aten_nonzero": "torch.nonzero (what one-argument torch.where(mask) and .nonzero() run)",
    "_aten_masked_select": "torch.masked_select",
    "_aten_unique2": "torch.unique",
    "_aten_unique_dim": "torch.unique",
    "_aten_unique_consecutive": "torch.unique_consecutive",
    "torch_Tensor_repeat_interleave": "repeat_interleave with tensor repeats",
    "_aten_repeat_interleave": "repeat_interleave with tensor repeats",
    "getitem": "indexing with a boolean mask (x[mask])",
    "_aten_index": "indexing with a boolean mask (x[mask])",
}
_JAX_SHAPED_BY_VALUES = ("nonzero", "argwhere", "flatnonzero", "unique", "_repeat", "expand_bool_indices")


def _frames(trace: types.TracebackType | None) -> list[types.CodeType]:
    codes = []
    while trace is not None:
        codes.append(trace.tb_frame.f_code)
        trace = trace.tb_next
    return codes


def value_dependent_call(err: BaseException) -> str | None:
    """The torch call whose result's shape depends on a traced tensor's values, if that is what ``err`` is about.

    Examples:
        >>> value_dependent_call(ValueError("not from tracing")) is None
        True
    """
    codes = _frames(err.__traceback__)
    jax_side = [c.co_name for c in codes if "/jax/" in c.co_filename]
    if not isinstance(err, jax.errors.NonConcreteBooleanIndexError) and not any(
        name in _JAX_SHAPED_BY_VALUES for name in jax_side
    ):
        return None
    lowerings = [c.co_name for c in codes if "/torchax/" in c.co_filename and c.co_name in _SHAPED_BY_VALUES]
    return _SHAPED_BY_VALUES[lowerings[-1]] if lowerings else "a call whose result's shape depends on values"


def traced_value_message(err: BaseException, culprit: str) -> str | None:
    """The message for an error tracing raised where ``culprit`` needs a tensor's value; ``None`` for other errors.

    Args:
        err: what ``loss_fn`` raised while the step was traced.
        culprit: the innermost module on the traceback, as ``Class 'name'`` (or ``loss_fn``).

    Returns:
        What went wrong and the static-shape form to write instead, or ``None`` if ``err`` is not
        about a traced tensor's value.

    Examples:
        >>> traced_value_message(KeyError("x"), "loss_fn") is None
        True
    """
    if not isinstance(err, _VALUE_ERRORS):
        return None
    call = value_dependent_call(err)
    if call is None:
        return (
            f"loss_fn: {culprit} turns a traced tensor into a Python value (if/while on a tensor, bool(), int(), "
            f".item(), .tolist(), .numpy()); inside the jitted step a tensor has no value yet. Keep it a tensor "
            f"(torch.where instead of if; for LayerDrop set layerdrop=0)"
        )
    return (
        f"loss_fn: {culprit} uses {call}, a data-dependent shape: its result's size depends on a tensor's "
        f"values, and inside the jitted step every shape is fixed when the step is traced. Write the "
        f"static-shape form: compute every row (every expert) densely and keep the chosen ones with a mask, "
        f"e.g. torch.where(mask, x, 0) with three arguments, or for a mixture of experts "
        f"(top_k_weights * (top_k_index == e)).sum(-1, keepdim=True) * expert_e(x) for each expert e; or stack "
        f"the experts on dim 0 of one module called as experts(hidden_states [T, H], top_k_index [T, k], "
        f"top_k_weights [T, k]), which ExpertDispatch moves tokens for (as transformers' experts modules are)"
    )

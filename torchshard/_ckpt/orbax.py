"""Array data of checkpoints through orbax (imported only when a checkpoint is written or read)."""

from __future__ import annotations

import pathlib
from typing import Any

from torchshard._base.errors import CheckpointError


def unwritable(tree: dict[str, Any]) -> list[str]:
    """Every array of ``tree`` whose dtype orbax's storage (tensorstore) cannot hold, named, with the fix."""
    import jax
    import tensorstore

    problems = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            continue  # orbax handles (or reports) non-array and extended leaves such as PRNG keys itself
        try:
            tensorstore.dtype(str(dtype))
        except ValueError:
            name = path[1].key if len(path) == 2 and path[0].key == "model" else jax.tree_util.keystr(path)
            problems.append(
                f"{name} {tuple(leaf.shape)} {dtype}: the checkpoint format (orbax/tensorstore) cannot hold {dtype}; "
                f"cast it to a dtype it holds (e.g. uint8), or keep it out of the module"
            )
    return problems


def write_state(directory: pathlib.Path, tree: dict[str, Any], *, key: str = "torchshard") -> None:
    """Every process writes its own shards of ``tree``; the primary finalises (orbax PyTree format).

    Uncompressed: zstd saves a few percent of a trained model's bytes and, on a loaded host,
    took 3-4 times as long as the write itself (benchmarks/checkpoint.py). Across processes
    orbax meets at the coordination service's
    barriers (named after ``key``, unique per save), not at a device collective: a background
    save must not run collectives beside the training step's.
    """
    import jax
    import orbax.checkpoint as ocp

    options = ocp.options.MultiprocessingOptions()
    if jax.process_count() > 1:
        every = set(range(jax.process_count()))
        options = ocp.options.MultiprocessingOptions(active_processes=every, barrier_sync_key_prefix=key)
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, multiprocessing_options=options)
    with ocp.Checkpointer(handler, multiprocessing_options=options) as checkpointer:
        checkpointer.save(directory, args=ocp.args.PyTreeSave(tree))


def read_state(directory: pathlib.Path, item: dict[str, Any], *, step_dir: pathlib.Path) -> dict[str, Any]:
    """Reads the arrays ``item`` describes (``ShapeDtypeStruct`` s with shardings), each straight into place."""
    import orbax.checkpoint as ocp

    restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            return checkpointer.restore(directory, args=args)
    except Exception as e:  # orbax and tensorstore report damage with many exception types
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{step_dir}: the array data could not be read ({type(e).__name__}: {first}); the checkpoint is "
            f"truncated or corrupted; load an earlier step"
        ) from e

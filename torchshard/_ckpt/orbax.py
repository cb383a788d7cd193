"""Array data of checkpoints written through orbax (before torchshard wrote its own shard files); read only."""

from __future__ import annotations

import pathlib
from typing import Any

from torchshard._base.errors import CheckpointError


def read_state(directory: pathlib.Path, item: dict[str, Any], *, step_dir: pathlib.Path) -> dict[str, Any]:
    """Reads the arrays ``item`` describes (``ShapeDtypeStruct`` s with shardings) from an orbax PyTree checkpoint."""
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

"""``--save`` / ``--resume``: the whole training state, written atomically, with no pickle.

Example:
    >>> save_state(Path("ckpt"), model, optimizer, batches, {"losses": [2.0]})
    >>> load_state(Path("ckpt"), model, optimizer, batches)["losses"]
    [2.0]
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Any

import torch

from ..data import ByteBatches

__all__ = ["checkpoint_path", "load_state", "save_state"]


def checkpoint_path(path: str, rank: int, world: int) -> Path:
    """``path`` itself for one process; ``path.rank<r>`` for each of several.

    Example:
        >>> checkpoint_path("ckpt", 1, 2).name
        'ckpt.rank1'
    """
    p = Path(path)
    return p if world == 1 else p.with_name(f"{p.name}.rank{rank}")


def save_state(
    path: Path, model: Any, optimizer: Any, batches: ByteBatches, record: dict[str, Any]
) -> None:
    """Model, optimizer, data generator, RNG and the curve so far, written atomically, no pickle.

    ``path`` becomes a directory (``slapo.checkpoint_io.save_tree``): the model's tensors in
    ``model.safetensors`` under their state-dict names (with ``config.json``), the optimizer, data
    generator and RNG state (a uint8 tensor) in ``state.safetensors``, the loss record and the
    hyperparameters in JSON. A DTensor (FSDP2) is stored as this rank's part.
    """
    # deferred: checkpoint I/O (safetensors) loads only for --save
    from ..checkpoint_io import save_tree

    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "data": batches.state_dict(),
        "rng": torch.get_rng_state(),
        "record": record,
    }
    save_tree(path, state, config=getattr(model, "config", None))


def load_state(path: Path, model: Any, optimizer: Any, batches: ByteBatches) -> dict[str, Any]:
    """Restore what :func:`save_state` wrote into ``model``, ``optimizer`` and ``batches``;
    returns the record.

    Reads only JSON and safetensors. DTensor entries are rebuilt like the live model's.
    """
    # deferred: checkpoint I/O (safetensors) loads only for --resume
    from ..checkpoint_io import CheckpointError, dtensor_like, load_tree

    try:
        state = load_tree(path)
    except CheckpointError as err:
        raise CheckpointError(f"--resume {path}: {err}") from err
    absent = [k for k in ("model", "optimizer", "data", "rng", "record") if k not in state]
    if absent:
        raise CheckpointError(
            f"--resume {path} holds no {absent}: not a `slapo train --save` state"
        )
    try:
        live = model.state_dict()
        model_state = {k: dtensor_like(v, live.get(k)) for k, v in state["model"].items()}
        optim_state = state["optimizer"]
        saved_ids = chain.from_iterable(g["params"] for g in optim_state.get("param_groups", []))
        params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
        by_id = dict(zip(saved_ids, params))
        for i, per_param in optim_state.get("state", {}).items():
            for key, value in per_param.items():  # exp_avg & co. are laid out like the parameter
                per_param[key] = dtensor_like(value, by_id.get(i))
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        batches.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"--resume {path} does not fit this run (saved with other options?): {err}"
        ) from err
    return state["record"]

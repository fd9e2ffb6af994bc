"""Checkpoints that load into any tensor-parallel layout, written atomically.

``save_checkpoint`` stores every parameter, buffer and optimizer state at its *full* (unsharded,
unpadded) shape through ``torch.distributed.checkpoint`` (DCP), which writes each tensor once even
when ranks hold copies. ``load_checkpoint`` reads the full tensors and keeps this rank's slice, so
a TP=2 checkpoint loads into an unsharded model or a TP=4 one. Tensors are read with
``weights_only`` semantics; the few non-tensor values (optimizer hyperparameters) live in a JSON
file, never in a pickle.

Atomicity: the checkpoint is written to ``<path>.tmp-slapo`` and renamed to ``<path>`` only after
every rank finished and the JSON marker was written, so a killed save leaves no ``<path>`` that
loads. The ranks must share the file system where ``path`` lives.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .exceptions import SlapoError
from .sharding.spec import ShardSpec, get_shard_spec

__all__ = ["save_checkpoint", "load_checkpoint", "export_safetensors", "CheckpointError", "MARKER"]

MARKER = "slapo_checkpoint.json"
_FORMAT = "slapo-dcp-v1"


class CheckpointError(SlapoError):
    """A checkpoint that is missing, incomplete, or does not match the model."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _param_specs(model: nn.Module) -> dict[str, ShardSpec]:
    specs = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        spec = get_shard_spec(param)
        if spec is not None:
            specs[name] = spec
    return specs


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every sharded tensor gathered to its full shape (collective).

    Example:
        >>> full = full_state_dict(model)  # on every rank of the tensor-parallel group
    """
    specs = _param_specs(model)
    gathered: dict[int, torch.Tensor] = {}  # tied parameters are gathered once
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        spec = specs.get(name)
        if spec is None:
            out[name] = tensor.detach()
            continue
        if id(tensor) not in gathered:
            gathered[id(tensor)] = spec.gather(tensor)
        out[name] = gathered[id(tensor)]
    return out


def _named_params(model: nn.Module) -> dict[int, tuple[str, nn.Parameter]]:
    return {id(p): (n, p) for n, p in model.named_parameters()}


def _optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full optimizer-state tensors keyed ``optim/<param>/<key>``, and JSON-able metadata."""
    names = _named_params(model)
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"groups": [], "scalars": {}}
    for group in optimizer.param_groups:
        hyper = {k: _jsonable(v) for k, v in group.items() if k != "params"}
        hyper["param_names"] = [names[id(p)][0] for p in group["params"]]
        meta["groups"].append(hyper)
        for p in group["params"]:
            name, spec = names[id(p)][0], get_shard_spec(p)
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    meta["scalars"].setdefault(name, {})[key] = _jsonable(value)
                elif spec is not None and value.shape == p.shape:
                    tensors[f"optim/{name}/{key}"] = spec.gather(value)
                else:
                    tensors[f"optim/{name}/{key}"] = value.detach()
    return tensors, meta


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def save_checkpoint(
    model: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Save ``model`` (and ``optimizer``) to the directory ``path``, atomically; call on every rank.

    Example:
        >>> slapo.save_checkpoint(model, "ckpt/step100", optimizer)
        >>> slapo.load_checkpoint(other_layout_model, "ckpt/step100")
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp-slapo")
    state = {f"model/{k}": v for k, v in full_state_dict(model).items()}
    marker: dict[str, Any] = {"format": _FORMAT, "model_keys": sorted(model.state_dict())}
    if optimizer is not None:
        optim_tensors, marker["optimizer"] = _optim_state(model, optimizer)
        state.update(optim_tensors)
        marker["optimizer"]["shapes"] = {k: list(v.shape) for k, v in optim_tensors.items()}
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed())
    _barrier()
    if _rank() == 0:
        _write_json(tmp / MARKER, marker)
        _replace_dir(tmp, path)
    _barrier()


def _write_json(file: Path, data: dict[str, Any]) -> None:
    with open(file, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(src: Path, dst: Path) -> None:
    old = dst.with_name(dst.name + ".old-slapo")
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def _read_marker(path: Path) -> dict[str, Any]:
    marker = path / MARKER
    if not marker.is_file():
        partial = path.with_name(path.name + ".tmp-slapo")
        extra = f" (an interrupted save left {partial})" if partial.exists() else ""
        raise CheckpointError(
            f"{path} is not a complete Slapo checkpoint: {MARKER} is missing{extra}; "
            "a save that did not finish never produces a loadable checkpoint"
        )
    data = json.loads(marker.read_text())
    if data.get("format") != _FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {data.get('format')!r}")
    return data


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model``, whatever its layout.

    Each rank reads the full tensors and keeps its slice (shards follow the parameters'
    ``ShardSpec``). With ``strict``, keys missing from the checkpoint are an error.

    Example:
        >>> slapo.load_checkpoint(model, "ckpt/step100", optimizer)
    """
    path = Path(path)
    marker = _read_marker(path)
    saved = set(marker["model_keys"])
    specs = _param_specs(model)
    own = model.state_dict(keep_vars=True)
    missing = sorted(set(own) - saved)
    if missing and strict:
        raise CheckpointError(f"{path} has no entry for {missing[:8]} (of {len(missing)} missing)")
    full = {
        f"model/{k}": torch.empty(specs[k].full_shape if k in specs else t.shape, dtype=t.dtype)
        for k, t in own.items()
        if k in saved
    }
    if optimizer is not None:
        if "optimizer" not in marker:
            raise CheckpointError(f"{path} holds no optimizer state")
        for key, shape in marker["optimizer"]["shapes"].items():
            full[key] = torch.empty(shape)
    try:
        dcp.load(full, checkpoint_id=str(path), no_dist=not _distributed())
    except Exception as err:
        raise CheckpointError(f"loading {path} failed: {err}") from err
    with torch.no_grad():
        for k, t in own.items():
            if f"model/{k}" in full:
                value = full[f"model/{k}"]
                t.copy_(specs[k].local_slice(value) if k in specs else value)
    if optimizer is not None:
        _load_optimizer(model, optimizer, marker["optimizer"], full)


def _load_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict, full: dict
) -> None:
    by_name = {n: p for n, p in model.named_parameters()}
    if len(meta["groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint has {len(meta['groups'])} optimizer param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    for group, saved in zip(optimizer.param_groups, meta["groups"]):
        for k, v in saved.items():
            if k != "param_names" and k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
        for name in saved["param_names"]:
            p = by_name.get(name)
            if p is None:
                raise CheckpointError(f"the optimizer state names parameter {name!r}, not in model")
            state = {}
            for key, value in full.items():
                prefix = f"optim/{name}/"
                if key.startswith(prefix):
                    spec = get_shard_spec(p)
                    sliced = spec is not None and tuple(value.shape) == spec.full_shape
                    state[key[len(prefix) :]] = spec.local_slice(value) if sliced else value
            state.update(meta["scalars"].get(name, {}))
            if state:
                optimizer.state[p] = state


def export_safetensors(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write the full (gathered) model as one Hugging Face-loadable safetensors directory.

    Call on every rank; rank 0 writes ``model.safetensors`` (tied duplicates stored once) and, for
    a ``transformers`` model, ``config.json``, so ``AutoModel...from_pretrained(directory)`` loads
    it. The directory appears atomically.

    Example:
        >>> export_safetensors(model, "export/gpt2-tp2")
        >>> transformers.GPT2LMHeadModel.from_pretrained("export/gpt2-tp2")
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    state = full_state_dict(model)
    if _rank() == 0:
        tmp = directory.with_name(directory.name + ".tmp-slapo")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        seen: set[int] = set()
        unique = {}
        for name, tensor in state.items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                unique[name] = tensor.contiguous()
        save_file(unique, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(str(tmp))
        _replace_dir(tmp, directory)
    _barrier()

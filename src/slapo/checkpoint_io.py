"""Checkpoints with no pickle anywhere: safetensors tensors, JSON metadata, written atomically.

A directory written by :func:`save_checkpoint` holds::

    model.safetensors           # or model-0000i-of-0000N.safetensors + model.safetensors.index.json
    optimizer.safetensors       # with an optimizer (or optimizer-0000i-of-0000N.safetensors)
    config.json                 # for a transformers model
    slapo_checkpoint.json       # the completion marker: format, keys, files, optimizer metadata

Every model tensor is stored once, at its *full* (unsharded, unpadded) shape, under its state-dict
name (tied duplicates once, as Hugging Face does), so ``transformers`` ``from_pretrained(directory)``
loads a checkpoint of a transformers model; the optimizer state lives in files of its own. The
ranks split the tensors between them and each writes its own file. :func:`load_checkpoint` reads
the full tensors and keeps this rank's slice, so a TP=2 checkpoint loads into an unsharded model or
a TP=4 one.

Why not ``torch.distributed.checkpoint``: its default format keeps ``.metadata`` as a pickle (a
crafted one runs code on load), and although its ``HuggingFaceStorageReader`` reads only safetensors
and JSON from disk, ``dcp.load`` still passes the metadata and load plans between ranks through
pickle-based object collectives. Here a load parses JSON (``json``) and safetensors (the
``safetensors`` header parser) and nothing else; no file of a checkpoint directory is ever
unpickled, and the old ``slapo-dcp-v1`` format is refused without reading its pickle.

Atomicity: the ranks write into ``<path>.tmp-slapo``; once every rank has written its files, rank 0
writes the marker and swaps the directory in (``<path>`` -> ``<path>.old-slapo``, then
``<path>.tmp-slapo`` -> ``<path>``, then removes the old copy). A killed save never leaves a
``<path>`` that loads. A crash between the two renames leaves no ``<path>`` but two complete
copies: loading takes the newer (``.tmp-slapo``, else ``.old-slapo``) with a logged warning, and the
next save finishes the swap first. The ranks must share the file system where ``path`` lives.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from .exceptions import SlapoError
from .logger import get_logger
from .sharding.collectives import run_collective
from .sharding.spec import ShardSpec, get_shard_spec

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "export_safetensors",
    "save_tree",
    "load_tree",
    "dtensor_like",
    "full_state_dict",
    "CheckpointError",
    "MARKER",
]

MARKER = "slapo_checkpoint.json"
FORMAT = "slapo-safetensors-v1"  # save_checkpoint
TREE_FORMAT = "slapo-tree-v1"  # save_tree (`slapo train --save`)
_LEGACY = ("slapo-dcp-v1",)  # torch.distributed.checkpoint, whose .metadata is a pickle
_TMP, _OLD = ".tmp-slapo", ".old-slapo"
_INDEX = "model.safetensors.index.json"
_ST_META = {"format": "pt"}  # transformers' from_pretrained checks it


class CheckpointError(SlapoError):
    """A checkpoint that is missing, incomplete, damaged, or does not match the model."""


# ----- ranks ------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _all_reduce_max(values: list[int], what: str) -> list[int]:
    """Element-wise max over every rank (bounded by the process group's timeout)."""
    if not _distributed():
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=device)
    run_collective(f"all_reduce ({what})", None, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX))
    return t.tolist()


def _step(what: str, fn: Callable[[], None] | None) -> None:
    """Run ``fn`` here (None: nothing), then agree over every rank that each one succeeded.

    A rank whose step raised does not leave the others waiting at a barrier: all of them raise.
    """
    error: BaseException | None = None
    if fn is not None:
        try:
            fn()
        except Exception as err:  # reported to the peers, then re-raised below
            error = err
    (failed,) = _all_reduce_max([int(error is not None)], what)
    if isinstance(error, CheckpointError):
        raise error
    if error is not None:
        raise CheckpointError(f"{what} failed on rank {_rank()}: {error}") from error
    if failed:
        raise CheckpointError(f"{what} failed on another rank (its own error says why)")


def _same_everywhere(entries: list[Any], what: str) -> None:
    """Every rank holds the same ``entries`` (checked by a CRC, with no object collective)."""
    crc = zlib.crc32(json.dumps(entries).encode())
    top, neg = _all_reduce_max([crc, -crc], what)
    if top != crc or -neg != crc:
        raise CheckpointError(
            f"{what}: the ranks hold different tensor names or shapes; save_checkpoint needs the "
            "same (tensor-parallel) model on every rank"
        )


# ----- full tensors -----------------------------------------------------------------------------
def _param_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """The spec of every sharded tensor by state-dict name: parameters, and the buffers cut with
    them (a channel-sharded BatchNorm's running statistics)."""
    specs = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        spec = get_shard_spec(tensor)
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


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{duplicate name: first name}`` for state-dict entries that are the same tensor."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def _optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full optimizer-state tensors keyed ``<param>/<key>``, and JSON-able metadata."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"groups": [], "scalars": {}, "tensors": {}}
    for i, group in enumerate(optimizer.param_groups):
        hyper = {
            k: _jsonable(v, f"optimizer.param_groups[{i}][{k!r}]")
            for k, v in group.items()
            if k != "params"
        }
        strays = [p for p in group["params"] if id(p) not in names]
        if strays:
            raise CheckpointError(
                f"optimizer.param_groups[{i}] holds {len(strays)} tensor(s) that are not "
                "parameters of the model; save the optimizer of this model"
            )
        hyper["params"] = [names[id(p)] for p in group["params"]]
        meta["groups"].append(hyper)
        for p in group["params"]:
            name, spec = names[id(p)], get_shard_spec(p)
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    where = f"optimizer state {key!r} of {name}"
                    meta["scalars"].setdefault(name, {})[key] = _jsonable(value, where)
                    continue
                full = spec.gather(value) if spec is not None and value.shape == p.shape else value
                tensors[f"{name}/{key}"] = full.detach()
                meta["tensors"].setdefault(name, {})[key] = f"{name}/{key}"
    return tensors, meta


def _jsonable(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a JSON checkpoint cannot hold"
    )


# ----- files ------------------------------------------------------------------------------------
def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(file: Path, data: Any) -> None:
    with open(file, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, no two on one storage (safetensors refuses shared memory)."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return out


def _save_file(tensors: dict[str, torch.Tensor], file: Path) -> None:
    # safetensors.torch.save_file is looked up at call time: a test kills a rank inside it
    safetensors.torch.save_file(_unshared(tensors), str(file), metadata=_ST_META)
    _fsync(file)


def _complete(root: Path) -> bool:
    return (root / MARKER).is_file()


def _begin_save(path: Path, tmp: Path) -> None:
    """Finish a swap a crash interrupted (no ``path``), then start an empty ``tmp``."""
    if not path.exists():
        for copy in (tmp, _sibling(path, _OLD)):
            if _complete(copy):
                os.rename(copy, path)
                get_logger().warning(
                    "%s was missing after an interrupted save; restored it from %s", path, copy
                )
                break
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _replace_dir(src: Path, dst: Path) -> None:
    old = _sibling(dst, _OLD)
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(src, dst)
    _fsync(dst.parent)
    shutil.rmtree(old, ignore_errors=True)


def _locate(path: Path) -> tuple[Path, dict[str, Any]]:
    """The complete copy to load for ``path`` and its marker, recovering an interrupted swap."""
    if _complete(path):
        return path, _read_marker(path)
    tmp, old = _sibling(path, _TMP), _sibling(path, _OLD)
    if not path.exists():
        for copy, which in ((tmp, "the newer"), (old, "the previous")):
            if _complete(copy):
                marker = _read_marker(copy)
                get_logger().warning(
                    "%s is missing: a save was interrupted between its two renames. Loading %s "
                    "complete copy %s instead; the next save to %s finishes the swap.",
                    path, which, copy, path,
                )  # fmt: skip
                return copy, marker
        if not tmp.exists() and not old.exists():
            raise CheckpointError(f"no such checkpoint: {path}")
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file, not a Slapo checkpoint directory (an older Slapo wrote pickles with "
            "torch.save; they can run code when loaded, so Slapo no longer reads them)"
        )
    extra = f" (an interrupted save left {tmp})" if tmp.exists() else ""
    if (path / ".metadata").exists():
        extra += "; its torch.distributed.checkpoint .metadata is a pickle, which Slapo never reads"
    raise CheckpointError(
        f"{path} is not a complete Slapo checkpoint: {MARKER} is missing{extra}; "
        "a save that did not finish never produces a loadable checkpoint"
    )


def _read_marker(root: Path) -> dict[str, Any]:
    file = root / MARKER
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{file} is not valid JSON ({err}): the checkpoint's marker is damaged"
        ) from err
    except OSError as err:
        raise CheckpointError(f"cannot read {file}: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} holds a JSON {type(data).__name__}, not an object")
    fmt = data.get("format")
    if fmt in _LEGACY:
        raise CheckpointError(
            f"{root} was written by an older Slapo in the torch.distributed.checkpoint format "
            f"({fmt!r}), whose .metadata file is a pickle that can run code when read; Slapo no "
            "longer reads it. If you trust it, load it with that older Slapo and save it again "
            "with this one."
        )
    if fmt not in (FORMAT, TREE_FORMAT):
        raise CheckpointError(f"{file}: unknown checkpoint format {fmt!r}")
    return data


def _field(marker: dict, name: str, kind: type, root: Path) -> Any:
    value = marker.get(name)
    if not isinstance(value, kind):
        raise CheckpointError(
            f"{root / MARKER}: {name!r} is missing or not a {kind.__name__}: the marker is damaged"
        )
    return value


class _Reader:
    """Opened safetensors files of one checkpoint directory (header parsing only, no pickle)."""

    def __init__(self, root: Path, stack: contextlib.ExitStack) -> None:
        self.root, self.stack = root, stack
        self.files: dict[str, tuple[Any, set[str]]] = {}

    def _open(self, name: Any) -> tuple[Any, set[str]]:
        if name not in self.files:
            if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
                raise CheckpointError(f"{self.root / MARKER} names a bad file {name!r}")
            file = self.root / name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing: the checkpoint is damaged")
            try:
                handle = self.stack.enter_context(safe_open(str(file), framework="pt"))
                self.files[name] = (handle, set(handle.keys()))
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{file} is not a readable safetensors file: {err}") from err
        return self.files[name]

    def _check(self, name: str, key: str) -> Any:
        handle, keys = self._open(name)
        if key not in keys:
            raise CheckpointError(f"{self.root / name} holds no tensor {key!r}: it is damaged")
        return handle

    def shape(self, name: str, key: str) -> tuple[int, ...]:
        return tuple(self._check(name, key).get_slice(key).get_shape())

    def get(self, name: str, key: str) -> torch.Tensor:

        handle = self._check(name, key)
        try:
            return handle.get_tensor(key)
        except SafetensorError as err:
            raise CheckpointError(f"reading {key!r} from {self.root / name}: {err}") from err


# ----- save / load a (tensor-parallel) model ----------------------------------------------------
def _plan(tensors: dict[str, torch.Tensor], stem: str, world: int) -> dict[str, tuple[int, str]]:
    """``{key: (writing rank, file name)}``: the largest tensors first, each to the least-loaded
    rank; deterministic, so every rank computes the same plan."""
    load, owner = [0] * world, {}
    for key in sorted(tensors, key=lambda k: (-tensors[k].numel() * tensors[k].element_size(), k)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[key] = rank
        load[rank] += tensors[key].numel() * tensors[key].element_size()
    used = sorted(set(owner.values()))
    if len(used) == 1:
        names = {used[0]: f"{stem}.safetensors"}
    else:
        names = {r: f"{stem}-{i:05d}-of-{len(used):05d}.safetensors" for i, r in enumerate(used, 1)}
    return {key: (rank, names[rank]) for key, rank in owner.items()}


def save_checkpoint(
    model: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Save ``model`` (and ``optimizer``) to the directory ``path``, atomically; call on every rank.

    Tensors go to safetensors files at their full shapes (a transformers model's directory loads
    with ``from_pretrained``), everything else to JSON; nothing is pickled.

    Example:
        >>> slapo.save_checkpoint(model, "ckpt/step100", optimizer)
        >>> slapo.load_checkpoint(other_layout_model, "ckpt/step100")
    """
    path = Path(path)
    tmp = _sibling(path, _TMP)
    rank, world = _rank(), _world()
    state = full_state_dict(model)
    aliases = _tied_aliases(model)
    groups = {"model": {k: v for k, v in state.items() if k not in aliases}}
    marker: dict[str, Any] = {"format": FORMAT, "model_keys": list(state), "aliases": aliases}
    if optimizer is not None:
        groups["optimizer"], marker["optimizer"] = _optim_state(model, optimizer)
    plans = {stem: _plan(tensors, stem, world) for stem, tensors in groups.items()}
    _same_everywhere(
        [[k, list(v.shape), str(v.dtype)] for g in groups.values() for k, v in g.items()],
        f"saving {path}",
    )
    marker["model_files"] = {k: f for k, (_, f) in plans["model"].items()}
    if optimizer is not None:
        marker["optimizer"]["files"] = {k: f for k, (_, f) in plans["optimizer"].items()}
    _step(f"preparing {tmp}", (lambda: _begin_save(path, tmp)) if rank == 0 else None)

    def write_mine() -> None:
        for stem, tensors in groups.items():
            by_file: dict[str, dict[str, torch.Tensor]] = {}
            for key, (owner, file) in plans[stem].items():
                if owner == rank:
                    by_file.setdefault(file, {})[key] = tensors[key]
            for file, part in by_file.items():
                _save_file(part, tmp / file)

    _step(f"writing the tensors of {path}", write_mine)

    def finish() -> None:
        files = sorted({f for plan in plans.values() for _, f in plan.values()})
        missing = [f for f in files if not (tmp / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{missing} did not appear in {tmp}: the ranks must share the file system of {path}"
            )
        model_files = set(marker["model_files"].values())
        if len(model_files) > 1:  # Hugging Face's sharded layout
            size = sum(v.numel() * v.element_size() for v in groups["model"].values())
            index = {"metadata": {"total_size": size}, "weight_map": marker["model_files"]}
            _write_json(tmp / _INDEX, index)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(str(tmp))
        _write_json(tmp / MARKER, marker)
        _replace_dir(tmp, path)

    _step(f"completing {path}", finish if rank == 0 else None)


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model``, whatever its layout.

    Each rank reads the full tensors and keeps its slice (shards follow the parameters'
    ``ShardSpec``). With ``strict``, keys missing from the checkpoint are an error. Every shape is
    checked against the files' headers before anything is copied: a mismatch raises
    :class:`CheckpointError` naming the file, the keys and both shapes, and leaves the model as is.

    Example:
        >>> slapo.load_checkpoint(model, "ckpt/step100", optimizer)
    """
    path = Path(path)
    root, marker = _locate(path)
    if marker["format"] != FORMAT:
        raise CheckpointError(
            f"{root} holds a `slapo train --save` state, not a save_checkpoint checkpoint; resume "
            "it with `slapo train --resume`"
        )
    saved = set(_field(marker, "model_keys", list, root))
    files = _field(marker, "model_files", dict, root)
    aliases = _field(marker, "aliases", dict, root)
    specs = _param_specs(model)
    own = model.state_dict(keep_vars=True)
    missing = [k for k in own if k not in saved]
    if missing and strict:
        raise CheckpointError(
            f"{root} has no entry for {missing[:8]} (of {len(missing)} missing); pass "
            "strict=False to keep those tensors as they are"
        )
    meta = _optimizer_meta(root, marker, model, optimizer) if optimizer is not None else None
    with contextlib.ExitStack() as stack:
        reader = _Reader(root, stack)
        sources, wrong = {}, []
        for k, t in own.items():
            if k not in saved:
                continue
            key = aliases.get(k, k)
            if key not in files:
                raise CheckpointError(f"{root / MARKER} names no file for {key!r}: it is damaged")
            expected = specs[k].full_shape if k in specs else tuple(t.shape)
            got = reader.shape(files[key], key)
            if got != tuple(expected):
                wrong.append(
                    f"{key!r} in {files[key]} is {list(got)}, the model's {list(expected)}"
                )
            sources[k] = (files[key], key)
        if wrong:
            raise CheckpointError(
                f"{root} does not fit the model: {len(wrong)} tensor(s) have other shapes: "
                + "; ".join(wrong[:8])
                + ". Build the model with the configuration it was saved from."
            )
        with torch.no_grad():
            for k, (file, key) in sources.items():
                value = reader.get(file, key)
                own[k].copy_(specs[k].local_slice(value) if k in specs else value)
        if optimizer is not None:
            _load_optimizer(model, optimizer, meta, reader)


def _optimizer_meta(
    root: Path, marker: dict, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict:
    """The marker's optimizer entry, checked against ``optimizer`` before anything loads."""
    meta = marker.get("optimizer")
    if meta is None:
        raise CheckpointError(f"{root} holds no optimizer state; load it without an optimizer")
    damaged = CheckpointError(f"{root / MARKER}: the optimizer entry is damaged")
    if not isinstance(meta, dict) or not all(
        isinstance(meta.get(k), t)
        for k, t in (("groups", list), ("scalars", dict), ("tensors", dict), ("files", dict))
    ):
        raise damaged
    if len(meta["groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{root} has {len(meta['groups'])} optimizer param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    by_name = dict(model.named_parameters())
    for saved in meta["groups"]:
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            raise damaged
        stray = [n for n in saved["params"] if n not in by_name]
        if stray:
            raise CheckpointError(
                f"{root}: the optimizer state names parameters {stray[:8]}, not in the model"
            )
    for per_param in meta["tensors"].values():
        if not isinstance(per_param, dict) or any(
            k not in meta["files"] for k in per_param.values()
        ):
            raise damaged
    return meta


def _load_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict, reader: _Reader
) -> None:
    by_name = dict(model.named_parameters())
    for group, saved in zip(optimizer.param_groups, meta["groups"]):
        for k, v in saved.items():
            if k != "params" and k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
        for name in saved["params"]:
            p = by_name[name]
            spec = get_shard_spec(p)
            state: dict[str, Any] = {}
            for key, tensor_key in meta["tensors"].get(name, {}).items():
                value = reader.get(meta["files"][tensor_key], tensor_key)
                if spec is not None and tuple(value.shape) == spec.full_shape:
                    value = spec.local_slice(value)
                state[key] = value if key == "step" else value.to(p.device)
            state.update(meta["scalars"].get(name, {}))
            if state:
                optimizer.state[p] = state


# ----- one process's nested state (`slapo train --save`) ----------------------------------------
class _TreeEncoder:
    """Nested dicts/lists/tuples of tensors and JSON scalars -> JSON + named tensors."""

    def __init__(self) -> None:
        self.files: dict[str, dict[str, torch.Tensor]] = {}
        self.views: dict[tuple, dict[str, Any]] = {}

    def tensor(self, t: torch.Tensor, file: str, name: str) -> dict[str, Any]:

        node: dict[str, Any] = {}
        if isinstance(t, DTensor):  # this rank's part; dtensor_like rebuilds it on load
            t, node["dtensor"] = t.to_local(), True
        t = t.detach()
        storage = t.untyped_storage().data_ptr()
        view = (t.device, storage, t.storage_offset(), t.shape, t.stride(), t.dtype)
        if t.numel() and view in self.views:  # tied entries: stored once, read back shared
            return {**self.views[view], **node}
        tensors = self.files.setdefault(file, {})
        unique, n = name, 1
        while unique in tensors:
            unique, n = f"{name}#{n}", n + 1
        tensors[unique] = t
        ref = {"__tensor__": unique, "file": file}
        self.views[view] = ref
        return {**ref, **node}

    def encode(self, value: Any, where: tuple) -> Any:
        if isinstance(value, torch.Tensor):
            flat_model = len(where) == 2 and where[0] == "model" and isinstance(where[1], str)
            if flat_model:  # the model under its own state-dict names: from_pretrained reads it
                return self.tensor(value, "model.safetensors", where[1])
            return self.tensor(value, "state.safetensors", "/".join(map(str, where)))
        if isinstance(value, dict):
            for k in value:
                if not _scalar(k):
                    at = "/".join(map(str, where))
                    raise CheckpointError(f"the key {k!r} at {at} is not a JSON scalar")
            return {"__dict__": [[k, self.encode(v, (*where, k))] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, (*where, i)) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, (*where, i)) for i, v in enumerate(value)]
        if _scalar(value):
            return value
        raise CheckpointError(
            f"{'/'.join(map(str, where))} is a {type(value).__name__}; a checkpoint holds only "
            "tensors, dicts, lists, tuples and JSON scalars"
        )


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _decode(node: Any, reader: _Reader, cache: dict[tuple, torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(v, reader, cache) for v in node]
    if not isinstance(node, dict):
        return node
    if "__tensor__" in node:
        ref = (node.get("file"), node["__tensor__"])
        if ref not in cache:
            cache[ref] = reader.get(*ref)
        return cache[ref]
    if isinstance(node.get("__tuple__"), list):
        return tuple(_decode(v, reader, cache) for v in node["__tuple__"])
    pairs = node.get("__dict__")
    if isinstance(pairs, list) and all(
        isinstance(p, list) and len(p) == 2 and _scalar(p[0]) for p in pairs
    ):
        return {k: _decode(v, reader, cache) for k, v in pairs}
    raise CheckpointError(
        f"{reader.root / MARKER}: an entry of 'tree' is damaged: {str(node)[:80]}"
    )


def save_tree(path: str | os.PathLike, tree: dict[str, Any], config: Any = None) -> None:
    """Save this process's nested state to the directory ``path``, atomically, with no pickle.

    ``tree`` holds dicts, lists, tuples, tensors (a DTensor: this rank's part) and JSON scalars.
    The tensors of ``tree["model"]`` (a state dict) go to ``model.safetensors`` under their own
    names, with ``config`` (a transformers config) beside them as ``config.json``; every other
    tensor goes to ``state.safetensors``; the structure and the scalars to the JSON marker. Every
    process saves its own ``path``: no collective.

    Example:
        >>> save_tree("run/state", {"model": model.state_dict(), "rng": torch.get_rng_state()})
        >>> load_tree("run/state")["rng"].dtype
        torch.uint8
    """
    path = Path(path)
    tmp = _sibling(path, _TMP)
    encoder = _TreeEncoder()
    if not isinstance(tree, dict) or not all(isinstance(k, str) for k in tree):
        raise CheckpointError("save_tree needs a dict with string keys")
    encoded = {k: encoder.encode(v, (k,)) for k, v in tree.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    _begin_save(path, tmp)
    for file, tensors in encoder.files.items():
        _save_file(tensors, tmp / file)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(tmp))
    _write_json(tmp / MARKER, {"format": TREE_FORMAT, "tree": encoded})
    _replace_dir(tmp, path)


def load_tree(path: str | os.PathLike) -> dict[str, Any]:
    """Load a state saved by :func:`save_tree` (JSON and safetensors only; DTensors come back as
    this rank's plain part: see :func:`dtensor_like`).

    Example:
        >>> state = load_tree("run/state")
        >>> model.load_state_dict(state["model"])
    """
    root, marker = _locate(Path(path))
    if marker["format"] != TREE_FORMAT:
        raise CheckpointError(
            f"{root} is a save_checkpoint checkpoint; load it with slapo.load_checkpoint"
        )
    tree = _field(marker, "tree", dict, root)
    with contextlib.ExitStack() as stack:
        reader, cache = _Reader(root, stack), {}
        return {k: _decode(v, reader, cache) for k, v in tree.items()}


def dtensor_like(value: Any, template: Any) -> Any:
    """``value`` (a plain tensor, this rank's part) as a DTensor laid out like ``template``;
    ``value`` itself when ``template`` is no DTensor or the local shapes differ.

    Example:
        >>> sd = {k: dtensor_like(v, live[k]) for k, v in load_tree(p)["model"].items()}
    """

    if not isinstance(template, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor) or value.shape != template.to_local().shape:
        return value
    return DTensor.from_local(
        value.to(template.device),
        template.device_mesh,
        template.placements,
        shape=template.shape,
        stride=template.stride(),
    )


# ----- export -----------------------------------------------------------------------------------
def export_safetensors(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write the full (gathered) model as one Hugging Face-loadable safetensors directory.

    Call on every rank; rank 0 writes ``model.safetensors`` (tied duplicates stored once) and, for
    a ``transformers`` model, ``config.json``, so ``AutoModel...from_pretrained(directory)`` loads
    it. The directory appears atomically.

    Example:
        >>> export_safetensors(model, "export/gpt2-tp2")
        >>> transformers.GPT2LMHeadModel.from_pretrained("export/gpt2-tp2")
    """
    directory = Path(directory)
    state = full_state_dict(model)
    aliases = _tied_aliases(model)

    def write() -> None:
        tmp = _sibling(directory, _TMP)
        _begin_save(directory, tmp)
        _save_file({k: v for k, v in state.items() if k not in aliases}, tmp / "model.safetensors")
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(str(tmp))
        _replace_dir(tmp, directory)

    _step(f"exporting {directory}", write if _rank() == 0 else None)

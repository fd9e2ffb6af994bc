"""The on-disk format: safetensors tensors and JSON metadata, read with no pickle anywhere.

A save_checkpoint directory holds ``model.safetensors`` (or ``model-0000i-of-0000N.safetensors``
and ``model.safetensors.index.json``), ``optimizer*.safetensors``, ``config.json`` for a
transformers model, and the completion marker ``slapo_checkpoint.json``. A save_tree directory
holds ``model.safetensors``/``state.safetensors`` and the marker, whose ``tree`` entry encodes the
nesting. Reading parses JSON (``json``) and safetensors headers (``safe_open``), nothing else.

Example:
    >>> import torch, slapo
    >>> slapo.save_checkpoint(torch.nn.Linear(2, 2), "ckpt")  # writes ckpt.tmp-slapo, renames it
    >>> read_marker(Path("ckpt"))["format"]
    'slapo-safetensors-v1'
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from ..exceptions import SlapoError

__all__ = [
    "FORMAT",
    "INDEX",
    "MARKER",
    "TREE_FORMAT",
    "CheckpointError",
    "Reader",
    "TreeEncoder",
    "decode_tree",
    "field",
    "fsync",
    "jsonable",
    "read_marker",
    "save_file",
    "write_json",
]

MARKER = "slapo_checkpoint.json"
FORMAT = "slapo-safetensors-v1"  # save_checkpoint
TREE_FORMAT = "slapo-tree-v1"  # save_tree (`slapo train --save` of a per-rank layout)
_LEGACY = ("slapo-dcp-v1",)  # torch.distributed.checkpoint, whose .metadata is a pickle
INDEX = "model.safetensors.index.json"
_ST_META = {"format": "pt"}  # transformers' from_pretrained checks it


class CheckpointError(SlapoError):
    """A checkpoint that is missing, incomplete, damaged, or does not match the model."""


# ----- writing ----------------------------------------------------------------------------------
def fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(file: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``file``, flushed to disk before returning.

    Example:
        >>> write_json(Path("train_state.json"), {"step": 3})
        >>> json.loads(Path("train_state.json").read_text())
        {'step': 3}
    """
    with open(file, "w", encoding="utf-8") as f:
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


def save_file(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """Write ``tensors`` to the safetensors ``file`` (with the metadata transformers expects).

    Example:
        >>> save_file({"w": torch.ones(2)}, Path("model.safetensors"))
    """
    # looked up at call time: a test makes it fail (a full disk) on one rank
    safetensors.torch.save_file(_unshared(tensors), str(file), metadata=_ST_META)
    fsync(file)


def jsonable(value: Any, where: str) -> Any:
    """``value`` as JSON (a one-element tensor as a number); ``where`` names it in the error.

    Example:
        >>> jsonable((0.9, 0.999), "betas")
        [0.9, 0.999]
    """
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [jsonable(v, where) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a JSON checkpoint cannot hold"
    )


# ----- reading ----------------------------------------------------------------------------------
def read_marker(root: Path) -> dict[str, Any]:
    """The marker of the checkpoint directory ``root``, checked to be one this Slapo reads.

    Example:
        >>> import slapo
        >>> slapo.save_checkpoint(torch.nn.Linear(2, 2), "ckpt")
        >>> read_marker(Path("ckpt"))["model_keys"]
        ['weight', 'bias']
    """
    file = root / MARKER
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
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


def field(marker: dict, name: str, kind: type, root: Path) -> Any:
    """``marker[name]``, which must be a ``kind``; a damaged marker raises."""
    value = marker.get(name)
    if not isinstance(value, kind):
        raise CheckpointError(
            f"{root / MARKER}: {name!r} is missing or not a {kind.__name__}: the marker is damaged"
        )
    return value


class Reader:
    """The opened safetensors files of one checkpoint directory (header parsing only).

    Example:
        >>> import slapo
        >>> slapo.save_checkpoint(torch.nn.Linear(32, 96), "ckpt")
        >>> with contextlib.ExitStack() as stack:
        ...     Reader(Path("ckpt"), stack).shape("model.safetensors", "weight")
        (96, 32)
    """

    def __init__(self, root: Path, stack: contextlib.ExitStack) -> None:
        self.root, self.stack = root, stack
        self.files: dict[str, tuple[Any, set[str]]] = {}

    def _open(self, name: Any) -> tuple[Any, set[str]]:
        if name not in self.files:
            # a file name from the marker: never a path out of the directory
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
        """The shape of tensor ``key`` of file ``name``, from the header alone."""
        return tuple(self._check(name, key).get_slice(key).get_shape())

    def get(self, name: str, key: str) -> torch.Tensor:
        """Tensor ``key`` of file ``name``."""
        handle = self._check(name, key)
        try:
            return handle.get_tensor(key)
        except SafetensorError as err:
            raise CheckpointError(f"reading {key!r} from {self.root / name}: {err}") from err


# ----- nested state (save_tree) -----------------------------------------------------------------
def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


class TreeEncoder:
    """Nested dicts/lists/tuples of tensors and JSON scalars -> JSON plus named tensors by file.

    The tensors of ``tree["model"]`` (a flat state dict) go to ``model.safetensors`` under their
    own names (``from_pretrained`` reads them), every other tensor to ``state.safetensors``.

    Example:
        >>> enc = TreeEncoder()
        >>> enc.encode({"w": torch.ones(2)}, ("model",))
        {'__dict__': [['w', {'__tensor__': 'w', 'file': 'model.safetensors'}]]}
    """

    def __init__(self) -> None:
        self.files: dict[str, dict[str, torch.Tensor]] = {}
        self.views: dict[tuple, dict[str, Any]] = {}

    def tensor(self, t: torch.Tensor, file: str, name: str) -> dict[str, Any]:
        """Store ``t`` (once per view: tied entries come back shared) and return its JSON ref."""
        node: dict[str, Any] = {}
        if isinstance(t, DTensor):  # this rank's part; dtensor_like rebuilds it on load
            t, node["dtensor"] = t.to_local(), True
        t = t.detach()
        storage = t.untyped_storage().data_ptr()
        view = (t.device, storage, t.storage_offset(), t.shape, t.stride(), t.dtype)
        if t.numel() and view in self.views:
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
        """The JSON of ``value``, found at the key path ``where``; its tensors are collected."""
        if isinstance(value, torch.Tensor):
            flat_model = len(where) == 2 and where[0] == "model" and isinstance(where[1], str)
            if flat_model:
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


def decode_tree(node: Any, reader: Reader, cache: dict[tuple, torch.Tensor]) -> Any:
    """The value :meth:`TreeEncoder.encode` encoded as ``node`` (tensors read by ``reader``).

    Example:
        >>> import slapo
        >>> slapo.save_checkpoint(torch.nn.Linear(2, 2), "ckpt")
        >>> with contextlib.ExitStack() as stack:
        ...     decode_tree({"__tuple__": [1, 2]}, Reader(Path("ckpt"), stack), {})
        (1, 2)
    """
    if isinstance(node, list):
        return [decode_tree(v, reader, cache) for v in node]
    if not isinstance(node, dict):
        return node
    if "__tensor__" in node:
        ref = (node.get("file"), node["__tensor__"])
        if ref not in cache:
            cache[ref] = reader.get(*ref)
        return cache[ref]
    if isinstance(node.get("__tuple__"), list):
        return tuple(decode_tree(v, reader, cache) for v in node["__tuple__"])
    pairs = node.get("__dict__")
    if isinstance(pairs, list) and all(
        isinstance(p, list) and len(p) == 2 and _scalar(p[0]) for p in pairs
    ):
        return {k: decode_tree(v, reader, cache) for k, v in pairs}
    raise CheckpointError(
        f"{reader.root / MARKER}: an entry of 'tree' is damaged: {str(node)[:80]}"
    )

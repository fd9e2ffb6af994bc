"""save_checkpoint / load_checkpoint / export_safetensors, and save_tree / load_tree.

Each rank contributes the full tensors it holds (:mod:`.layout`): gathered over tensor
parallelism, its stages' under a pipeline, written by data-parallel rank 0 only, a tied weight
once. The ranks agree on a plan (every tensor to one writing rank, the largest first to the
least-loaded) and each writes its own files into ``<path>.tmp-slapo``; rank 0 then writes the
marker and swaps the directory in (:mod:`.atomic`). Loading reads the full tensors and keeps this
rank's part, whatever layout saved them.

Example:
    >>> import torch
    >>> engine = torch.nn.Linear(4, 4)    # a pipeline engine's ranks each call it the same way
    >>> optimizer = torch.optim.AdamW(engine.parameters())
    >>> save_checkpoint(engine, "ckpt", optimizer)        # on every rank of a pipeline
    >>> model = torch.nn.Linear(4, 4)
    >>> load_checkpoint(model, "ckpt")                    # one process: the whole model
    >>> torch.equal(model.weight, engine.weight)
    True
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .atomic import TMP, begin_save, locate, replace_dir, sibling
from .format import (
    FORMAT,
    INDEX,
    MARKER,
    TREE_FORMAT,
    CheckpointError,
    Reader,
    TreeEncoder,
    decode_tree,
    field,
    save_file,
    write_json,
)
from .model_layout import (
    agree,
    all_gather_json,
    model_layout,
    rank,
    same_everywhere,
    world,
)
from .optim import optimizer_view

__all__ = [
    "dtensor_like",
    "export_safetensors",
    "load_checkpoint",
    "load_tree",
    "save_checkpoint",
    "save_tree",
]


# ----- the writing plan -------------------------------------------------------------------------
Entries = dict[str, list[list[Any]]]  # {stem: [[key, shape, dtype, bytes], ...]}


def _entries(groups: dict[str, dict[str, torch.Tensor]]) -> Entries:
    return {
        stem: [[k, list(v.shape), str(v.dtype), v.numel() * v.element_size()]
               for k, v in tensors.items()]
        for stem, tensors in groups.items()
    }  # fmt: skip


def _plan(everyone: list[dict[str, Any]], stem: str, path: Path) -> dict[str, tuple[int, str]]:
    """``{key: (writing rank, file name)}`` over every rank's entries: each tensor goes to one of
    the writing ranks that hold it, the largest first to the least-loaded; every rank computes
    the same plan from the same gathered entries."""
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    seen: dict[str, list[Any]] = {}
    for r, info in enumerate(everyone):
        for key, shape, dtype, size in info["entries"].get(stem, []):
            if seen.setdefault(key, [shape, dtype]) != [shape, dtype]:
                raise CheckpointError(
                    f"saving {path}: {key!r} is {seen[key]} on one rank and {[shape, dtype]} on "
                    f"rank {r}: the ranks hold different models"
                )
            sizes[key] = size
            if info["writes"]:
                holders.setdefault(key, []).append(r)
    unwritten = sorted(set(sizes) - set(holders))
    if unwritten:
        raise CheckpointError(
            f"saving {path}: no writing rank (data-parallel rank 0) holds {unwritten[:4]}"
        )
    load, owner = [0] * len(everyone), {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(holders[key], key=lambda r: (load[r], r))
        owner[key] = r
        load[r] += sizes[key]
    used = sorted(set(owner.values()))
    if len(used) == 1:
        names = {used[0]: f"{stem}.safetensors"}
    else:
        names = {r: f"{stem}-{i:05d}-of-{len(used):05d}.safetensors" for i, r in enumerate(used, 1)}
    return {key: (r, names[r]) for key, r in owner.items()}


def _in_order(keys: list[list[str]], order: list[str] | None) -> list[str]:
    """The union of ``keys`` (each rank's, in its order), in the whole model's ``order``."""
    merged = list(dict.fromkeys(k for ks in keys for k in ks))
    if order is None:
        return merged
    at = {k: i for i, k in enumerate(order)}
    return sorted(merged, key=lambda k: (at.get(k, len(at)), merged.index(k)))


def _merge_optimizer(metas: list[dict[str, Any]], order: list[str] | None) -> dict[str, Any]:
    """One optimizer entry from every rank's (pipeline ranks hold different parameters)."""
    first = metas[0]
    groups = []
    for i, group in enumerate(first["groups"]):
        names = [m["groups"][i]["params"] for m in metas if i < len(m["groups"])]
        groups.append({**group, "params": _in_order(names, order)})
    merged: dict[str, Any] = {"groups": groups}
    for entry in ("scalars", "tensors"):
        union = {k: v for m in metas for k, v in m[entry].items()}
        names = _in_order([list(m[entry]) for m in metas], order)
        merged[entry] = {k: union[k] for k in names}
    return merged


# ----- save / load a model ----------------------------------------------------------------------
def save_checkpoint(model: Any, path: str | os.PathLike, optimizer: Any = None) -> None:
    """Save ``model`` (and ``optimizer``) to the directory ``path``, atomically; call on every rank.

    ``model`` is a module (tensor parallel or not), a pipeline engine, a DDP module or a
    DeepSpeed engine; ``optimizer`` a torch optimizer or the one ``slapo.build`` returned.
    Tensors go to safetensors files at their full shapes under the user's model's names (a
    transformers model's directory loads with ``from_pretrained``), everything else to JSON;
    nothing is pickled. Every layout writes the same tensors and marker.

    Example:
        >>> import torch, slapo
        >>> model = torch.nn.Linear(4, 4)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> slapo.save_checkpoint(model, "ckpt/step100", optimizer)
        >>> other_layout_model = torch.nn.Linear(4, 4)    # e.g. built for another parallel layout
        >>> slapo.load_checkpoint(other_layout_model, "ckpt/step100")
    """
    path = Path(path)
    tmp = sibling(path, TMP)
    me = rank()
    layout = model_layout(model)
    state = layout.full_state()
    groups = {"model": {k: v for k, v in state.items() if k not in layout.aliases}}
    meta = None
    if optimizer is not None:
        groups["optimizer"], meta = optimizer_view(optimizer, layout).export()
    mine = {"writes": layout.writes, "entries": _entries(groups), "keys": list(state)}
    if meta is not None:
        mine["optimizer"] = meta
    if layout.uniform:  # every rank holds everything: a CRC says so without sending it
        same_everywhere([e[:3] for es in mine["entries"].values() for e in es], f"saving {path}")
        everyone = [mine] * world()
    else:
        everyone = all_gather_json(mine, f"saving {path}")
    plans = {stem: _plan(everyone, stem, path) for stem in groups}
    keys = _in_order([info["keys"] for info in everyone], layout.order)
    marker: dict[str, Any] = {
        "format": FORMAT,
        "model_keys": keys,
        "aliases": {k: v for k, v in layout.aliases.items() if k in set(keys)},
        "model_files": {k: f for k, (_, f) in plans["model"].items()},
    }
    if meta is not None:
        marker["optimizer"] = _merge_optimizer([i["optimizer"] for i in everyone], layout.order)
        marker["optimizer"]["files"] = {k: f for k, (_, f) in plans["optimizer"].items()}
    agree(f"preparing {tmp}", (lambda: begin_save(path, tmp)) if me == 0 else None)

    def write_mine() -> None:
        for stem, tensors in groups.items():
            by_file: dict[str, dict[str, torch.Tensor]] = {}
            for key, (owner, file) in plans[stem].items():
                if owner == me:
                    by_file.setdefault(file, {})[key] = tensors[key]
            for file, part in by_file.items():
                save_file(part, tmp / file)

    agree(f"writing the tensors of {path}", write_mine)

    def finish() -> None:
        files = sorted({f for plan in plans.values() for _, f in plan.values()})
        missing = [f for f in files if not (tmp / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{missing} did not appear in {tmp}: the ranks must share the file system of {path}"
            )
        if len(set(marker["model_files"].values())) > 1:  # Hugging Face's sharded layout
            total = sum(_sizes(everyone, "model").values())
            write_json(tmp / INDEX, {"metadata": {"total_size": total},
                                     "weight_map": marker["model_files"]})  # fmt: skip
        _save_config(layout.module, tmp)
        write_json(tmp / MARKER, marker)
        replace_dir(tmp, path)

    agree(f"completing {path}", finish if me == 0 else None)


def _sizes(everyone: list[dict[str, Any]], stem: str) -> dict[str, int]:
    return {e[0]: e[3] for info in everyone for e in info["entries"].get(stem, [])}


def _save_config(module: nn.Module | None, directory: Path) -> None:
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(directory))


def load_checkpoint(
    model: Any,
    path: str | os.PathLike,
    optimizer: Any = None,
    strict: bool = True,
) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model``, whatever its layout.

    Each rank reads the full tensors it holds and keeps its part (a TP slice, an FSDP shard, its
    pipeline stages). With ``strict``, tensors of this rank missing from the checkpoint are an
    error. Every shape is checked against the files' headers before anything is copied: a
    mismatch raises :class:`CheckpointError` naming the file, the keys and both shapes, and
    leaves the model as is.

    Example:
        >>> import torch, slapo
        >>> model = torch.nn.Linear(4, 4)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> slapo.save_checkpoint(model, "ckpt/step100", optimizer)
        >>> slapo.load_checkpoint(model, "ckpt/step100", optimizer)
    """
    path = Path(path)
    root, marker = locate(path)
    if marker["format"] != FORMAT:
        raise CheckpointError(
            f"{root} holds a `slapo train --save` state, not a save_checkpoint checkpoint; resume "
            "it with `slapo train --resume`"
        )
    saved = set(field(marker, "model_keys", list, root))
    files = field(marker, "model_files", dict, root)
    aliases = field(marker, "aliases", dict, root)
    layout = model_layout(model)
    own = layout.state()
    missing = [k for k in own if k not in saved]
    if missing and strict:
        raise CheckpointError(
            f"{root} has no entry for {missing[:8]} (of {len(missing)} missing); pass "
            "strict=False to keep those tensors as they are"
        )
    view = optimizer_view(optimizer, layout) if optimizer is not None else None
    meta = _optimizer_meta(root, marker, view) if view is not None else None
    with contextlib.ExitStack() as stack:
        reader = Reader(root, stack)
        sources, wrong = {}, []
        for k, t in own.items():
            if k not in saved:
                continue
            key = aliases.get(k, k)
            if key not in files:
                raise CheckpointError(f"{root / MARKER} names no file for {key!r}: it is damaged")
            expected = layout.full_shape(k, t)
            got = reader.shape(files[key], key)
            if got != expected:
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
                t = own[k]
                part = layout.local(k, t, reader.get(file, key))
                (t.to_local() if isinstance(t, DTensor) else t).copy_(part)
        if layout.after_load is not None:
            layout.after_load()
        if view is not None:
            assert meta is not None
            tensor_files = meta["files"]
            view.restore(meta, lambda key: reader.get(tensor_files[key], key))


def _optimizer_meta(root: Path, marker: dict, view: Any) -> dict:
    """The marker's optimizer entry, checked against the optimizer before anything loads."""
    meta = marker.get("optimizer")
    if meta is None:
        raise CheckpointError(f"{root} holds no optimizer state; load it without an optimizer")
    damaged = CheckpointError(f"{root / MARKER}: the optimizer entry is damaged")
    if not isinstance(meta, dict) or not all(
        isinstance(meta.get(k), t)
        for k, t in (("groups", list), ("scalars", dict), ("tensors", dict), ("files", dict))
    ):
        raise damaged
    names = view.names()
    if len(meta["groups"]) != len(names):
        raise CheckpointError(
            f"{root} has {len(meta['groups'])} optimizer param groups, the optimizer {len(names)}"
        )
    for saved, mine in zip(meta["groups"], names):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            raise damaged
        # a pipeline rank holds some of the saved parameters; every one it holds must be saved
        stray = [n for n in mine if n not in set(saved["params"])]
        if stray:
            raise CheckpointError(
                f"{root}: the optimizer state has no entry for parameters {stray[:8]} of the "
                "model; load it into the model it was saved from"
            )
    for per_param in meta["tensors"].values():
        if not isinstance(per_param, dict) or any(
            k not in meta["files"] for k in per_param.values()
        ):
            raise damaged
    return meta


# ----- one process's nested state (`slapo train --save` of a per-rank layout) -------------------
def save_tree(path: str | os.PathLike, tree: dict[str, Any], config: Any = None) -> None:
    """Save this process's nested state to the directory ``path``, atomically, with no pickle.

    ``tree`` holds dicts, lists, tuples, tensors (a DTensor: this rank's part) and JSON scalars.
    The tensors of ``tree["model"]`` (a state dict) go to ``model.safetensors`` under their own
    names, with ``config`` (a transformers config) beside them as ``config.json``; every other
    tensor goes to ``state.safetensors``; the structure and the scalars to the JSON marker. Every
    process saves its own ``path``: no collective.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> save_tree("run/state", {"model": model.state_dict(), "rng": torch.get_rng_state()})
        >>> load_tree("run/state")["rng"].dtype
        torch.uint8
    """
    path = Path(path)
    tmp = sibling(path, TMP)
    encoder = TreeEncoder()
    if not isinstance(tree, dict) or not all(isinstance(k, str) for k in tree):
        raise CheckpointError("save_tree needs a dict with string keys")
    encoded = {k: encoder.encode(v, (k,)) for k, v in tree.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    begin_save(path, tmp)
    for file, tensors in encoder.files.items():
        save_file(tensors, tmp / file)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(str(tmp))
    write_json(tmp / MARKER, {"format": TREE_FORMAT, "tree": encoded})
    replace_dir(tmp, path)


def load_tree(path: str | os.PathLike) -> dict[str, Any]:
    """Load a state saved by :func:`save_tree` (JSON and safetensors only; DTensors come back as
    this rank's plain part: see :func:`dtensor_like`).

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> save_tree("run/state", {"model": model.state_dict()})
        >>> state = load_tree("run/state")
        >>> model.load_state_dict(state["model"])
        <All keys matched successfully>
    """
    root, marker = locate(Path(path))
    if marker["format"] != TREE_FORMAT:
        raise CheckpointError(
            f"{root} is a save_checkpoint checkpoint; load it with slapo.load_checkpoint"
        )
    tree = field(marker, "tree", dict, root)
    with contextlib.ExitStack() as stack:
        reader, cache = Reader(root, stack), {}
        return {k: decode_tree(v, reader, cache) for k, v in tree.items()}


def dtensor_like(value: Any, template: Any) -> Any:
    """``value`` (a plain tensor, this rank's part) as a DTensor laid out like ``template``;
    ``value`` itself when ``template`` is no DTensor or the local shapes differ.

    Example:
        >>> model = torch.nn.Linear(4, 4)   # its tensors are DTensors once sharded (FSDP2)
        >>> save_tree("run/state", {"model": model.state_dict()})
        >>> live = model.state_dict()
        >>> sd = {k: dtensor_like(v, live[k]) for k, v in load_tree("run/state")["model"].items()}
        >>> type(sd["weight"]).__name__           # a plain template: the value itself
        'Tensor'
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
def export_safetensors(model: Any, directory: str | os.PathLike) -> None:
    """Write the full (gathered) model as one Hugging Face-loadable safetensors directory.

    Call on every rank; rank 0 writes ``model.safetensors`` (tied duplicates stored once) and, for
    a ``transformers`` model, ``config.json``, so ``AutoModel...from_pretrained(directory)`` loads
    it. The directory appears atomically. A pipeline engine's stages: use :func:`save_checkpoint`,
    whose files every rank writes.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64,
        ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
        >>> model = transformers.GPT2LMHeadModel(config)  # tensor parallel: each rank calls it
        >>> export_safetensors(model, "export/gpt2-tp2")
        >>> loaded = transformers.GPT2LMHeadModel.from_pretrained("export/gpt2-tp2")
        >>> torch.equal(loaded.lm_head.weight, model.lm_head.weight)
        True
    """
    directory = Path(directory)
    layout = model_layout(model)
    if not layout.uniform:
        raise CheckpointError(
            "export_safetensors needs the whole model on rank 0; a pipeline engine's ranks hold "
            "their stages: save_checkpoint writes the same Hugging Face directory from them all"
        )
    state = layout.full_state()

    def write() -> None:
        tmp = sibling(directory, TMP)
        begin_save(directory, tmp)
        stored = {k: v for k, v in state.items() if k not in layout.aliases}
        save_file(stored, tmp / "model.safetensors")
        _save_config(layout.module, tmp)
        replace_dir(tmp, directory)

    agree(f"exporting {directory}", write if rank() == 0 else None)

"""Layout mapping: which tensors a rank holds, and how a full tensor maps onto its shard.

A checkpoint stores every tensor once, at its full shape, under the state-dict name of the
user's model. :func:`model_layout` describes how one rank holds such a model:

* a module (eager, or tensor parallel): every tensor, TP-sharded ones as this rank's slice
  (their ``ShardSpec``), FSDP2 ones as DTensors; DDP and a DeepSpeed ZeRO engine hold their
  ``module``;
* a pipeline engine (anything with ``stage_modules``): only its stages' tensors, under the
  user's names; a weight tied across stages is stored once, under the name the whole model
  stores it by; only data-parallel rank 0 of each replica group (``dp_rank``) writes;
* a RoundPipe model (anything with ``optim_named_parameters``): the user's model it wraps holds
  the weights; its optimizer steps RoundPipe's own copies of them, which stand for the
  parameters of the same names (:attr:`ModelLayout.optim_names`) and follow loaded weights
  (:attr:`ModelLayout.after_load`).

The ranks agree on who writes what through :func:`all_gather_json` (JSON in byte tensors:
torch's object collectives pickle, and a checkpoint load must never unpickle).

Example:
    >>> import torch
    >>> engine = torch.nn.Linear(2, 2)          # a plain module; a pipeline rank's engine alike
    >>> layout = model_layout(engine)
    >>> sorted(layout.state())                  # this rank's tensors under the model's names
    ['bias', 'weight']
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..sharding.collectives import run_collective
from ..sharding.spec import ShardSpec, get_shard_spec
from .format import CheckpointError

__all__ = [
    "ENGINE_MASTERS",
    "ModelLayout",
    "agree",
    "holds_layout",
    "all_gather_json",
    "all_reduce_max",
    "full_state_dict",
    "model_layout",
    "rank",
    "same_everywhere",
    "world",
]

#: ``add(engine, layout)`` for an engine whose optimizer holds the master weights (DeepSpeed
#: ZeRO's float32 partitions under bf16/fp16): puts them in ``layout.masters``. :mod:`.optim`
#: registers ZeRO's (it builds on this module, which therefore does not import it).
ENGINE_MASTERS: list[Callable[[Any, ModelLayout], None]] = []


# ----- ranks ------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if _distributed() else 0


def world() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if _distributed() else 1


def _device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def all_reduce_max(values: list[int], what: str) -> list[int]:
    """Element-wise max of ``values`` over every rank (bounded by the group's timeout).

    Example:
        >>> all_reduce_max([rank()], "the last rank")   # one process; [1] on 2 ranks
        [0]
    """
    if not _distributed():
        return values
    t = torch.tensor(values, dtype=torch.int64, device=_device())
    run_collective(f"all_reduce ({what})", None, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX))
    return t.tolist()


def all_gather_json(value: Any, what: str) -> list[Any]:
    """Every rank's JSON-able ``value``, by rank: encoded as UTF-8 bytes in tensors, so that no
    rank unpickles what another sent (``all_gather_object`` would).

    Example:
        >>> all_gather_json({"keys": ["a"]}, "the keys")   # one process: one entry per rank
        [{'keys': ['a']}]
    """
    if not _distributed():
        return [value]
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    n = world()
    (longest,) = all_reduce_max([data.numel()], what)
    buf = torch.zeros(longest + 8, dtype=torch.uint8, device=_device())
    buf[:8] = torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8)
    buf[8 : 8 + data.numel()] = data.to(buf.device)
    out = [torch.empty_like(buf) for _ in range(n)]
    run_collective(f"all_gather ({what})", None, lambda: dist.all_gather(out, buf))
    values = []
    for t in out:
        t = t.cpu()
        size = int(t[:8].view(torch.int64).item())
        values.append(json.loads(bytes(t[8 : 8 + size].tolist()).decode()))
    return values


def agree(what: str, fn: Callable[[], None] | None) -> None:
    """Run ``fn`` here (None: nothing), then agree over every rank that each one succeeded.

    A rank whose step raised does not leave the others waiting at a barrier: all of them raise.

    Example:
        >>> from pathlib import Path
        >>> from slapo.checkpoints.format import save_file
        >>> mine, tmp = {"w": torch.ones(2)}, Path(".")
        >>> agree("writing ckpt", lambda: save_file(mine, tmp / "model.safetensors"))
    """
    error: BaseException | None = None
    if fn is not None:
        try:
            fn()
        except Exception as err:  # reported to the peers, then re-raised below
            error = err
    (failed,) = all_reduce_max([int(error is not None)], what)
    if isinstance(error, CheckpointError):
        raise error
    if error is not None:
        raise CheckpointError(f"{what} failed on rank {rank()}: {error}") from error
    if failed:
        raise CheckpointError(f"{what} failed on another rank (its own error says why)")


def same_everywhere(entries: list[Any], what: str) -> None:
    """Raise unless every rank holds the same ``entries`` (compared by CRC).

    Example:
        >>> same_everywhere([["w", [4, 2], "torch.float32"]], "saving ckpt")
    """
    crc = zlib.crc32(json.dumps(entries).encode())
    top, neg = all_reduce_max([crc, -crc], what)
    if top != crc or -neg != crc:
        raise CheckpointError(
            f"{what}: the ranks hold different tensor names or shapes; save_checkpoint needs the "
            "same (tensor-parallel) model on every rank"
        )


# ----- one rank's view of a model ---------------------------------------------------------------
@dataclass
class ModelLayout:
    """How this rank holds a model, in the user's state-dict names.

    Attributes:
        modules: the modules holding this rank's tensors (pipeline stages, or the model).
        module: the user's model when known (its config goes beside the weights).
        order: the user's model's state-dict names in order, when known.
        aliases: ``{duplicate name: stored name}`` for tied entries, across stages too.
        writes: this rank writes its share (data-parallel rank 0 of a pipeline replica).
        uniform: every rank holds every tensor (no pipeline stages).
        optim_names: ``{id(tensor): stored name}`` for tensors an optimizer steps in place of
            the parameter of that name (RoundPipe's optimizer copies).
        after_load: called once loaded weights are in the modules (the optimizer copies
            follow them); None: nothing to do.
        masters: ``{name: tensor}`` stored and loaded in place of the module's tensor of that
            name: the float32 master weight of a model that computes in a lower precision
            (RoundPipe's optimizer copy under ``precision="bf16"``), so that a checkpoint keeps
            what the optimizer steps and a resume loses no bits.
    """

    modules: list[nn.Module]
    module: nn.Module | None
    order: list[str] | None
    aliases: dict[str, str]
    writes: bool = True
    uniform: bool = True
    optim_names: dict[int, str] = field(default_factory=dict)
    after_load: Callable[[], None] | None = None
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    _specs: dict[str, ShardSpec] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name, tensor in self.named_tensors():
            spec = get_shard_spec(tensor)
            if spec is not None:  # parameters, and buffers cut with them (BatchNorm statistics)
                self._specs[name] = spec

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter and buffer of this rank, under each of its names."""
        for mod in self.modules:
            yield from mod.named_parameters(remove_duplicate=False)
            yield from mod.named_buffers(remove_duplicate=False)

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's state dict (live tensors), only the user's names when those are known."""
        out: dict[str, torch.Tensor] = {}
        for mod in self.modules:
            for name, t in mod.state_dict(keep_vars=True).items():
                out.setdefault(name, t)
        if self.order is not None:
            known = set(self.order)
            out = {k: v for k, v in out.items() if k in known}
        out.update({k: v for k, v in self.masters.items() if k in out})
        return out

    def parameters(self) -> dict[int, str]:
        """``{id(parameter): stored name}`` for this rank's parameters (ties: the stored name)."""
        names: dict[int, str] = dict(self.optim_names)
        for mod in self.modules:
            for name, p in mod.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), self.aliases.get(name, name))
        return names

    def full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The full tensor of this rank's ``t`` (collective over its FSDP and TP groups: an
        FSDP2 shard of a tensor-parallel slice is gathered over both, in that order)."""
        if isinstance(t, DTensor):
            t = t.full_tensor()
        spec = self._specs.get(name)
        if spec is not None:
            return spec.gather(t).detach()
        return t.detach()

    def full_state(self) -> dict[str, torch.Tensor]:
        """This rank's state dict at full shapes (collective over its TP/FSDP groups)."""
        gathered: dict[int, torch.Tensor] = {}  # tied parameters are gathered once
        out = {}
        for name, t in self.state().items():
            if id(t) not in gathered:
                gathered[id(t)] = self.full(name, t)
            out[name] = gathered[id(t)]
        return out

    def full_shape(self, name: str, t: torch.Tensor) -> tuple[int, ...]:
        """The shape the checkpoint stores ``t`` at."""
        spec = self._specs.get(name)
        return tuple(spec.full_shape) if spec is not None else tuple(t.shape)

    def local(self, name: str, t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` for its tensor ``t`` (a plain tensor, ``t``'s local
        shape): a TP slice, an FSDP shard, or ``full`` itself."""
        spec = self._specs.get(name)
        part = spec.local_slice(full) if spec is not None else full
        if isinstance(t, DTensor):
            # every rank has read the full tensor: cut locally, no scatter
            part = distribute_tensor(part, t.device_mesh, t.placements, src_data_rank=None)
            return part.to_local()
        return part

    def spec(self, name: str) -> ShardSpec | None:
        """The tensor-parallel spec of ``name`` (None when whole on this rank)."""
        return self._specs.get(name)


def tied_aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{duplicate name: first name}`` for entries of ``state`` that are one tensor."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in state.items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def _whole_model(engine: Any) -> nn.Module | None:
    """A pipeline engine's whole (user's) model: its names and ties are the checkpoint's."""
    model = getattr(engine, "model", None)
    return model if isinstance(model, nn.Module) else None


def _is_roundpipe(model: Any) -> bool:
    return callable(getattr(model, "optim_named_parameters", None)) and isinstance(
        getattr(model, "model", None), nn.Module
    )


def holds_layout(engine: Any) -> bool:
    """Whether ``engine`` (what ``slapo.build`` returned) holds its model in a layout of its own,
    which a checkpoint must read from it rather than from the schedule's module: a pipeline
    engine's stages, DeepSpeed's ZeRO partitions, RoundPipe's optimizer copies.

    Example:
        >>> holds_layout(nn.Linear(2, 2))
        False
    """
    return (
        hasattr(engine, "stage_modules")
        or hasattr(engine, "zero_optimization_stage")
        or _is_roundpipe(engine)
    )


def _roundpipe_layout(engine: Any) -> ModelLayout:
    """A RoundPipe model: the weights are the wrapped user's model's (in host memory, updated
    once pending steps finish); the optimizer steps RoundPipe's copies, by the same names."""
    engine.synchronize()  # every launched step's values are in the model's parameters
    module = engine.model
    state = module.state_dict(keep_vars=True)
    aliases = tied_aliases(state)
    params = dict(module.named_parameters())
    pairs = []
    names: dict[int, str] = {}
    masters: dict[str, torch.Tensor] = {}
    for name, copy in engine.optim_named_parameters():
        names[id(copy)] = aliases.get(name, name)
        pairs.append((params[name], copy))
        if copy.dtype != params[name].dtype:  # mixed precision: the copy is the master weight
            masters[name] = copy

    def refresh() -> None:
        engine.synchronize()  # no step may copy older values back over the loaded weights
        with torch.no_grad():
            for param, copy in pairs:
                if copy.dtype != param.dtype:  # the master was loaded: the model follows it
                    param.copy_(copy)
                else:
                    copy.copy_(param)

    return ModelLayout(
        [module], module, None, aliases, optim_names=names, after_load=refresh, masters=masters
    )


def model_layout(model: Any) -> ModelLayout:
    """This rank's :class:`ModelLayout` of ``model``: a module, a DDP module, a DeepSpeed engine,
    a pipeline engine (``stage_modules``, ``dp_rank``) or a RoundPipe model.

    Example:
        >>> model_layout(nn.Linear(2, 2)).uniform    # every rank holds the whole module
        True
        >>> # illustration: a pipeline engine (slapo.build(sch, target="pipeline") under
        >>> # torchrun, one rank per stage); not run here
        >>> import slapo
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> sch = slapo.create_schedule(model)
        >>> sch["0"].cut_pipeline_stage()
        >>> engine, _ = slapo.build(sch, target="pipeline")  # doctest: +SKIP
        >>> model_layout(engine).uniform    # each rank holds its stages  # doctest: +SKIP
        False
    """
    stages = getattr(model, "stage_modules", None)
    if isinstance(stages, dict):
        whole = _whole_model(model)
        order = list(whole.state_dict(keep_vars=True)) if whole is not None else None
        # a stage's replicas may share gradients through DDP: its names are the module's
        ddp = nn.parallel.DistributedDataParallel
        mods = [m.module if isinstance(m, ddp) else m for m in stages.values()]
        local = {}
        for mod in mods:
            for k, v in mod.state_dict(keep_vars=True).items():
                local.setdefault(k, v)
        aliases = tied_aliases(whole.state_dict(keep_vars=True) if whole else local)
        writes = int(getattr(model, "dp_rank", 0) or 0) == 0
        layout = ModelLayout(mods, whole, order, aliases, writes=writes, uniform=False)
        # FSDP2 replicas hold DTensors, which carry no tensor-parallel spec: the engine kept them
        specs = getattr(model, "shard_specs", None) or {}
        layout._specs.update({k: v for k, v in specs.items() if v is not None})
        return layout
    if _is_roundpipe(model):
        return _roundpipe_layout(model)
    engine = model if hasattr(model, "zero_optimization_stage") else None
    if engine is not None or isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if not isinstance(model, nn.Module):
        raise CheckpointError(
            f"save/load_checkpoint takes a module or an engine slapo.build returned, got "
            f"{type(model).__name__}"
        )
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise CheckpointError(
            "a DeepSpeed ZeRO-3 model's parameters are partitioned; save it under ZeRO 1 or 2"
        )
    state = model.state_dict(keep_vars=True)
    layout = ModelLayout([model], model, None, tied_aliases(state))
    if engine is not None:  # bf16/fp16: the checkpoint keeps ZeRO's float32 master weights
        for add_masters in ENGINE_MASTERS:
            add_masters(engine, layout)
    return layout


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every sharded tensor gathered to its full shape (collective).

    Example:
        >>> model = nn.Linear(2, 2)   # tensor-parallel: every rank of its group calls it
        >>> full = full_state_dict(model)
        >>> sorted(full), full["weight"].shape
        (['bias', 'weight'], torch.Size([2, 2]))
    """
    return model_layout(model).full_state()

"""Optimizer state by parameter name, whatever holds it.

Saved: each parameter's state tensors at their full shape as ``<name>/<key>`` (``exp_avg``,
``exp_avg_sq``, ``step`` ...), non-tensor state and the param groups' options in JSON, the
groups' parameters by name. Two holders are read and written:

* a torch optimizer over the (tensor-parallel, FSDP or pipeline-stage) parameters: its state is
  laid out like the parameter, so it is gathered and sliced like the parameter;
* DeepSpeed's ZeRO 1/2 optimizer: the torch optimizer steps flat fp32 partitions, one per param
  group and data-parallel rank; each parameter's fragment of them is found through the
  ``_hp_mapping`` DeepSpeed links every parameter with, and the fragments are summed over the
  data-parallel group into the full tensor (DeepSpeed's ``safe_get_full_optimizer_state`` does
  the same, once the state exists).

Example:
    >>> import torch
    >>> from slapo.checkpoints.model_layout import model_layout
    >>> model = torch.nn.Linear(2, 2)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    >>> view = optimizer_view(optimizer, model_layout(model))
    >>> tensors, meta = view.export()        # collective: every rank calls it
    >>> tensors, meta["groups"][0]["params"]   # SGD without momentum keeps no state
    ({}, ['weight', 'bias'])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .format import CheckpointError, jsonable
from .model_layout import ENGINE_MASTERS, ModelLayout

__all__ = ["OptimizerView", "TorchOptimizerView", "ZeroOptimizerView", "optimizer_view"]

Read = Callable[[str], torch.Tensor]  # reads a saved tensor by its key


def _hyper(group: dict[str, Any], i: int) -> dict[str, Any]:
    where = "optimizer.param_groups[{}][{!r}]"
    return {k: jsonable(v, where.format(i, k)) for k, v in group.items() if k != "params"}


def _set_hyper(group: dict[str, Any], saved: dict[str, Any]) -> None:
    for k, v in saved.items():
        if k != "params" and k in group:
            group[k] = tuple(v) if isinstance(group[k], tuple) else v


class OptimizerView:
    """An optimizer's state as full tensors by parameter name: :meth:`export` and
    :meth:`restore` (both collective where the state is sharded)."""

    def export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``({"<name>/<key>": full tensor}, meta)``; meta holds ``groups`` (options and
        ``params`` names), ``scalars`` and ``tensors`` (``{name: {key: tensor key}}``)."""
        raise NotImplementedError

    def names(self) -> list[list[str]]:
        """The stored names of each param group's parameters on this rank."""
        raise NotImplementedError

    def restore(self, meta: dict[str, Any], read: Read) -> None:
        """Load the state ``meta`` describes (tensors by ``read``) into this rank's optimizer."""
        raise NotImplementedError


class TorchOptimizerView(OptimizerView):
    """A torch optimizer over this rank's parameters (state laid out like the parameter).

    Example:
        >>> from slapo.checkpoints.model_layout import model_layout
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.01)
        >>> TorchOptimizerView(opt, model_layout(model)).export()[1]["groups"][0]["lr"]
        0.01
    """

    def __init__(self, optimizer: torch.optim.Optimizer, layout: ModelLayout) -> None:
        self.optimizer, self.layout = optimizer, layout
        self.by_id = layout.parameters()
        for i, group in enumerate(optimizer.param_groups):
            strays = [p for p in group["params"] if id(p) not in self.by_id]
            if strays:
                raise CheckpointError(
                    f"optimizer.param_groups[{i}] holds {len(strays)} tensor(s) that are not "
                    "parameters of the model; save the optimizer of this model"
                )

    def names(self) -> list[list[str]]:
        return [[self.by_id[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]

    def export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {"groups": [], "scalars": {}, "tensors": {}}
        for i, (group, names) in enumerate(zip(self.optimizer.param_groups, self.names())):
            meta["groups"].append({**_hyper(group, i), "params": names})
            for p, name in zip(group["params"], names):
                for key, value in self.optimizer.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        where = f"optimizer state {key!r} of {name}"
                        meta["scalars"].setdefault(name, {})[key] = jsonable(value, where)
                        continue
                    # exp_avg & co. are laid out like the parameter: gathered like it
                    full = self.layout.full(name, value) if value.shape == p.shape else value
                    tensors[f"{name}/{key}"] = full.detach()
                    meta["tensors"].setdefault(name, {})[key] = f"{name}/{key}"
        return tensors, meta

    def restore(self, meta: dict[str, Any], read: Read) -> None:
        from torch.distributed.tensor import DTensor

        for group, saved, names in zip(self.optimizer.param_groups, meta["groups"], self.names()):
            _set_hyper(group, saved)
            for p, name in zip(group["params"], names):
                state: dict[str, Any] = {}
                for key, tensor_key in meta["tensors"].get(name, {}).items():
                    value = read(tensor_key)
                    if tuple(value.shape) == self.layout.full_shape(name, p) and p.dim():
                        value = self.layout.local(name, p, value)
                        if isinstance(p, DTensor):  # FSDP2: the state is a DTensor like p
                            value = DTensor.from_local(
                                value.to(p.device), p.device_mesh, p.placements,
                                shape=p.shape, stride=p.stride(),
                            )  # fmt: skip
                    state[key] = value if key == "step" else value.to(p.device)
                state.update(meta["scalars"].get(name, {}))
                if state:
                    self.optimizer.state[p] = state


class ZeroOptimizerView(OptimizerView):
    """DeepSpeed's ZeRO stage 1/2 optimizer (``DeepSpeedZeroOptimizer``) of a replicated model.

    Example:
        >>> # illustration: needs deepspeed and a job under its launcher; not run here
        >>> import slapo
        >>> from slapo.checkpoints.model_layout import model_layout
        >>> sch = slapo.create_schedule(torch.nn.Linear(2, 2))
        >>> engine, _ = slapo.build(sch, target="deepspeed", zero_stage=1)  # doctest: +SKIP
        >>> ZeroOptimizerView(engine.optimizer, model_layout(engine)).export()  # doctest: +SKIP
    """

    def __init__(self, zero: Any, layout: ModelLayout) -> None:
        self.zero, self.layout = zero, layout
        self.base = zero.optimizer  # the torch optimizer stepping the flat fp32 partitions
        names = layout.parameters()
        self.groups: list[list[tuple[str, torch.nn.Parameter]]] = []
        for i, params in enumerate(zero.bit16_groups):
            strays = [p for p in params if id(p) not in names]
            if strays:
                raise CheckpointError(
                    f"DeepSpeed's param group {i} holds {len(strays)} tensor(s) that are not "
                    "parameters of the model; save the optimizer of this model"
                )
            self.groups.append([(names[id(p)], p) for p in params])

    def names(self) -> list[list[str]]:
        return [[n for n, _ in g] for g in self.groups]

    def _flat(self, i: int) -> torch.Tensor:
        return self.zero.single_partition_of_fp32_groups[i]

    def _gather(self, i: int, p: torch.nn.Parameter, flat_value: torch.Tensor) -> torch.Tensor:
        """The full tensor of ``p`` from its fragment of ``flat_value`` on each rank (a sum:
        the fragments do not overlap)."""
        buf = torch.zeros(p.numel(), dtype=flat_value.dtype, device=flat_value.device)
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None:
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            buf.narrow(0, lp.start, lp.numel).copy_(flat_value.narrow(0, hp.start, hp.numel))
        dist.all_reduce(buf, group=self.zero.real_dp_process_group[i])
        return buf.view(p.shape)

    @staticmethod
    def _scatter(p: torch.nn.Parameter, full: torch.Tensor, flat_value: torch.Tensor) -> None:
        """Copy this rank's fragment of the full tensor of ``p`` into ``flat_value``."""
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None:
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            part = full.reshape(-1).narrow(0, lp.start, lp.numel)
            flat_value.narrow(0, hp.start, hp.numel).copy_(part)

    def export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {"groups": [], "scalars": {}, "tensors": {}}
        for i, (group, params) in enumerate(zip(self.base.param_groups, self.groups)):
            meta["groups"].append({**_hyper(group, i), "params": [n for n, _ in params]})
            flat = self._flat(i)
            state = self.base.state.get(flat, {})
            for name, p in params:
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor):
                        where = f"optimizer state {key!r} of {name}"
                        meta["scalars"].setdefault(name, {})[key] = jsonable(value, where)
                        continue
                    # per-element state (exp_avg ...) is partitioned; the rest (step) is whole
                    full = self._gather(i, p, value) if value.shape == flat.shape else value
                    tensors[f"{name}/{key}"] = full.detach().clone()
                    meta["tensors"].setdefault(name, {})[key] = f"{name}/{key}"
        return tensors, meta

    def restore(self, meta: dict[str, Any], read: Read) -> None:
        for i, (group, saved, params) in enumerate(
            zip(self.base.param_groups, meta["groups"], self.groups)
        ):
            _set_hyper(group, saved)
            flat = self._flat(i)
            with torch.no_grad():
                for name, p in params:  # the fp32 master copy follows the loaded weights
                    if name not in self.layout.masters:  # else it was loaded itself
                        self._scatter(p, p.detach().float(), flat.data)
            state = self.base.state[flat]
            for name, p in params:
                for key, tensor_key in meta["tensors"].get(name, {}).items():
                    value = read(tensor_key)
                    if tuple(value.shape) == tuple(p.shape) and p.dim():
                        if key not in state:  # before the first step: DeepSpeed has none yet
                            state[key] = torch.zeros_like(flat, dtype=value.dtype)
                        self._scatter(p, value.to(flat.device), state[key])
                    else:
                        state[key] = value.clone()
                state.update(meta["scalars"].get(name, {}))


def optimizer_view(optimizer: Any, layout: ModelLayout) -> OptimizerView:
    """The :class:`OptimizerView` of ``optimizer``: a torch optimizer, or what the
    ``"deepspeed"`` target returns (its ``optimizer`` is DeepSpeed's).

    Example:
        >>> from slapo.checkpoints.model_layout import model_layout
        >>> engine = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.AdamW(engine.parameters())
        >>> optimizer_view(opt, model_layout(engine)).names()[0]   # group 0's parameter names
        ['weight', 'bias']
    """
    inner = getattr(optimizer, "optimizer", None) if hasattr(optimizer, "engine") else None
    if inner is None and hasattr(optimizer, "single_partition_of_fp32_groups"):
        inner = optimizer  # DeepSpeed's ZeRO optimizer itself
    if inner is not None:
        if hasattr(inner, "single_partition_of_fp32_groups") and hasattr(inner, "bit16_groups"):
            return ZeroOptimizerView(inner, layout)
        if isinstance(inner, torch.optim.Optimizer):  # ZeRO 0: DeepSpeed steps it as it is
            return TorchOptimizerView(inner, layout)
        raise CheckpointError(
            f"cannot read the state of DeepSpeed's {type(inner).__name__} (ZeRO-3 or mixed "
            "precision wrappers are not supported); use ZeRO 0, 1 or 2 in fp32"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(
            f"save/load_checkpoint takes a torch optimizer, got {type(optimizer).__name__}"
        )
    return TorchOptimizerView(optimizer, layout)


def zero_masters(engine: Any, layout: ModelLayout) -> None:
    """Under DeepSpeed's bf16/fp16 the module holds low-precision weights and ZeRO's flat fp32
    partitions are the master weights: put each parameter's full master (gathered over the
    data-parallel group: collective) in ``layout.masters``, so that a checkpoint stores it, and
    make ``layout.after_load`` scatter loaded masters back into the partitions and the module.

    Example:
        >>> from slapo.checkpoints.model_layout import model_layout
        >>> engine = torch.nn.Linear(2, 2)         # a DeepSpeed ZeRO engine in a real job
        >>> layout = model_layout(engine); zero_masters(engine, layout)  # every rank
        >>> layout.after_load is None              # no ZeRO optimizer: nothing registered
        True
    """
    zero = getattr(engine, "optimizer", None)
    if not (hasattr(zero, "single_partition_of_fp32_groups") and hasattr(zero, "bit16_groups")):
        return
    view = ZeroOptimizerView(zero, layout)
    pairs = [
        (i, name, p)
        for i, params in enumerate(view.groups)
        for name, p in params
        if p.dtype != torch.float32
    ]
    for i, name, p in pairs:
        layout.masters[name] = view._gather(i, p, view._flat(i).detach())

    def scatter_loaded() -> None:
        with torch.no_grad():
            for i, name, p in pairs:
                master = layout.masters[name]
                view._scatter(p, master, view._flat(i).data)
                p.copy_(master)

    layout.after_load = scatter_loaded


ENGINE_MASTERS.append(zero_masters)

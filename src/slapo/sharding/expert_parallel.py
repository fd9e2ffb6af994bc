"""Expert parallelism (EP) for transformers MoE models.

:func:`expert_parallel` replaces the ``experts`` module of every MoE block with an
:class:`ExpertParallelExperts` that keeps only this rank's experts (sliced from the fused 3-D
expert weights transformers 5.x uses) and reaches the others through the
all-to-all dispatcher of :mod:`.expert_dispatch`. The block itself (its router, Mixtral's jitter,
Qwen2-MoE's shared expert, DeepSeek-V3's group-limited router and shared experts) is untouched,
so the routing and the router's load-balancing loss are exactly those of the original model.

Each local expert parameter carries a :class:`~slapo.sharding.spec.ShardSpec` (axis 0, the
group's size and rank, the full fused shape), the same record tensor parallelism leaves on its
slices: :mod:`slapo.checkpoints` then stores every expert tensor once, at its full shape under
its original name, and loads a full checkpoint onto any expert-parallel size (each rank keeps
its experts). Code that syncs the gradients of *replicated* parameters skips it, as EP needs.

EP borrows its ranks from data parallelism: each rank of the group trains on its own batch. An
expert's gradient is then the sum over every rank's tokens, on its owner; the other parameters'
gradients cover this rank's batch only. :func:`all_reduce_replicated_grads` turns both into the
gradient of the mean loss over all ranks' batches, as data parallelism would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..exceptions import SlapoError
from .expert_dispatch import dispatch_combine
from .groups import describe_group, group_rank, require_initialized, resolve_group
from .spec import SPEC_ATTR, ShardSpec

__all__ = [
    "ExpertParallelError",
    "ExpertParallelExperts",
    "all_reduce_replicated_grads",
    "expert_parallel",
    "is_expert_parameter",
]


class ExpertParallelError(SlapoError, ValueError):
    """A model or group that expert parallelism cannot apply to (an unsupported MoE block, an
    expert count not divisible by the group size)."""


def _swiglu_expert(m: nn.Module, j: int, rows: torch.Tensor) -> torch.Tensor:
    # Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V3: gate_up_proj (E, 2I, H) = [gate; up],
    # down_proj (E, H, I); the routing weights are applied by the dispatcher.
    gate, up = nn.functional.linear(rows, m.gate_up_proj[j]).chunk(2, dim=-1)
    return nn.functional.linear(m.act_fn(gate) * up, m.down_proj[j])


def _gpt_oss_expert(m: nn.Module, j: int, rows: torch.Tensor) -> torch.Tensor:
    # GPT-OSS: transposed weights with biases, gate and up interleaved, clamped SwiGLU.
    gate_up = rows @ m.gate_up_proj[j] + m.gate_up_proj_bias[j]
    gate = gate_up[..., ::2].clamp(max=m.limit)
    up = gate_up[..., 1::2].clamp(min=-m.limit, max=m.limit)
    glu = gate * torch.sigmoid(gate * m.alpha)
    return ((up + 1) * glu) @ m.down_proj[j] + m.down_proj_bias[j]


@dataclass(frozen=True)
class _Layout:
    """How one experts class stores its experts: fused parameters whose dim 0 is the expert, the
    plain attributes its math reads, and the math of one expert on its rows."""

    params: tuple[str, ...]
    attrs: tuple[str, ...]
    expert: Callable[[nn.Module, int, torch.Tensor], torch.Tensor]


_SWIGLU = _Layout(("gate_up_proj", "down_proj"), ("act_fn",), _swiglu_expert)
LAYOUTS: dict[str, _Layout] = {
    "Qwen3MoeExperts": _SWIGLU,
    "MixtralExperts": _SWIGLU,
    "Qwen2MoeExperts": _SWIGLU,
    # Same math and signature; its router (sigmoid scores, correction bias, group-limited
    # top-k, scaling) stays in DeepseekV3MoE, which passes the chosen ids and weights here.
    "DeepseekV3Experts": _SWIGLU,
    "GptOssExperts": _Layout(
        ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
        ("alpha", "limit"),
        _gpt_oss_expert,
    ),
}


class ExpertParallelExperts(nn.Module):
    """This rank's slice of a fused experts module; same call signature as the original
    (``hidden (N, H), top_k_index (N, K), top_k_weights (N, K) -> (N, H)``).

    Parameters keep the original names (e.g. ``gate_up_proj``, ``down_proj``) with the expert
    dimension cut to the ``num_local`` experts starting at global id ``first``; each carries a
    ``ShardSpec`` (axis 0 over ``group``, the full fused shape) so that checkpoints store it whole.
    """

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup | None, rank: int, ep: int):
        super().__init__()
        self.layout = LAYOUTS[type(experts).__name__]
        self.num_experts = experts.num_experts
        self.num_local = self.num_experts // ep
        self.first = rank * self.num_local
        self.group = group
        for attr in self.layout.attrs:
            setattr(self, attr, getattr(experts, attr))
        local = slice(self.first, self.first + self.num_local)
        for name in self.layout.params:
            # Own copies, so the full tensors can be freed with the original module.
            full = getattr(experts, name)
            param = nn.Parameter(full.detach()[local].clone(), requires_grad=full.requires_grad)
            spec = ShardSpec(
                axis=0,
                world=ep,
                rank=rank,
                full_shape=tuple(full.shape),
                padded=self.num_experts,
                group=group,
            )
            setattr(param, SPEC_ATTR, spec)
            self.register_parameter(name, param)

    def _expert(self, j: int, rows: torch.Tensor) -> torch.Tensor:
        return self.layout.expert(self, j, rows)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return dispatch_combine(
            hidden_states, top_k_index, top_k_weights, self.num_experts, self._expert, self.group
        )

    def extra_repr(self) -> str:
        last = self.first + self.num_local - 1
        return f"experts {self.first}..{last} of {self.num_experts}"


def expert_parallel(model: nn.Module, group: Any = None) -> nn.Module:
    """Split every MoE block's experts of ``model`` over ``group`` (in place; returns ``model``).

    ``group``: None (the world), a ``ProcessGroup`` or a 1-D ``DeviceMesh``. Every rank must hold
    the same weights before the call (e.g. the same seed or checkpoint), or load a checkpoint
    after it (``slapo.load_checkpoint`` gives each rank its experts). Supported: the fused
    experts of Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V3 (their shared experts stay replicated)
    and GPT-OSS;
    another MoE block (a module with an ``experts`` child) raises :class:`ExpertParallelError`
    naming it.

    Example (each rank, after ``slapo.env.setup``)::

        model = transformers.Qwen3MoeForCausalLM(config)
        expert_parallel(model, group)
        model(**my_batch).loss.backward()
        all_reduce_replicated_grads(model, group)
    """
    require_initialized("expert_parallel")
    pg = resolve_group(group, "expert_parallel")
    rank, ep = group_rank(pg, "expert_parallel"), dist.get_world_size(pg)
    blocks = [(name, mod) for name, mod in model.named_modules() if _has_experts(mod)]
    for name, block in blocks:  # validate all before changing any
        _check_block(name, block, ep, pg)
    for _, block in blocks:
        block.experts = ExpertParallelExperts(block.experts, pg, rank, ep)
    return model


def is_expert_parameter(model: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of ``model`` is a local expert weight (not replicated)."""
    owner = model.get_submodule(name.rpartition(".")[0])
    return isinstance(owner, ExpertParallelExperts)


def all_reduce_replicated_grads(
    model: nn.Module, group: Any = None, scale_expert_grads: bool = True
) -> None:
    """Turn the ranks' gradients into those of the mean loss over all ranks' batches, as data
    parallelism does: average every replicated (non-expert) gradient over ``group``, and divide
    the local experts' gradients by the group size without communicating (their owner already
    received the gradients of every rank's tokens, summed). ``scale_expert_grads=False`` leaves
    the expert gradients alone (the sum of the ranks' losses).

    One flat all-reduce; a parameter without a gradient on this rank counts as zero, so ranks that
    disagree on which parameters have gradients still agree on the buffer.

    Example (each rank, its own batch)::

        model(**my_batch).loss.backward()
        all_reduce_replicated_grads(model, group)
        optimizer.step()
    """
    pg = resolve_group(group, "all_reduce_replicated_grads")
    ep = dist.get_world_size(pg)
    params = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not is_expert_parameter(model, name):
            params.append(p)
        elif scale_expert_grads and p.grad is not None:
            p.grad.div_(ep)
    if not params:
        return
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )
    dist.all_reduce(flat, group=pg)
    flat /= ep
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def _has_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.Module)


def _check_block(name: str, block: nn.Module, ep: int, pg: dist.ProcessGroup | None) -> None:
    experts = block.experts
    kind = type(experts).__name__
    where = f'"{name}.experts"' if name else '"experts"'
    if isinstance(experts, ExpertParallelExperts):
        raise ExpertParallelError(f"{where} is already expert-parallel; apply it once")
    if kind not in LAYOUTS:
        raise ExpertParallelError(
            f"{where} ({kind}, in {type(block).__name__}) is an MoE experts module expert "
            f"parallelism does not support; supported: {', '.join(LAYOUTS)}"
        )
    if experts.num_experts % ep:
        raise ExpertParallelError(
            f"{where} has {experts.num_experts} experts, not divisible by the expert-parallel "
            f"group size {ep} (group {describe_group(pg)}); use a group size that divides "
            f"{experts.num_experts}"
        )

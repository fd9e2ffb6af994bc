"""The per-stage table logged when a pipeline is built: parameters, memory, layers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["StageInfo", "stage_table", "format_table"]

# fp32 weight + gradient + two Adam moments: the training state a stage holds per parameter.
BYTES_PER_PARAM = 16


@dataclass
class StageInfo:
    """What one stage holds."""

    stage: int
    rank: int
    params: int
    memory_mib: float
    layers: list[str]


def stage_table(
    stages: Sequence[nn.Module], blocks: Sequence[str], stage_to_rank: Sequence[int]
) -> list[StageInfo]:
    """Describe each stage; ``layers`` names the blocks (and other modules) it runs.

    Example:
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> gpt2 = transformers.GPT2LMHeadModel(config)
        >>> ids = torch.zeros(2, 8, dtype=torch.long)
        >>> from slapo.pipeline.partition import partition_model
        >>> part = partition_model(gpt2, ["transformer.h.0"], (ids[:1],), {"use_cache": False})
        >>> stage_modules = part.stages
        >>> [s.layers for s in stage_table(stage_modules, ["transformer.h.0", "transformer.h.1"],
        ...                                 [0, 1])]
        [['transformer.wte', 'transformer.wpe', 'transformer.h.0'], ['transformer.h.1', ...]]
    """
    rows = []
    for i, stage in enumerate(stages):
        params = {id(p): p for p in stage.parameters()}.values()
        count = sum(p.numel() for p in params)
        rows.append(
            StageInfo(
                i, stage_to_rank[i], count, count * BYTES_PER_PARAM / 2**20, _layers(stage, blocks)
            )
        )
    return rows


def _layers(stage: nn.Module, blocks: Sequence[str]) -> list[str]:
    layers: list[str] = []
    for name, _ in stage.named_parameters():
        owner = name.rpartition(".")[0]
        layer = next((b for b in blocks if owner == b or owner.startswith(b + ".")), owner)
        if layer not in layers:
            layers.append(layer)
    return layers


def format_table(rows: Sequence[StageInfo]) -> str:
    """The table as text, one line per stage."""
    lines = [f"{'stage':>5} {'rank':>4} {'params':>12} {'memory (MiB)':>13}  layers"]
    for r in rows:
        lines.append(
            f"{r.stage:>5} {r.rank:>4} {r.params:>12,} {r.memory_mib:>13.1f}  {_compact(r.layers)}"
        )
    return "\n".join(lines)


def _compact(layers: list[str]) -> str:
    return ", ".join(layers) if len(layers) <= 6 else ", ".join(layers[:3] + ["..."] + layers[-2:])

"""Mixed-precision steps measured beside their estimate: autocast (eager, DDP) and FSDP2's
``MixedPrecisionPolicy``, built here as the targets build them, measured with
:class:`slapo.train.run_memory.PeakMemory` (parameter, gradient and optimizer-state storages, the
most bytes saved for backward alive at once, and the engine's own buffers).

Spawned gloo jobs (:func:`data_parallel_bf16`) and an in-process helper (:func:`measure`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from layout_jobs import _storage_bytes, make_batch
from layout_jobs import make_model as make_gpt2
from torch import nn

import slapo
from slapo.precision import Precision
from slapo.train.run_memory import PeakMemory

BF16 = Precision.of("bf16")
Forward = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def make_llama() -> nn.Module:
    """A small Llama (no dropout, untied head) whose activations weigh about its parameters."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=88, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).train()


MODELS = {"gpt2": make_gpt2, "llama": make_llama}


def measure(model: Any, batch: dict[str, torch.Tensor], forward: Forward) -> dict[str, int]:
    """Two AdamW steps of ``model`` (the second starts with the optimizer state there), counted
    by ``PeakMemory``; the parts read from the model and optimizer after the last backward."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with PeakMemory(model, opt) as mem:
        for _ in range(2):
            forward(batch).backward()
            held = [p.grad for p in model.parameters() if p.grad is not None]
            grads, grad_dtype = _storage_bytes(held), str(held[0].dtype)
            opt.step()
            opt.zero_grad(set_to_none=True)
            mem.next_step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": _storage_bytes(model.parameters()), "grads": grads,
        "optimizer_state": sum(_storage_bytes([v]) for v in state),
        "activations": round(mem.activation_mb * 2**20), "engine": sum(mem.engine_parts.values()),
        "peak": round(mem.peak_mb * 2**20), "grad_dtype": grad_dtype,
    }  # fmt: skip


def autocast_forward(model: nn.Module, precision: Precision = BF16) -> Forward:
    """The forward as the eager and DDP targets run it in mixed precision: under autocast."""

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with precision.autocast("cpu"):
            return model(**batch).loss

    return forward


def plain_forward(model: nn.Module) -> Forward:
    return lambda batch: model(**batch).loss


def _fsdp(sch: Any) -> nn.Module:
    """FSDP2 as the fsdp target shards: every block, then the root, in bf16 with fp32 reduce."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from slapo.targets.common import default_blocks

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for path in default_blocks(sch):
        fully_shard(sch.mod.get_submodule(path), mp_policy=policy)
    return fully_shard(sch.mod, mp_policy=policy)


def data_parallel_bf16(rank: int, world: int) -> dict[str, Any]:
    """Per model and engine (DDP under autocast; FSDP2 with a bf16 policy): this rank's bf16
    estimate and the measurement of two steps on its slice of the batch."""
    out = {}
    batch = make_batch(seed=rank)
    for family, make in MODELS.items():
        for target in ("ddp", "fsdp"):
            sch = slapo.create_schedule(make())
            est, fp32 = (
                slapo.estimate_layout(
                    sch, batch, target=target, dp=world, rank=rank, precision=precision,
                    optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3},
                )
                for precision in ("bf16", "fp32")
            )  # fmt: skip
            if target == "ddp":
                model = nn.parallel.DistributedDataParallel(sch.mod)
                forward = autocast_forward(model)
            else:
                model = _fsdp(sch)
                forward = plain_forward(model)
            real = measure(model, batch, forward)
            parts = ("params", "grads", "optimizer_state", "activations", "engine", "peak")
            out[f"{family}/{target}"] = {
                "est": {k: getattr(est, k) for k in parts}, "real": real,
                "engine_parts": dict(est.engine_parts), "fp32_activations": fp32.activations,
            }  # fmt: skip
    return out

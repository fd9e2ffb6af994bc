"""The step-time model against runs others published (issue 37): predictions, with their errors.

torchtitan's Llama 3.1 8B results (docs/performance.md, end of 2024): H100 96 GB HBM2e at a
500 W limit, 8 per host on NVLink, 400 Gb/s RDMA per GPU between hosts; bf16 (FSDP2 mixed
precision, float32 reduce), selective (per-op) activation checkpointing of every block, AdamW,
sequence 8192, local batch 2. Memory is torchtitan's logged ``max_reserved``.

One device preset and the default achievable fractions (their sources in
``slapo.plan.hardware``); nothing is fitted per row. The model is fake-stepped whole (all 32
layers: about 6 s per layout on 2 cores), built once on the meta device.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

from slapo.plan.hardware import PRESETS, ClusterSpec
from slapo.plan.step_time import predict_step

transformers = pytest.importorskip("transformers")

GiB = 2**30

#: (name, GPUs, torch.compile, published tokens/s/GPU, published memory GiB)
TORCHTITAN_LLAMA3_8B = [
    ("fsdp 8", 8, False, 5762, 82.4),
    ("fsdp 8 compile", 8, True, 6667, 77.0),
    ("fsdp 128", 128, False, 5605, 67.0),
    ("fsdp 128 compile", 128, True, 6514, 62.0),
]
MEMORY_TOLERANCE = 0.10  # the bar
THROUGHPUT_TOLERANCE = 0.20

#: The aten ops torchtitan's per-op selective checkpointing saves (``_save_list``, late 2024):
#: matmuls (every other one: the rest recomputed) and attention kernels (ours on the CPU too).
_SAVED = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


#: The matmuls of one Llama block's forward (q, k, v, o; gate, up, down).
MATMULS_PER_BLOCK = 7


def torchtitan_op_sac() -> Any:
    """A block's policy as torchtitan's ``selective_ac_option="op"``: save the listed ops'
    outputs, except every second matmul. torchtitan counts matmuls afresh in each forward and
    each recompute of the block; this policy lives across calls, so it counts within a call
    (modulo the block's :data:`MATMULS_PER_BLOCK`)."""
    from torch.utils.checkpoint import CheckpointPolicy

    counts: collections.Counter = collections.Counter()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = "recompute" if ctx.is_recompute else "forward"
        mm = op == torch.ops.aten.mm.default
        if mm:
            counts[key] += 1
        nth = (counts[key] - 1) % MATMULS_PER_BLOCK + 1  # this call's count
        save = op in _SAVED and not (mm and nth % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@pytest.fixture(scope="module")
def llama3_8b() -> Any:
    """Llama 3.1 8B on the meta device, every block checkpointed as torchtitan does."""
    from slapo.initialization import init_empty_weights
    from slapo.model_schedule import apply_schedule

    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(cfg)
    sch = apply_schedule(model, ckpt_ratio=0.0)
    for i in range(cfg.num_hidden_layers):
        sch[f"model.layers.{i}"].checkpoint(policy=torchtitan_op_sac())
    return sch


@pytest.fixture(scope="module")
def predictions(llama3_8b: Any) -> dict[tuple[int, bool], Any]:
    ids = torch.zeros(2, 8192, dtype=torch.long)  # local batch 2, sequence 8192
    batch = {"input_ids": ids, "labels": ids}
    cluster = ClusterSpec(
        PRESETS["h100-96gb-hbm2e-500w"], gpus_per_node=8,
        inter_node_gbps=50.0,  # 400 Gb/s RDMA per GPU
        inter_node_latency_us=10.0,
    )  # fmt: skip
    out = {}
    for gpus in (8, 128):
        for compiled in (False, True):
            out[(gpus, compiled)] = predict_step(
                llama3_8b, batch, cluster, target="fsdp", dp=gpus, precision="bf16",
                compile=compiled,
            )  # fmt: skip
    return out


#: Rows the model misses, and the term it misses (module doc of slapo.plan.step_time; not fitted).
MEMORY_MISS = (
    "about 17 GiB that does not shrink with the FSDP degree (8 GPUs: 65.2 predicted vs 82.4; "
    "128: 50.2 vs 67.0) is not in the memory estimate: what torchtitan's max_reserved holds "
    "beyond the step's tensors (caching-allocator fragmentation around the 8 GiB float32 "
    "loss tensors, FSDP2's float32 reduce-scatter buffers), not modelled by slapo.memory"
)
THROUGHPUT_MISS = (
    "the model hides FSDP's inter-node collectives entirely behind compute, so it predicts 128 "
    "GPUs no slower than 8; the published runs lose 3% (communication kernels slow compute); "
    "with the 500 W cap also unmodelled this compiled row lands just past 20%"
)


def _row(row: tuple, miss: str | None) -> Any:
    if miss is None:
        return pytest.param(*row, id=row[0])
    return pytest.param(*row, id=row[0], marks=pytest.mark.xfail(strict=True, reason=miss))


def _predicted(
    predictions: dict, name: str, gpus: int, compiled: bool, tokens: float, memory: float
) -> tuple[Any, float, float]:
    pred = predictions[(gpus, compiled)]
    mem_err = pred.memory_bytes / GiB / memory - 1
    tok_err = pred.tokens_per_s_per_gpu / tokens - 1
    print(
        f"\n{name}: tokens/s/GPU {pred.tokens_per_s_per_gpu:,.0f} vs {tokens:,} ({tok_err:+.1%}); "
        f"memory {pred.memory_bytes / GiB:.1f} vs {memory} GiB ({mem_err:+.1%}); "
        f"MFU {pred.mfu:.1%}\n{pred}"
    )
    return pred, mem_err, tok_err


@pytest.mark.parametrize(
    ("name", "gpus", "compiled", "tokens", "memory"),
    [_row(r, MEMORY_MISS) for r in TORCHTITAN_LLAMA3_8B],
)
def test_torchtitan_llama3_8b_memory(
    predictions: dict, name: str, gpus: int, compiled: bool, tokens: float, memory: float
) -> None:
    _, mem_err, _ = _predicted(predictions, name, gpus, compiled, tokens, memory)
    assert abs(mem_err) <= MEMORY_TOLERANCE, f"{name}: memory {mem_err:+.1%}"


@pytest.mark.parametrize(
    ("name", "gpus", "compiled", "tokens", "memory"),
    [
        _row(r, THROUGHPUT_MISS if r[0] == "fsdp 128 compile" else None)
        for r in TORCHTITAN_LLAMA3_8B
    ],
)
def test_torchtitan_llama3_8b_tokens_per_s(
    predictions: dict, name: str, gpus: int, compiled: bool, tokens: float, memory: float
) -> None:
    _, _, tok_err = _predicted(predictions, name, gpus, compiled, tokens, memory)
    assert abs(tok_err) <= THROUGHPUT_TOLERANCE, f"{name}: tokens/s/GPU {tok_err:+.1%}"

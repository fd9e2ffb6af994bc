"""On a GPU: the live peak of the estimate against the CUDA allocator's peak of a real step.

Skipped without CUDA (`scripts/gpu-check.sh` runs it on a GPU machine). The allocator rounds
each block up (512 bytes) and keeps a cuBLAS workspace, taken before the measured step here; the
model is large enough for both to stay small next to its activations.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import slapo
from slapo.model_schedule import apply_schedule

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("knobs", [{}, {"ckpt_ratio": 1.0}], ids=["plain", "checkpointed"])
def test_live_peak_matches_the_cuda_allocator(knobs):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
        use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).cuda().train()
    sch = apply_schedule(model, attn_op="sdpa", **knobs)
    ids = torch.randint(0, 1024, (8, 512), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    est = slapo.estimate_memory(sch, batch, optimizer=opt)
    assert est.device == "cuda"

    def step() -> None:
        slapo.train_step(model, batch)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer state and the cuBLAS workspace exist from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    predicted = est.live_peak - est.params - est.buffers - est.optimizer_state
    print(f"CUDA step peak: measured {measured:,} B, estimated {predicted:,} B")
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)

"""On a GPU: the mask-free chunked causal attention of context parallelism (CUDA's
memory-efficient kernel, its LSE padded to a multiple of 32 queries) equals plain SDPA with the
dense causal mask of the chunks' global positions: output and q/k/v gradients, float32 and bf16.

Skipped without CUDA (`scripts/gpu-check.sh` runs it on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch

from context_attention_oracle import NAMES, check_bfloat16, dense, run
from slapo.sharding.context_kernels import chunked_causal_attention

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (query chunks, chunks in the sequence, chunk length): cp 2 and cp 4 ranks; lengths below, at
# and above one 32-query LSE block, and not a multiple of it
CASES = [((0, 3), 4, 5), ((1, 2), 4, 40), ((0, 7), 8, 32), ((2, 5), 8, 70)]


def inputs(chunks, n_chunks, length, dtype, kv_heads=2):
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, 4, len(chunks) * length, 64), (2, kv_heads, n_chunks * length, 64)]
    q = torch.randn(shapes[0], generator=g, device="cuda")
    k, v = (torch.randn(shapes[1], generator=g, device="cuda") for _ in range(2))
    grad = torch.randn(q.shape, generator=g, device="cuda")
    return [t.to(dtype).requires_grad_(True) for t in (q, k, v)], grad.to(dtype)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("chunks,n_chunks,length", CASES)
def test_float32_equals_dense_sdpa(chunks, n_chunks, length, kv_heads):
    qkv, grad = inputs(chunks, n_chunks, length, torch.float32, kv_heads)
    got = run(chunked_causal_attention, qkv, grad, chunks, 0.125)
    want = run(dense, qkv, grad, chunks, 0.125)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # TF32 may be on for the dense path's matmuls: a little looser than float32 defaults
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("chunks,n_chunks,length", CASES)
def test_bfloat16_equals_dense_sdpa(chunks, n_chunks, length):
    """bf16 in, bf16 out: against the float32 reference on the same inputs, ours errs at most 2x
    the dense bf16 path + 1e-2 (the same rule as the CPU test)."""
    qkv, grad = inputs(chunks, n_chunks, length, torch.bfloat16)
    got, bf16, _ = check_bfloat16(qkv, grad, chunks)
    for name, a, b in zip(NAMES, got, bf16):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")

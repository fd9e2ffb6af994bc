"""The mask-free chunked causal attention of context parallelism, in one process: output and
q/k/v gradients equal plain SDPA with the dense causal mask of the chunks' global positions.
"""

from __future__ import annotations

import pytest
import torch

from context_attention_oracle import NAMES, check_bfloat16, dense, run
from slapo.sharding.context_kernels import chunked_causal_attention
from slapo.sharding.context_layout import ContextParallelError, local_chunks

# (chunk indices, number of chunks in the sequence): every rank of cp 2 and cp 4, and one chunk
LAYOUTS = [(local_chunks(r, w), 2 * w) for w in (2, 4) for r in range(w)] + [((0,), 1)]


def inputs(chunks, n_chunks, heads=4, kv_heads=2, length=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, len(chunks) * length, 16, generator=g)
    k = torch.randn(2, kv_heads, n_chunks * length, 16, generator=g)
    v = torch.randn(2, kv_heads, n_chunks * length, 16, generator=g)
    grad = torch.randn(q.shape, generator=g)
    return [t.to(dtype).requires_grad_(True) for t in (q, k, v)], grad.to(dtype)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("chunks,n_chunks", LAYOUTS, ids=[str(c) for c, _ in LAYOUTS])
def test_float32_equals_dense_sdpa(chunks, n_chunks, kv_heads):
    qkv, grad = inputs(chunks, n_chunks, kv_heads=kv_heads)
    got = run(chunked_causal_attention, qkv, grad, chunks, 0.3)
    want = run(dense, qkv, grad, chunks, 0.3)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("chunks,n_chunks", [((0, 3), 4), ((1, 6), 8)], ids=["cp2-r0", "cp4-r1"])
def test_bfloat16_equals_dense_sdpa(chunks, n_chunks):
    """bf16 in, bf16 out (LSEs and the merge in float32). Tolerance: both bf16 paths against the
    float32 reference on the same inputs; ours may err at most 2x the dense bf16 path + 1e-2
    (each part's output rounds to bf16 before the merge, and dk/dv of up to 4 parts add up)."""
    qkv, grad = inputs(chunks, n_chunks, dtype=torch.bfloat16)
    got, _, ref = check_bfloat16(qkv, grad, chunks)
    for name, a, r in zip(NAMES, got, ref):
        torch.testing.assert_close(a.float(), r, rtol=2e-2, atol=4e-2, msg=name)


def test_autocast_runs_in_bfloat16():
    """Under autocast, as SDPA: float32 in, bf16 out; gradients back in float32."""
    qkv, grad = inputs((1, 2), 4, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(chunked_causal_attention, qkv, grad, (1, 2))
        want = run(dense, qkv, grad, (1, 2))
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=4e-2, msg=name)


def test_sensitive_to_the_chunk_layout():
    """The oracle can fail: the same queries placed at other chunks give another output."""
    qkv, grad = inputs((1, 2), 4)
    got = chunked_causal_attention(*qkv, (1, 2))
    assert not torch.allclose(got, dense(*qkv, (0, 3)))


def test_saves_no_quadratic_bytes():
    """What the backward keeps is linear: q, the un-repeated k/v, the output and its LSE."""
    qkv, _ = inputs((1, 6), 8, heads=4, kv_heads=1, length=64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunked_causal_attention(*qkv, (1, 6))
    q, k, _ = qkv
    # q + out (4 heads x 128 x 16), k + v (1 head x 512 x 16), lse (4 x 128), all float32
    expected = (2 * q.numel() + 2 * k.numel() + q.numel() // 16) * 4
    assert sum(t.untyped_storage().nbytes() for t in saved) == expected


def test_runs_on_fake_tensors():
    """The memory estimator runs the step on fake tensors: forward and backward need no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qkv, grad = inputs((0, 3), 4, dtype=torch.bfloat16)
        out, dq, dk, dv = run(chunked_causal_attention, qkv, grad, (0, 3))
    assert out.shape == qkv[0].shape and out.dtype == torch.bfloat16
    assert (dq.shape, dk.shape, dv.shape) == tuple(t.shape for t in qkv)


def test_bad_layouts_are_typed_errors():
    (q, k, v), _ = inputs((0, 3), 4)
    with pytest.raises(ContextParallelError, match="do not split into 3 equal chunks"):
        chunked_causal_attention(q, k, v, (0, 1, 3))
    with pytest.raises(ContextParallelError, match="reach past the 20 keys"):
        chunked_causal_attention(q, k, v, (0, 4))
    with pytest.raises(ContextParallelError, match="3 key and 3 value heads"):
        kv3 = torch.randn(2, 3, 20, 16)
        chunked_causal_attention(q, kv3, kv3, (0, 3))
    with pytest.raises(ContextParallelError, match="share one dtype"):
        chunked_causal_attention(q, k.double(), v, (0, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_plumbing_on_meta(monkeypatch, dtype):
    """The CUDA path (memory-efficient kernel, its LSE padded to 32 queries) runs forward and
    backward on meta tensors here; tests/cuda/test_context_kernels_cuda.py checks its values."""
    import slapo.sharding.context_kernels as kernels

    monkeypatch.setattr(kernels, "_efficient", lambda q: True)
    q = torch.empty(2, 4, 80, 64, device="meta", dtype=dtype, requires_grad=True)
    k = torch.empty(2, 2, 320, 64, device="meta", dtype=dtype, requires_grad=True)
    out = chunked_causal_attention(q, k, k, (1, 6))
    dq, dk = torch.autograd.grad(out, (q, k), torch.empty_like(out))
    assert (out.shape, out.dtype) == (q.shape, dtype)
    assert (dq.shape, dk.shape, dk.dtype) == (q.shape, k.shape, dtype)

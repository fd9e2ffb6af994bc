"""The oracle of the mask-free context-parallel attention tests (CPU: tests/sharding, CUDA:
tests/cuda): plain SDPA with the dense causal mask of the query chunks' global positions, and
the bf16 rule."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slapo.sharding.context_kernels import chunked_causal_attention

NAMES = ("out", "dq", "dk", "dv")


def dense(q, k, v, chunks, scale=None):
    """Plain SDPA with the dense causal mask of the chunks' global positions."""
    length, seq = q.shape[2] // len(chunks), k.shape[2]
    pos = torch.cat([torch.arange(length, device=q.device) + c * length for c in chunks])
    mask = pos[:, None] >= torch.arange(seq, device=q.device)[None, :]
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def run(fn, qkv, grad, *args):
    """The output of ``fn(*qkv, *args)`` and the gradients of q, k, v for ``grad``."""
    out = fn(*qkv, *args)
    return (out, *torch.autograd.grad(out, qkv, grad))


def check_bfloat16(qkv, grad, chunks):
    """bf16 in, bf16 out; against the float32 reference on the same inputs, ours errs at most 2x
    the dense bf16 path + 1e-2 (each part's output rounds to bf16 before the merge, and dk/dv of
    up to 4 parts add up). Returns (ours, dense bf16, float32 reference) for further checks."""
    got = run(chunked_causal_attention, qkv, grad, chunks)
    assert all(t.dtype == torch.bfloat16 for t in got)
    bf16 = run(dense, qkv, grad, chunks)
    ref_qkv = [t.detach().float().requires_grad_(True) for t in qkv]
    ref = run(dense, ref_qkv, grad.float(), chunks)
    for name, a, b, r in zip(NAMES, got, bf16, ref):
        ours, theirs = (a.float() - r).abs().max(), (b.float() - r).abs().max()
        assert ours <= 2 * theirs + 1e-2, f"{name}: error {ours} vs dense bf16 {theirs}"
    return got, bf16, ref

"""Mask-free causal attention of load-balanced query chunks against the whole (gathered) sequence.

Context parallelism gives a rank query chunks of length ``L`` at global chunk indices ``c`` and
the keys and values of every chunk, in global order. Under a causal mask, the queries of chunk
``c`` see the keys ``[0, c*L)`` whole (the *prefix*) and the keys ``[c*L, (c+1)*L)`` causally
(the *diagonal* block, square, so a plain ``is_causal`` kernel fits it). Each part runs a fused
attention kernel that returns its output and log-sum-exp, and the parts merge by their LSEs (as
ring attention does), so no (queries x keys) mask is ever built and the memory kept for backward
stays linear in the sequence: the queries, the gathered keys and values, the merged output and
its float32 LSE.

The backward runs each part's kernel backward with the *merged* output and LSE: the kernel then
computes the part's probabilities with the global normalizer, which are exactly the part's share
of the full softmax, so the parts' dq sum and their dk/dv land at the parts' key positions.

Kernels: ``_scaled_dot_product_flash_attention_for_cpu`` on CPU,
``_scaled_dot_product_efficient_attention`` on CUDA (its LSE is padded along the queries to a
multiple of 32). Both have fake/meta kernels, so the memory estimator runs this code as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .context_layout import ContextParallelError

__all__ = ["chunked_causal_attention", "ChunkedCausalAttention"]

_aten = torch.ops.aten


def _efficient(q: torch.Tensor) -> bool:
    """Whether ``q``'s device runs the memory-efficient kernel (CUDA) rather than CPU flash."""
    return q.device.type == "cuda"


def _part_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One fused attention part: ``(out, lse (B, H, Lq) float32, what its backward needs)``."""
    if _efficient(q):
        out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]], (lse, seed, offset)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _part_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    extra: tuple,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One part's (dq, dk, dv), from the merged ``out`` and ``lse`` of its queries."""
    if _efficient(q):
        padded, seed, offset = extra
        full = padded.clone()  # the kernel reads the padded length; keep its padding values
        full[..., : q.shape[2]] = lse
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, None, out, full, seed, offset, 0.0, [True, True, True, False],
            causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``heads / t.shape[1]`` query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _parts(chunk: int, length: int) -> list[tuple[int, int, bool]]:
    """The key ranges ``(start, stop, causal)`` that the queries of global chunk ``chunk`` see."""
    prefix = [(0, chunk * length, False)] if chunk > 0 else []
    return [*prefix, (chunk * length, (chunk + 1) * length, True)]


def _gather_key_grads(
    parts: list[tuple[int, torch.Tensor]], shape: torch.Size, length: int
) -> torch.Tensor:
    """The gradient of all ``shape[2]`` keys, float32, from the parts' gradients ``(first key,
    grad)``: per key chunk the sum of the parts that saw it (zero where none did). Built by
    concatenation rather than ``+=`` into slices of a zero tensor: the memory estimator's fake
    step counted each such in-place add as a new whole-tensor storage (an over-estimate)."""
    pieces = []
    for lo in range(0, shape[2], length):
        seen = [g[:, :, lo - a : lo - a + length].float() for a, g in parts
                if a <= lo and lo + length <= a + g.shape[2]]  # fmt: skip
        if not seen:
            ref = parts[0][1]
            seen = [ref.new_zeros((*shape[:2], length, shape[3]), dtype=torch.float32)]
        pieces.append(sum(seen[1:], seen[0]))
    return torch.cat(pieces, dim=2)


class ChunkedCausalAttention(torch.autograd.Function):
    """Causal attention of query chunks at global chunk indices ``chunks`` against every key.

    ``query`` is (B, H, n*L, D): ``n = len(chunks)`` chunks of length ``L``, in the order of
    ``chunks``; ``key`` and ``value`` are (B, Hkv, S, D), the whole sequence in global order
    (``Hkv`` divides ``H``: grouped-query attention; they are saved un-repeated). Returns
    (B, H, n*L, D) in the query's dtype.
    """

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        chunks: tuple[int, ...],
        scale: float | None,
    ) -> torch.Tensor:
        length = query.shape[2] // len(chunks)
        heads = query.shape[1]
        k, v = _repeat_heads(key, heads), _repeat_heads(value, heads)
        outs, lses, extras = [], [], []
        for i, chunk in enumerate(chunks):
            q = query[:, :, i * length : (i + 1) * length]
            parts = [_part_forward(q, k[:, :, a:b], v[:, :, a:b], c, scale) for a, b, c in
                     _parts(chunk, length)]  # fmt: skip
            extras.append([extra for _, _, extra in parts])
            if len(parts) == 1:
                out, lse, _ = parts[0]
            else:  # merge in float32 by the log-sum-exps
                lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
                out = sum(p[0].float() * (p[1] - lse).exp()[..., None] for p in parts)
                out = out.to(query.dtype)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.chunks, ctx.scale, ctx.extras = chunks, scale, extras
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        length, heads = query.shape[2] // len(ctx.chunks), query.shape[1]
        k, v = _repeat_heads(key, heads), _repeat_heads(value, heads)
        k_shape, v_shape = k.shape, v.shape
        grad = grad.contiguous()
        dq = torch.empty_like(query)
        key_grads: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (first key, dk, dv)
        for i, chunk in enumerate(ctx.chunks):
            rows = slice(i * length, (i + 1) * length)
            q, g = query[:, :, rows], grad[:, :, rows]
            o, m = out[:, :, rows], lse[:, :, rows]
            dq_chunk = None
            for (a, b, causal), extra in zip(_parts(chunk, length), ctx.extras[i]):
                dq_p, dk_p, dv_p = _part_backward(
                    g, q, k[:, :, a:b], v[:, :, a:b], o, m, extra, causal, ctx.scale
                )
                dq_chunk = dq_p.float() if dq_chunk is None else dq_chunk + dq_p.float()
                key_grads.append((a, dk_p, dv_p))
            dq[:, :, rows] = dq_chunk.to(dq.dtype)
        del k, v
        dk = _gather_key_grads([(a, d) for a, d, _ in key_grads], k_shape, length)
        dv = _gather_key_grads([(a, d) for a, _, d in key_grads], v_shape, length)
        if heads != key.shape[1]:  # sum the gradients of the query heads a kv head served
            shape = (key.shape[0], key.shape[1], heads // key.shape[1], *key.shape[2:])
            dk, dv = dk.view(shape).sum(2), dv.view(shape).sum(2)
        return dq, dk.to(key.dtype), dv.to(value.dtype), None, None


def chunked_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    chunks: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of query chunks (global chunk indices ``chunks``, each ``L`` long, laid
    end to end in ``query``) against the whole sequence's ``key``/``value``, without a mask.

    Equals ``F.scaled_dot_product_attention`` with the causal mask of the queries' global
    positions (and key/value heads repeated for grouped-query attention).

    Example (rank 1 of cp 2: chunks 1 and 2 of 4, L = 3):
        >>> q = torch.randn(1, 4, 6, 8)
        >>> k = v = torch.randn(1, 2, 12, 8)
        >>> chunked_causal_attention(q, k, v, (1, 2)).shape
        torch.Size([1, 4, 6, 8])
    """
    chunks = tuple(int(c) for c in chunks)
    where = "chunked_causal_attention"
    if not chunks or query.shape[2] % len(chunks):
        raise ContextParallelError(
            f"{where}: {query.shape[2]} queries do not split into {len(chunks)} equal chunks "
            f"(chunks={chunks}); pass one global chunk index per chunk of the queries"
        )
    length = query.shape[2] // len(chunks)
    if min(chunks) < 0 or (max(chunks) + 1) * length > key.shape[2]:
        raise ContextParallelError(
            f"{where}: chunks={chunks} of {length} queries reach past the {key.shape[2]} keys; "
            "pass the keys and values of the whole sequence, in global order"
        )
    if query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        raise ContextParallelError(
            f"{where}: {key.shape[1]} key and {value.shape[1]} value heads do not serve "
            f"{query.shape[1]} query heads; the query heads must be a multiple of them"
        )
    device = query.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        # as autocast runs SDPA: in its lower precision
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) if t.is_floating_point() else t
                             for t in (query, key, value))  # fmt: skip
    if not query.dtype == key.dtype == value.dtype:
        raise ContextParallelError(
            f"{where}: query, key and value are {query.dtype}, {key.dtype}, {value.dtype}; "
            "they must share one dtype (or run under torch.autocast)"
        )
    return ChunkedCausalAttention.apply(query, key, value, chunks, scale)

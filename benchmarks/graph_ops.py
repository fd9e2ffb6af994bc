"""Static-graph benchmarks, each printed as a side-by-side ratio from one run.

1. MLP with a fused bias+GELU (decompose, trace, find, fuse with inductor) vs eager, on CPU.
2. Peak memory of the chunked fused linear+cross-entropy vs the plain LM head, vocab 32k.
3. Tracing a 32-layer Llama block by block (torch.export), per block and in total.

Run: .venv/bin/python benchmarks/graph_ops.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
import transformers
from torch import nn

import slapo
from slapo import op


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(hidden, 4 * hidden)
        self.linear2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(x)))


def time_step(model: nn.Module, x: torch.Tensor, iters: int) -> float:
    for _ in range(3):  # warm-up (and compilation)
        model(x).sum().backward()
    start = time.perf_counter()
    for _ in range(iters):
        model(x).sum().backward()
    return (time.perf_counter() - start) / iters


def bench_bias_gelu(quick: bool) -> None:
    hidden, tokens = (256, 2048) if quick else (1024, 4096)
    eager = MLP(hidden)
    fused = copy.deepcopy(eager)
    sch = slapo.create_schedule(fused)
    sch["linear1"].decompose()
    sch.trace(flatten=True, tracer="fx")
    sch.fuse(sch.find(lambda x, bias: F.gelu(bias + x)), compiler="inductor", name="BiasGeLU")
    x = torch.randn(tokens, hidden)
    iters = 5 if quick else 20
    t_eager, t_fused = time_step(eager, x, iters), time_step(sch.mod, x, iters)
    print(f"[bias+GELU MLP, CPU, hidden={hidden}, tokens={tokens}, fwd+bwd]")
    print(
        f"  eager {t_eager * 1e3:8.2f} ms | fused {t_fused * 1e3:8.2f} ms | "
        f"speedup x{t_eager / t_fused:.2f}"
    )


def _peak_rss_of_step(kind: str, vocab: int, hidden: int, tokens: int, queue) -> None:
    """In a fresh process: the rise of peak RSS caused by one forward+backward of the head."""
    import resource

    torch.manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    head.weight.grad = torch.zeros_like(head.weight)  # gradient buffers exist in both cases
    h.grad = torch.zeros_like(h)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if kind == "plain":
        F.cross_entropy(head(h), labels).backward()
    else:
        op.LinearCrossEntropy(head, chunk_size=256)(h, labels).backward()
    queue.put((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)


def peak_bytes(kind: str, vocab: int, hidden: int, tokens: int) -> int:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_rss_of_step, args=(kind, vocab, hidden, tokens, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def saved_bytes(kind: str, vocab: int, hidden: int, tokens: int) -> int:
    """Bytes the forward keeps for backward (unique storages, parameters excluded)."""
    torch.manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    params = {head.weight.untyped_storage().data_ptr(), h.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if kind == "plain":
            loss = F.cross_entropy(head(h), labels)
        else:
            loss = op.LinearCrossEntropy(head, chunk_size=256)(h, labels)
    loss.backward()
    return sum(seen.values())


def bench_linear_cross_entropy(quick: bool) -> None:
    vocab, hidden, tokens = 32000, 256, (1024 if quick else 4096)
    mib = 2**20
    rss = {kind: peak_bytes(kind, vocab, hidden, tokens) for kind in ("plain", "fused")}
    saved = {kind: saved_bytes(kind, vocab, hidden, tokens) for kind in ("plain", "fused")}
    print(f"[linear+cross-entropy, vocab={vocab}, hidden={hidden}, tokens={tokens}, fwd+bwd]")
    print(
        f"  saved for backward: plain head {saved['plain'] / mib:8.1f} MiB | chunked fused "
        f"{saved['fused'] / mib:8.1f} MiB | x{saved['plain'] / max(saved['fused'], 1):.1f} less"
    )
    # The rise of peak RSS in a fresh process; below a MiB it is lost in allocator reuse.
    fused_rss = f"{rss['fused'] / mib:8.1f} MiB" if rss["fused"] >= mib else "   < 1.0 MiB"
    print(
        f"  rise of peak RSS:   plain head {rss['plain'] / mib:8.1f} MiB | chunked fused {fused_rss}"
    )


def bench_trace_llama(quick: bool) -> None:
    layers = 32
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg)
    sch = slapo.create_schedule(model)
    n = 4 if quick else layers
    start = time.perf_counter()
    for i in range(n):
        sch[f"model.layers.{i}"].trace()
    total = time.perf_counter() - start
    ids = torch.randint(0, 1000, (2, 16))
    forward_start = time.perf_counter()
    model(input_ids=ids)
    forward = time.perf_counter() - forward_start
    print(f"[trace Llama block by block, {n} of {layers} layers, torch.export]")
    print(
        f"  total {total:6.2f} s | per block {total / n * 1e3:7.1f} ms | "
        f"per block / one model forward x{total / n / forward:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer iterations")
    args = parser.parse_args()
    torch.manual_seed(0)
    bench_bias_gelu(args.quick)
    bench_linear_cross_entropy(args.quick)
    bench_trace_llama(args.quick)


if __name__ == "__main__":
    main()

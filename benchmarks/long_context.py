"""Long context, measured: the longest sequence that trains within one per-rank memory budget at
context-parallel sizes 1, 2 and 4, side by side.

For each cp, the memory planner (``slapo.estimate_layout``: a fake training step of one cp rank,
its ``seq_len / cp`` tokens and the keys and values its attention gathers, over a fake group of
cp ranks) finds the longest sequence (a multiple of ``2 * cp``: doubling, then bisection) whose
estimated per-rank ``required`` bytes fit the budget. Then cp gloo processes on this machine train
one real step at that length (``slapo.sharding.context_parallel``: attention over the cp group,
each rank's part of the sequence from ``ContextParallel.model_batch``; the cp ranks' gradients
summed by ``all_reduce_grads``) and measure each rank's peak as ``slapo train`` measures a CPU run
(:class:`slapo.train.run_memory.PeakMemory`: parameters, gradients, optimizer state and the most
bytes saved for backward alive at once: the estimate's ``peak``), the most bytes alive at once in
a steady-state step, temporaries included (:class:`LivePeak`: what the budget must hold, the
estimate's ``required``), and a third step's tokens/s (one thread per process). cp 1 is the plain
model (no context parallelism), as ``slapo train --cp 1`` runs it.

The table: cp, the longest sequence the estimate allows, the estimated and measured peak there,
the estimated and measured live peak (``required``: what the budget holds), tokens/s, the
longest sequence over cp 1's, and the share of the estimated activations kept by the attention
modules (with cp, the keys and values gathered, the output and its log-sum-exp: linear in the
sequence, as cp 1's fused causal attention; the mask-free kernels of
``slapo.sharding.context_kernels``). With a small vocabulary (``--vocab 256``) the attention
weighs more; with a tokenizer's (the default, Llama 2's 32000) the logits weigh most.

    python benchmarks/long_context.py [--budget 1GiB] [--hidden 128] [--layers 2] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import warnings
from typing import Any

import torch
import torch.multiprocessing as mp
import transformers

from slapo.memory import estimate_layout, fake_layout_groups, format_bytes, parse_bytes

CP_SIZES = (1, 2, 4)


def make_model(args: argparse.Namespace, meta: bool = False) -> transformers.LlamaForCausalLM:
    """The tiny Llama (grouped-query attention, no dropout), the same weights in every process."""
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1 << 20, attention_dropout=0.0, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg).train()
    return transformers.LlamaForCausalLM(cfg).train()


def make_batch(args: argparse.Namespace, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, args.vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def estimate(args: argparse.Namespace, cp: int, seq: int) -> Any:
    """The planner's estimate of one cp rank of a step on one sequence of ``seq`` tokens."""
    from slapo.sharding.context_parallel import context_parallel

    model, batch = make_model(args, meta=True), make_batch(args, seq)
    optimizer = {"optimizer": torch.optim.AdamW, "optimizer_kwargs": {"lr": 1e-3}}
    if cp == 1:
        return estimate_layout(model, batch, device="cpu", **optimizer)
    with fake_layout_groups(cp=cp) as groups:
        local = context_parallel(model, groups["cp"]).model_batch(batch)
        return estimate_layout(model, local, cp=cp, device="cpu", **optimizer)


def longest(args: argparse.Namespace, cp: int, budget: int) -> tuple[int, Any]:
    """The longest sequence (a multiple of 2 * cp) whose estimate's ``required`` fits ``budget``:
    doubling from ``--start`` tokens, then bisection between the last fit and the first miss."""
    unit = 2 * cp
    seq = max(unit, args.start // unit * unit)
    fits = {}

    def fit(n: int) -> bool:
        if n not in fits:
            est = estimate(args, cp, n)
            fits[n] = est if est.required <= budget else None
        return fits[n] is not None

    if not fit(seq):
        raise SystemExit(f"cp {cp}: even {seq} tokens need more than the budget: lower --start")
    while fit(seq * 2):
        seq *= 2
    low, high = seq // unit, seq * 2 // unit  # in units: low fits, high does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fit(mid * unit) else (low, mid)
    return low * unit, fits[low * unit]


class LivePeak:
    """The most bytes alive at once while entered: the storages ``held`` before (parameters,
    buffers, optimizer state: data pointer -> bytes; the batch's: 0) plus every other storage the
    ops output, counted until it is freed (a dispatch mode sees each op's outputs; a finalizer each
    free). A view of a held storage (a weight's transpose) is no new bytes."""

    def __init__(self, held: dict[int, int]) -> None:
        self.held, self.base = held, sum(held.values())
        self.now = self.peak = 0
        self.seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.now -= nbytes

    def __enter__(self) -> LivePeak:
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        new = id(st) not in tracker.seen and st.data_ptr() not in tracker.held
                        if new and st.nbytes():
                            tracker.seen.add(id(st))
                            weakref.finalize(st, tracker._freed, id(st), st.nbytes())
                            tracker.now += st.nbytes()
                            tracker.peak = max(tracker.peak, tracker.now)
                return out

        self._mode = Track()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return self.base + self.peak


def attention_share(est: Any) -> float:
    """The share of the estimated activations kept by the attention modules."""
    attention = sum(n for path, n in est.by_module.items() if path.endswith("self_attn"))
    return attention / est.activations if est.activations else 0.0


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, seq: int, out: Any):
    import slapo.env
    from slapo.sharding.context_parallel import all_reduce_grads, context_parallel
    from slapo.train.run_memory import PeakMemory

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    try:
        slapo.env.setup(rank, world, "gloo", master_port=port, timeout=600.0)
        model = make_model(args)
        context = context_parallel(model) if world > 1 else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = make_batch(args, seq)
        local = batch if context is None else context.model_batch(batch)

        def step() -> None:
            output = model(**local)  # held through backward, as slapo.train_step holds it
            output.loss.backward()
            del output
            if context is not None:
                all_reduce_grads(model)
            opt.step()
            opt.zero_grad(set_to_none=True)  # as slapo train

        with PeakMemory(model, opt) as mem:
            step()
            mem.next_step()

        def held() -> dict[int, int]:  # parameters, buffers, optimizer state
            tensors = [*model.parameters(), *model.buffers()]
            tensors += [v for s in opt.state.values() for v in s.values()]
            held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors if isinstance(t, torch.Tensor)}  # fmt: skip
            # the batch is the data loader's, as the estimate counts it: skipped, no bytes
            inputs = [t for t in [*batch.values(), *local.values()] if isinstance(t, torch.Tensor)]
            return {**{t.untyped_storage().data_ptr(): 0 for t in inputs}, **held}

        with LivePeak(held()) as live:  # a steady-state step: the optimizer state there
            step()
        torch.distributed.barrier()
        start = time.perf_counter()
        step()
        torch.distributed.barrier()
        seconds = time.perf_counter() - start
        report = {"peak": mem.peak_mb * 2**20, "live": live.bytes, "seconds": seconds}
        out.put((rank, report))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent)
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
    finally:
        slapo.env.teardown()


def measure(args: argparse.Namespace, cp: int, seq: int) -> dict[str, float]:
    """One real step of ``seq`` tokens on ``cp`` gloo processes: the largest per-rank peak
    (bytes) and the second step's tokens/s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, cp, port, args, seq, out)) for r in range(cp)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=args.timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    errors = [f"rank {r}: {v['error']}" for r, v in sorted(results.items()) if "error" in v]
    if errors:
        raise SystemExit("\n".join(errors))
    seconds = max(v["seconds"] for v in results.values())
    most = {k: max(v[k] for v in results.values()) for k in ("peak", "live")}
    return {**most, "tokens_per_s": seq / seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="1GiB", help="the per-rank memory budget")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000, help="default: Llama 2's")
    p.add_argument("--start", type=int, default=512, help="the first sequence length tried")
    p.add_argument("--cp", type=int, nargs="+", default=list(CP_SIZES))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one measured run")
    args = p.parse_args(argv)
    budget = parse_bytes(args.budget)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(
        f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch 1, AdamW, "
        f"fp32 on CPU; per-rank budget {format_bytes(budget)}", flush=True,
    )  # fmt: skip
    rows = []
    for cp in args.cp:
        t0 = time.perf_counter()
        seq, est = longest(args, cp, budget)
        searched = time.perf_counter() - t0
        real = measure(args, cp, seq)
        rows.append((cp, seq, est, real))
        print(f"  cp {cp}: {seq} tokens (search {searched:.0f}s), measured", flush=True)
    base = rows[0][1]
    header = (
        f"{'cp':>3} {'longest seq':>12} {'peak: est.':>11} {'measured':>11} {'est/meas':>9} "
        f"{'live: est.':>11} {'measured':>11} {'est/meas':>9} {'tokens/s':>9} "
        f"{'seq / cp1':>10} {'attention':>10}"
    )
    print(header)
    print("-" * len(header))
    for cp, seq, est, real in rows:
        print(
            f"{cp:>3} {seq:>12} {format_bytes(est.peak):>11} {format_bytes(int(real['peak'])):>11} "
            f"{est.peak / real['peak']:>9.3f} {format_bytes(est.required):>11} "
            f"{format_bytes(int(real['live'])):>11} {est.required / real['live']:>9.3f} "
            f"{real['tokens_per_s']:>9.0f} {seq / base:>10.2f} {attention_share(est):>10.0%}"
        )
    over = [cp for cp, _, _, real in rows if real["live"] > budget]
    verdict = f"OVER the budget at cp {over}" if over else "within the budget at every cp"
    print(f"measured live peak {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

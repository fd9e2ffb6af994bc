"""Ready schedules vs the unscheduled model, per family, side by side in one run (CPU).

    python benchmarks/model_schedules.py [--steps 12] [--batch-size 8] [--seq-len 128]

For each family (tiny preset of ``slapo train``) both models start from the same weights and
train on the same batches; their steps are interleaved (base, scheduled, base, ...) so that a
change in machine load hits both alike, and tokens/s is the median over the steps after
``--warmup`` (compilation of fused kernels happens there). Peak memory is the model state plus
the most bytes saved for backward in a step (``slapo.train.PeakMemory``). The scheduled model uses
ckpt_ratio=0.5, attn_op="sdpa", fused_loss, and fuse_ops where the family has something to fuse.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from slapo.model_schedule.space import FUSIBLE
from slapo.train import MODELS, Layout, PeakMemory, Runner, TrainConfig, make_batches


def measure(model: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    cfg = TrainConfig(
        model=model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        ckpt_ratio=0.5, attn_op="sdpa", fused_loss=True, fuse_ops=model in FUSIBLE,
        progress=False,
    )  # fmt: skip
    layout = Layout()
    runners = {
        "base": Runner(cfg, layout, scheduled=False),
        "sched": Runner(cfg, layout, scheduled=True),
    }
    batches = {name: make_batches(cfg, layout) for name in runners}
    times: dict[str, list[float]] = {name: [] for name in runners}
    losses: dict[str, float] = {}
    peaks: dict[str, PeakMemory] = {}
    for step in range(args.steps):
        for name, runner in runners.items():
            batch = batches[name].next()
            peak = peaks.setdefault(name, PeakMemory(runner.model, runner.optimizer))
            start = time.perf_counter()
            with peak:
                losses[name] = runner.step(batch)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    tokens = cfg.batch_size * cfg.seq_len
    return {
        name: {
            "tokens_per_s": tokens / statistics.median(times[name]),
            "peak_mb": peaks[name].peak_mb,
            "act_mb": peaks[name].activation_mb,
            "loss": losses[name],
        }
        for name in runners
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps "
        f"({args.warmup} warm-up), batch {args.batch_size} x seq {args.seq_len}, steps interleaved"
    )
    head = (
        f"{'family':<7} {'tok/s base':>10} {'tok/s sched':>11} {'ratio':>6} "
        f"{'peak MiB base':>13} {'peak MiB sched':>14} {'act MiB base':>12} "
        f"{'act MiB sched':>13} {'loss base':>9} {'loss sched':>10}"
    )
    print(head)
    print("-" * len(head))
    for model in args.models:
        r = measure(model, args)
        b, s = r["base"], r["sched"]
        print(f"{model:<7} {b['tokens_per_s']:>10,.0f} {s['tokens_per_s']:>11,.0f} "
              f"{s['tokens_per_s'] / b['tokens_per_s']:>5.2f}x {b['peak_mb']:>13.1f} "
              f"{s['peak_mb']:>14.1f} {b['act_mb']:>12.1f} {s['act_mb']:>13.1f} "
              f"{b['loss']:>9.3f} {s['loss']:>10.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

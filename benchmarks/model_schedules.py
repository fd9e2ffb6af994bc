"""Ready schedules vs the unscheduled model, per family, side by side in one run (CPU).

    python benchmarks/model_schedules.py [--steps 12] [--batch-size 8] [--seq-len 128]

For each family (tiny preset of ``slapo train``) both models train the same steps on the same
batches from the same weights; tokens/s excludes the first (warm-up) step. Peak memory is the
model state plus the most bytes saved for backward in a step (see ``slapo.train.PeakMemory``).
The scheduled model uses ckpt_ratio=0.5, attn_op="sdpa", fused_loss, and fuse_ops where the
family has something to fuse.
"""

from __future__ import annotations

import argparse

import torch

from slapo.model_schedule.space import FUSIBLE
from slapo.train import MODELS, TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps, "
          f"batch {args.batch_size} x seq {args.seq_len}")
    head = (f"{'family':<7} {'tok/s base':>10} {'tok/s sched':>11} {'ratio':>6} "
            f"{'peak MiB base':>13} {'peak MiB sched':>14} {'act MiB base':>12} "
            f"{'act MiB sched':>13} {'loss base':>9} {'loss sched':>10}")
    print(head)
    print("-" * len(head))
    for model in args.models:
        cfg = TrainConfig(
            model=model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
            ckpt_ratio=0.5, attn_op="sdpa", fused_loss=True, fuse_ops=model in FUSIBLE,
            compare=True, progress=False,
        )  # fmt: skip
        s = train(cfg)
        b = s["baseline"]
        print(f"{model:<7} {b['tokens_per_s']:>10,.0f} {s['tokens_per_s']:>11,.0f} "
              f"{s['tokens_per_s'] / b['tokens_per_s']:>5.2f}x {b['peak_memory_mb']:>13.1f} "
              f"{s['peak_memory_mb']:>14.1f} {b['activation_mb']:>12.1f} {s['activation_mb']:>13.1f} "
              f"{b['final_loss']:>9.3f} {s['final_loss']:>10.3f}")


if __name__ == "__main__":
    main()

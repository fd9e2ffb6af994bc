"""How many trials each tuning strategy needs to find the best configuration.

Two synthetic spaces with a known optimum stand in for real training runs (a trial is a
function call, so the whole comparison takes seconds):

* ``training``: batch size, micro-batch size (depends on the batch size), activation
  checkpointing ratio, tensor parallelism and a fused kernel flag; large batches run out of
  memory unless checkpointing or tensor parallelism saves memory, which costs speed.
* ``bowl``: four knobs with interactions, a smooth objective with one peak.

Every strategy runs until it has measured the best configuration; we report the trial
count over several seeds, next to the exhaustive count (the space size) and its quarter.

    python benchmarks/tune_strategies.py [--seeds 10]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

from slapo.tune import Space, make_strategy

Objective = Callable[[dict], float | None]


def training_space(args: dict, space: Space) -> Space:
    bs = space.create_symbol("batch_size", [1, 2, 4, 8, 16, 32, 64])
    space.create_symbol("micro_batch", [m for m in (1, 2, 4, 8, 16) if m <= bs.value])
    space.create_symbol("ckpt_ratio", [0.0, 0.25, 0.5, 0.75, 1.0])
    space.create_symbol("tp", [1, 2, 4])
    space.create_symbol("fuse_attn", [True, False])
    return space


def training_objective(cfg: dict) -> float | None:
    """Samples per second, or None for out of memory (a 12 GB device)."""
    bs, mb, ckpt, tp = cfg["batch_size"], cfg["micro_batch"], cfg["ckpt_ratio"], cfg["tp"]
    memory = 8.0 / tp + 1.5 * mb * (1.0 - 0.8 * ckpt) / tp + 0.05 * bs
    if memory > 12.0:
        return None
    # Recomputation and unfused attention cost time; tensor parallelism splits compute but
    # adds communication per sample; each micro-batch and each step has a fixed overhead.
    per_sample = (1.0 + 0.3 * ckpt) * (0.9 if cfg["fuse_attn"] else 1.0) / tp**0.8 + 0.2 * (tp - 1)
    return bs / (bs * per_sample + 0.5 * bs / mb + 2.0)


def bowl_space(args: dict, space: Space) -> Space:
    space.create_symbol("a", list(range(6)))
    space.create_symbol("b", list(range(6)))
    space.create_symbol("c", [0.5, 1.0, 2.0, 4.0])
    space.create_symbol("mode", ["x", "y", "z"])
    return space


def bowl_objective(cfg: dict) -> float | None:
    a, b, c = cfg["a"], cfg["b"], math.log2(cfg["c"])
    shift = {"x": 0.0, "y": 1.5, "z": -0.7}[cfg["mode"]]
    return 10.0 - (a - 3.6) ** 2 - 0.7 * (b - 1.2 - 0.3 * a) ** 2 - (c - 1) ** 2 + shift


def trials_to_best(name: str, cfgs: list[dict], objective: Objective, best: int, seed: int) -> int:
    """Run ``name`` until it has measured configuration ``best``; return the trial count."""
    strategy = make_strategy(name, cfgs, seed=seed)
    scores: dict[int, float | None] = {}
    while best not in scores:
        idx = strategy.propose(scores)
        assert idx is not None and idx not in scores
        scores[idx] = objective(cfgs[idx])
    return len(scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    opts = parser.parse_args()
    spaces = {
        "training": (training_space, training_objective),
        "bowl": (bowl_space, bowl_objective),
    }
    print(
        f"{'space':9} {'configs':>7} {'quarter':>7}  {'strategy':10} {'median':>6} "
        f"{'mean':>6} {'max':>5} {'<=quarter':>9} {'sec':>5}"
    )
    for space_name, (update, objective) in spaces.items():
        cfgs = list(Space(update, {}))
        vals = [objective(c) for c in cfgs]
        best = max((i for i in range(len(cfgs)) if vals[i] is not None), key=lambda i: vals[i])
        n, quarter = len(cfgs), len(cfgs) // 4
        for name in ("exhaustive", "random", "bayes"):
            start = time.perf_counter()
            counts = [trials_to_best(name, cfgs, objective, best, s) for s in range(opts.seeds)]
            hits = sum(c <= quarter for c in counts)
            print(
                f"{space_name:9} {n:>7} {quarter:>7}  {name:10} {statistics.median(counts):>6g} "
                f"{statistics.mean(counts):>6.1f} {max(counts):>5} {hits:>6}/{len(counts):<2} "
                f"{time.perf_counter() - start:>5.1f}"
            )
        print(
            f"{'':9} best: {Space.cfg_dict_to_str(cfgs[best])} -> {vals[best]:.3f}; "
            f"exhaustive must run all {n} to know it is the best"
        )


if __name__ == "__main__":
    main()

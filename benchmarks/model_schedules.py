"""Ready schedules vs the unscheduled model, per family, side by side in one run (CPU).

    python benchmarks/model_schedules.py [--steps 40] [--warmup 4] [--models llama gpt2 ...]
        [--schedules default blocks compile ckpt-0.5 "ckpt_ratio=0.5,compile_blocks=true"]

For each family (tiny preset of ``slapo train``: 4 blocks, hidden 128, batch 8 x 128 tokens,
AdamW) every schedule starts from the same weights and trains on the same batches. Their steps
are interleaved (eager, schedule 1, schedule 2, ..., the order rotating every step) so that a
change in machine load hits them alike. ``--isolate N`` instead trains each schedule in a process
of its own, as a user runs one, N rounds in rotating order: the figures to quote. Interleaving
flatters the compiled schedules on CPU (measured: gpt2 1.03-1.18x interleaved, 0.96x alone): an
eager step allocates many more intermediate tensors, and the allocator reuses them worse when
other models' steps run in between. tokens/s is the median over the steps after
``--warmup``; ``best`` compares the fastest steps (the least disturbed by other processes). The
warm-up steps compile the compiled blocks: their time beyond that of steady steps is reported as
``compile s``, apart from the step time (inductor caches what it compiled on disk, so a rerun
compiles faster). Peak memory is the model state plus the most bytes saved for backward in a
step (``slapo.train.PeakMemory``; a selective checkpoint's kept outputs and a compiled block's
saved tensors are counted). Ratios are to the eager (unscheduled) model of the same run.

The schedules (``--schedules``; ``--list`` prints their knobs; ``knob=value,...`` gives others):

* ``default``: the family's best measured knobs for CPU training
  (``slapo.model_schedule.recommended_knobs``).
* ``blocks``: every block checkpointed with ``save_matmuls`` and compiled on its own (not the
  embeddings, masks, head and loss around the blocks).
* ``compile``: the whole model compiled, nothing checkpointed: the compiler's gain alone.
* ``ckpt-0.5``: the schedule ``slapo train`` used before: half the blocks fully checkpointed,
  SDPA, fused loss, fused bias+GELU / bias+dropout+residual where the family has them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

import slapo
from slapo.model_schedule import apply_schedule, recommended_knobs
from slapo.train import MODELS, PeakMemory, TrainConfig
from slapo.train.presets import build_model
from slapo.tune.schedule_space import FUSIBLE

SCHEDULES: dict[str, Any] = {
    "default": recommended_knobs,
    "blocks": lambda family: {
        "ckpt_ratio": 1.0,
        "ckpt_policy": "save_matmuls",
        "compile_blocks": True,
        "attn_op": "sdpa",
    },  # fmt: skip
    "compile": lambda family: {"compile_model": True, "attn_op": "sdpa"},
    "ckpt-0.5": lambda family: {
        "ckpt_ratio": 0.5,
        "attn_op": "sdpa",
        "fused_loss": True,
        "fuse_ops": family in FUSIBLE,
    },  # fmt: skip
}


def knobs_of(name: str, family: str) -> dict[str, Any]:
    """The knobs of a named schedule, or of ``name`` written as ``knob=value,knob=value``."""
    if name in SCHEDULES:
        return SCHEDULES[name](family)
    knobs: dict[str, Any] = {}
    for item in name.split(","):
        key, _, text = item.partition("=")
        value: Any = text
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        elif text.lower() == "none":
            value = None
        else:
            try:
                value = float(text) if "." in text else int(text)
            except ValueError:
                pass
        knobs[key.strip()] = value
    return knobs


class Run:
    """One model of the comparison: built, scheduled, with its optimizer and its own batches."""

    def __init__(self, cfg: TrainConfig, knobs: dict[str, Any] | None) -> None:
        from slapo.data import ByteBatches, MaskedByteBatches, default_corpus

        torch.manual_seed(cfg.seed)  # the same initial weights for every schedule
        model = build_model(cfg)
        model.train()
        sch = slapo.create_schedule(model) if knobs is None else apply_schedule(model, **knobs)
        self.model, self.optimizer = slapo.build(
            sch, init_weights=False, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": cfg.lr}
        )
        cls = MaskedByteBatches if cfg.model == "bert" else ByteBatches
        self.batches = cls(default_corpus(), cfg.batch_size, cfg.seq_len, seed=cfg.seed)
        self.peak = PeakMemory(self.model, self.optimizer)
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.loss = float("nan")

    def step(self, count_memory: bool) -> None:
        batch = self.batches.next()
        # The saved bytes are counted in warm-up steps only: the hook that counts them runs per
        # saved tensor, which would slow the timed steps (an eager model's more than others).
        peak = self.peak if count_memory else contextlib.nullcontext()
        start, cpu = time.perf_counter(), time.process_time()
        with peak:
            loss = slapo.train_step(self.model, batch)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - start)
        self.cpu.append(time.process_time() - cpu)
        self.loss = float(loss)


def _summary(run_times: list[float], cpu: list[float], peak: PeakMemory, loss: float,
             tokens: int, warmup: int) -> dict[str, Any]:  # fmt: skip
    steady = statistics.median(run_times[warmup:])
    return {
        "tokens_per_s": tokens / steady,
        "cpu_tokens_per_s": tokens / statistics.median(cpu[warmup:]),
        "best_tokens_per_s": tokens / min(run_times[warmup:]),
        "peak_mb": peak.peak_mb,
        "act_mb": peak.activation_mb,
        "compile_s": max(0.0, sum(run_times[:warmup]) - warmup * steady),
        "loss": loss,
        "times": run_times,
    }


def measure(family: str, names: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Every schedule in this process, steps interleaved."""
    cfg = TrainConfig(model=family, batch_size=args.batch_size, seq_len=args.seq_len)
    runs = {"eager": Run(cfg, None)}
    for name in names:
        runs[name] = Run(cfg, knobs_of(name, family))
    Run(cfg, None).step(False)  # untimed, thrown away: the process's first-step costs
    order = list(runs)
    for step in range(args.steps):
        shift = step % len(order)  # rotate: no schedule always runs right after another
        for name in order[shift:] + order[:shift]:
            runs[name].step(count_memory=step < args.warmup)
    tokens = cfg.batch_size * cfg.seq_len
    return {
        name: _summary(run.times, run.cpu, run.peak, run.loss, tokens, args.warmup)
        for name, run in runs.items()
    }


def _worker(family: str, name: str, args: argparse.Namespace) -> None:
    """One schedule alone in this process (``--isolate``): one JSON line of its step times."""
    cfg = TrainConfig(model=family, batch_size=args.batch_size, seq_len=args.seq_len)
    run = Run(cfg, None if name == "eager" else knobs_of(name, family))
    for step in range(args.steps):
        run.step(count_memory=step < args.warmup)
    doc = {"times": run.times, "cpu": run.cpu, "loss": run.loss,
           "peak_mb": run.peak.peak_mb, "act_mb": run.peak.activation_mb}  # fmt: skip
    print(json.dumps(doc))


def measure_isolated(family: str, names: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Every schedule in a process of its own (as a user runs one), ``--isolate`` rounds of them
    in rotating order; the steady steps of all rounds pooled."""
    order = ["eager", *names]
    pooled: dict[str, dict[str, Any]] = {n: {"times": [], "cpu": [], "first": []} for n in order}
    flags = ["--steps", str(args.steps), "--warmup", str(args.warmup),
             "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]  # fmt: skip
    for round_ in range(args.isolate):
        shift = round_ % len(order)
        for name in order[shift:] + order[:shift]:
            cmd = [sys.executable, __file__, "--worker", family, name, *flags]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise SystemExit(f"{family} {name}: {done.stderr[-2000:]}")
            doc = json.loads(done.stdout.strip().splitlines()[-1])
            entry = pooled[name]
            entry["first"] += doc["times"][: args.warmup]
            entry["times"] += doc["times"][args.warmup :]
            entry["cpu"] += doc["cpu"][args.warmup :]
            entry.update(loss=doc["loss"], peak_mb=doc["peak_mb"], act_mb=doc["act_mb"])
    tokens = args.batch_size * args.seq_len
    out = {}
    for name, e in pooled.items():
        steady = statistics.median(e["times"])
        out[name] = {
            "tokens_per_s": tokens / steady,
            "cpu_tokens_per_s": tokens / statistics.median(e["cpu"]),
            "best_tokens_per_s": tokens / min(e["times"]),
            "peak_mb": e["peak_mb"],
            "act_mb": e["act_mb"],
            "compile_s": max(0.0, (sum(e["first"]) - len(e["first"]) * steady) / args.isolate),
            "loss": e["loss"],
            "times": e["first"] + e["times"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument(
        "--schedules", nargs="+", default=["default", "blocks", "compile", "ckpt-0.5"],
        help=f"names ({', '.join(SCHEDULES)}) or knobs as ckpt_ratio=0.5,compile_blocks=true",
    )  # fmt: skip
    parser.add_argument(
        "--isolate", type=int, default=0, metavar="ROUNDS",
        help="train each schedule in a process of its own, ROUNDS times (rotating order)",
    )  # fmt: skip
    parser.add_argument("--worker", nargs=2, metavar=("FAMILY", "SCHEDULE"), help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true", help="print the warm-up step times")
    parser.add_argument("--list", action="store_true", help="print each schedule's knobs")
    args = parser.parse_args()
    if args.list:
        for name, knobs in SCHEDULES.items():
            print(f"{name:>24}: {knobs('llama')}")
        return
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    if args.worker:
        _worker(*args.worker, args)
        return
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps "
        f"({args.warmup} warm-up), batch {args.batch_size} x seq {args.seq_len}, "
        + (f"each schedule alone in its process, {args.isolate} rounds"
           if args.isolate else "interleaved (rotating order)")
        + "; ratios to eager of the same run"
    )  # fmt: skip
    head = (
        f"{'family':<7} {'schedule':<24} {'tok/s':>8} {'ratio':>6} {'cpu ratio':>9} {'best':>6} "
        f"{'peak MiB':>9} {'ratio':>6} {'act MiB':>8} {'compile s':>9} {'loss':>7}"
    )
    print(head)
    print("-" * len(head))
    for name in args.schedules:
        knobs_of(name, "llama")  # a bad name fails before any model is built
    for family in args.models:
        r = (measure_isolated if args.isolate else measure)(family, args.schedules, args)
        base = r["eager"]
        for name, m in r.items():
            if args.verbose:
                print(name, [round(t, 3) for t in m["times"][: args.warmup + 2]])
            print(
                f"{family:<7} {name:<24} {m['tokens_per_s']:>8,.0f} "
                f"{m['tokens_per_s'] / base['tokens_per_s']:>5.2f}x "
                f"{m['cpu_tokens_per_s'] / base['cpu_tokens_per_s']:>8.2f}x "
                f"{m['best_tokens_per_s'] / base['best_tokens_per_s']:>5.2f}x "
                f"{m['peak_mb']:>9.1f} {m['peak_mb'] / base['peak_mb']:>5.2f}x "
                f"{m['act_mb']:>8.1f} {m['compile_s']:>9.1f} {m['loss']:>7.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

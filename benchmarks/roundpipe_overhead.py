"""RoundPipe runtime overhead against plain PyTorch training on CPU, and planner stage tables.

Runs everything side by side in one process, interleaved round by round: the same MLP, the same
data, the same number of optimizer steps.

* **recompute off**: one fused stage holds every layer, so nothing is recomputed and, with no
  pipeline to fill, the batch goes through as one microbatch. The ratio to plain PyTorch is the
  runtime's own cost: stage bookkeeping, thread handoffs, gradient hand-over and the optimizer
  copy-back (parameters are used in place on CPU virtual devices, so no weight copies).
* **recompute on**: the planner's stages (one layer each here) with ``ndev + 1`` microbatches:
  every forward stage but the last is recomputed in backward (about one more forward pass), and
  the microbatches split each matmul into smaller ones. The row "plain PyTorch, N microbatches"
  shows what the microbatch split alone costs plain PyTorch.

    .venv/bin/python benchmarks/roundpipe_overhead.py [--recompute off|on|both] [--rounds N]
        [--ndev 2] [--threads T] [--no-tables]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import roundpipe
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


def make_mlp(n_layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n_layers)]
    )


def interleaved(
    runners: dict[str, Callable[[], None]],
    finishers: dict[str, Callable[[], None]],
    rounds: int,
    iters: int = 3,
) -> dict[str, float]:
    """Median seconds per training step of each runner.

    Runners alternate every round so that load changes on a shared machine hit all of them
    alike; a round times ``iters`` consecutive steps plus the runner's finisher (waiting for
    asynchronous optimizer work), so no background work leaks into another runner's time.
    """
    for name, fn in runners.items():  # warm-up; lets RoundPipe measure its layer timings
        fn()
        fn()
        finishers.get(name, lambda: None)()
    samples: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            finishers.get(name, lambda: None)()
            samples[name].append((time.perf_counter() - t0) / iters)
    return {k: statistics.median(v) for k, v in samples.items()}


def _one_stage(n_layers: int) -> ModelExecutePlan:
    """Every layer in the fused stage: forward and backward in one pass, nothing recomputed."""
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, n_layers)]
    plan.bwd_plan = [range(0, n_layers)]
    return plan


def overhead(
    n_layers: int = 8,
    width: int = 1024,
    batch: int = 64,
    rounds: int = 5,
    ndev: int = 2,
    recompute: str = "both",
) -> None:
    roundpipe.init_devices(num_virtual=ndev)
    ref = make_mlp(n_layers, width)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-4)

    def torch_step() -> None:
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    n_mb = ndev + 1

    def torch_microbatched_step() -> None:
        for xb, yb in zip(x.tensor_split(n_mb), y.tensor_split(n_mb)):
            (nn.functional.mse_loss(ref(xb), yb) / n_mb).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    base = "plain PyTorch (torch Adam)"
    runners: dict[str, Callable[[], None]] = {base: torch_step}
    finishers: dict[str, Callable[[], None]] = {}
    modes = ("off", "on") if recompute == "both" else (recompute,)
    if "on" in modes:
        runners[f"plain PyTorch, {n_mb} microbatches"] = torch_microbatched_step
    models = {}
    for mode in modes:
        mbs = 1 if mode == "off" else n_mb
        plan = _one_stage(n_layers) if mode == "off" else None
        for opt_name, make_opt, is_async in (
            ("torch Adam", torch.optim.Adam, False),
            ("torch Adam", torch.optim.Adam, True),
            ("C++ Adam", roundpipe.Adam, True),
        ):
            label = f"RP recompute {mode} {'async' if is_async else 'sync'} ({opt_name})"
            model = RoundPipe(
                copy.deepcopy(ref),
                pin_model="off",
                model_run_config=RoundPipeRunConfig(num_microbatch=mbs, execute_plan=plan),
            )
            opt = make_opt(model.optim_parameters(), lr=1e-4)
            models[label] = model

            def rp_step(model=model, opt=opt, is_async=is_async, mbs=mbs) -> None:
                model.forward_backward(
                    (x,), label=y, loss_fn=lambda o, t: nn.functional.mse_loss(o, t) / mbs
                )
                model.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)

            runners[label] = rp_step
            finishers[label] = model.synchronize
    times = interleaved(runners, finishers, rounds)
    for m in models.values():
        m.synchronize()
    params = sum(p.numel() for p in ref.parameters())
    print(
        f"MLP {n_layers}x{width} ({params / 1e6:.1f}M params), batch {batch}, {ndev} CPU virtual "
        f"devices, {torch.get_num_threads()} intra-op threads, median of {rounds} interleaved "
        "rounds of 3 steps"
    )
    print(f"{'runner':<44}{'s/step':>10}{'ratio':>8}")
    for name, t in times.items():
        print(f"{name:<44}{t:>10.4f}{times[base] and t / times[base]:>8.2f}")
    for label, model in models.items():
        if label.endswith("async (C++ Adam)"):
            cfg = model.model_run_config
            plan = cfg.execute_plan or ModelExecutePlan.auto("fused", model)
            print(f"plan, {label.split(' async')[0]}: {plan}, {cfg.num_microbatch} microbatch(es)")


def stage_tables(n_layers: int = 32, ndev: int = 4) -> None:
    """Planner output for a Llama-like 32-layer model: embedding, blocks, a heavy LM head."""
    roundpipe.init_devices(num_virtual=ndev)
    layers = (
        [nn.Embedding(4096, 256)]
        + [nn.Linear(256, 256) for _ in range(n_layers - 2)]
        + [nn.Linear(256, 4096)]
    )
    model = RoundPipe(nn.Sequential(*layers), pin_model="off")
    model_gb = sum(model.layer_bytes) / 1024**3
    print(
        f"\nplanner stage tables, {n_layers} layers on {ndev} devices (size-based estimates; "
        f"model {model_gb * 1024:.1f} MiB)"
    )
    for run_type in ("infer", "train", "fused"):
        for limit_frac, upper in ((None, 1.1), (0.6, 1.1), (None, 3.0)):
            limit = None if limit_frac is None else model_gb * limit_frac
            plan = ModelExecutePlan.auto(
                run_type, model, upper_threshold=upper, model_memory_limit=limit
            )
            mem = "default" if limit is None else f"{limit_frac:.0%} of model"
            print(
                f"  {run_type:<6} upper_threshold={upper:<4} memory_limit={mem:<13} "
                f"fwd {len(plan.fwd_plan):>2} stages, bwd {len(plan.bwd_plan):>2} stages"
            )
            print(f"      {plan}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recompute", choices=["off", "on", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ndev", type=int, default=2)
    parser.add_argument("--no-tables", action="store_true", help="skip the planner stage tables")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads (default: torch's); 1 is steadier on a machine others load",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    overhead(rounds=args.rounds, ndev=args.ndev, recompute=args.recompute)
    if not args.no_tables:
        stage_tables()

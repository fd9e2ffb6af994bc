"""RoundPipe runtime overhead against plain PyTorch training on CPU, and planner stage tables.

Runs both side by side in one process: the same MLP, the same data, the same number of
optimizer steps. On CPU virtual devices RoundPipe copies every stage's weights in and its
gradients out, so the ratio measures the runtime's bookkeeping and copy cost.

    .venv/bin/python benchmarks/roundpipe_overhead.py
"""

from __future__ import annotations

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


def overhead(
    n_layers: int = 8, width: int = 1024, batch: int = 64, rounds: int = 5, ndev: int = 2
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
    runners: dict[str, Callable[[], None]] = {"plain PyTorch (torch Adam)": torch_step}
    finishers: dict[str, Callable[[], None]] = {}
    models = []
    for label, make_opt, is_async in (
        ("RoundPipe sync (torch Adam)", torch.optim.Adam, False),
        ("RoundPipe async (torch Adam)", torch.optim.Adam, True),
        ("RoundPipe async (C++ Adam)", None, True),
    ):
        if make_opt is None:
            try:
                from roundpipe.optim import Adam as make_opt
            except ImportError:
                continue
        model = RoundPipe(
            copy.deepcopy(ref),
            pin_model="off",
            model_run_config=RoundPipeRunConfig(num_microbatch=n_mb),
        )
        opt = make_opt(model.optim_parameters(), lr=1e-4)
        models.append(model)

        def rp_step(model=model, opt=opt, is_async=is_async) -> None:
            model.forward_backward(
                (x,), label=y, loss_fn=lambda o, t: nn.functional.mse_loss(o, t) / n_mb
            )
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)

        runners[label] = rp_step
        finishers[label] = model.synchronize
    times = interleaved(runners, finishers, rounds)
    for m in models:
        m.synchronize()
    params = sum(p.numel() for p in ref.parameters())
    print(
        f"MLP {n_layers}x{width} ({params / 1e6:.1f}M params), batch {batch}, {ndev} CPU virtual devices, "
        f"{n_mb} microbatches, {torch.get_num_threads()} intra-op threads, median of {rounds} interleaved rounds"
    )
    base = times["plain PyTorch (torch Adam)"]
    print(f"{'runner':<32}{'s/step':>10}{'ratio':>8}")
    for name, t in times.items():
        print(f"{name:<32}{t:>10.4f}{t / base:>8.2f}")
    print(f"plan used: {ModelExecutePlan.auto('fused', models[0])}")


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
    overhead()
    stage_tables()

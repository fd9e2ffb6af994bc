"""The main job: train a small Llama-style model on the embedded corpus with a schedule.

Run it as ``slapo train`` (or ``python -m slapo train``); ``slapo train --help`` lists the options.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .build import build
from .data import VOCAB_SIZE, ByteBatches, default_corpus
from .schedule import Schedule, create_schedule

__all__ = ["TrainConfig", "train", "build_model", "default_schedule", "add_parser"]

# name -> (hidden, layers, heads, kv heads, intermediate)
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (128, 4, 4, 2, 352),
    "small": (256, 6, 8, 4, 688),
    "base": (512, 8, 8, 4, 1376),
}


@dataclass
class TrainConfig:
    """Options of the main job; every field is a ``slapo train --flag``."""

    preset: str = "tiny"
    steps: int = 120
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    ckpt_ratio: float = 0.5
    seed: int = 0
    output_dir: str | None = None
    progress: bool = True


def build_model(cfg: TrainConfig) -> nn.Module:
    """A Llama-style causal LM from a config, with random weights (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if cfg.preset not in PRESETS:
        raise ValueError(f"unknown preset {cfg.preset!r}; choose one of {sorted(PRESETS)}")
    hidden, layers, heads, kv_heads, inter = PRESETS[cfg.preset]
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(cfg.seq_len, 128),
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def default_schedule(model: nn.Module, ckpt_ratio: float = 0.5) -> Schedule:
    """Checkpoint the first ``ckpt_ratio`` of the decoder layers (the rest keep activations)."""
    if not 0.0 <= ckpt_ratio <= 1.0:
        raise ValueError(f"ckpt_ratio must lie in [0, 1], got {ckpt_ratio}")
    sch = create_schedule(model)
    layers = sch["model.layers"]
    n_ckpt = math.ceil(ckpt_ratio * len(layers.child))
    for name in list(layers.child)[:n_ckpt]:
        layers[name].checkpoint()
    return sch


def peak_memory_mb() -> float:
    """Peak resident memory of this process (CPU), or peak CUDA memory when on a GPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train and return a summary: losses, tokens/s, peak memory."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    sch = default_schedule(model, cfg.ckpt_ratio)
    model, optimizer = build(
        sch, init_weights=False, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": cfg.lr}
    )
    model.train()
    batches = ByteBatches(default_corpus(), cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    tokens_per_step = cfg.batch_size * cfg.seq_len

    losses: list[float] = []
    step_tps: list[float] = []
    progress = _progress(cfg.steps, cfg.progress)
    start = time.perf_counter()
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        loss = model(**batches.next()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step_tps.append(tokens_per_step / (time.perf_counter() - t0))
        progress.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{step_tps[-1]:,.0f}")
        progress.update()
    progress.close()
    elapsed = time.perf_counter() - start

    summary = {
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpointed_layers": sum(r.name == "checkpoint" for r in sch.metadata.primitives),
        "first_loss": losses[0],
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "tokens_per_s": tokens_per_step * cfg.steps / elapsed,
        "peak_memory_mb": peak_memory_mb(),
        "seconds": elapsed,
        "losses": losses,
        "step_tokens_per_s": step_tps,
    }
    if cfg.output_dir:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "metrics.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(out / "metrics.json")
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    rows = [
        ("parameters", f"{summary['parameters']:,}"),
        ("checkpointed layers", str(summary["checkpointed_layers"])),
        ("steps", str(summary["config"]["steps"])),
        (
            "loss (first -> last 10 mean)",
            f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f}",
        ),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}"),
        ("peak memory (MiB)", f"{summary['peak_memory_mb']:,.0f}"),
        ("time (s)", f"{summary['seconds']:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["", "slapo train: summary", "-" * (width + 20)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)


def add_parser(subparsers: Any) -> None:
    """Register ``slapo train`` on an argparse subparsers object."""
    defaults = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train a small Llama-style model on the embedded corpus with a schedule",
        description=__doc__,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default=defaults.preset)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument(
        "--ckpt-ratio",
        type=float,
        default=defaults.ckpt_ratio,
        help="fraction of layers checkpointed",
    )
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--output-dir", default=None, help="write metrics.json there")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument(
        "--json",
        action="store_true",
        help='end with one JSON line {"throughput": tokens/s, ...} (what `slapo tune` reads)',
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    for name, value in (
        ("steps", args.steps),
        ("batch-size", args.batch_size),
        ("seq-len", args.seq_len),
    ):
        if value <= 0:
            raise SystemExit(f"slapo train: --{name} must be positive, got {value}")
    cfg = TrainConfig(
        preset=args.preset,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        ckpt_ratio=args.ckpt_ratio,
        seed=args.seed,
        output_dir=args.output_dir,
        progress=not args.no_progress,
    )
    summary = train(cfg)
    print(format_summary(summary))
    if args.json:
        result = {k: summary[k] for k in ("final_loss", "peak_memory_mb", "tokens_per_s")}
        print(json.dumps({"throughput": summary["tokens_per_s"], **result}))
    return 0

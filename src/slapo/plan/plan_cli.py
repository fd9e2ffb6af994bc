"""``slapo plan``: which layout, and will it fit, before launching.

Examples:
    slapo plan --model llama --size 70b --gpus 256 --gpu h100 --seq-len 8192 --global-batch 256
    slapo plan --model ./llama-8b --gpus 8 --gpu h100 --layout fsdp=8 --ac selective --compile
    slapo plan --model llama --size 8b --gpus 128 --json > plans.json
    slapo plan --calibrate my-gpu.json          # measure this machine, write a device file
    slapo plan --device-file my-gpu.json --model ./llama-8b --gpus 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..exceptions import SlapoError
from ..memory import format_bytes
from .hardware import PRESETS, ClusterSpec, DeviceSpec, load_device
from .search import AC_CHOICES, PlannedLayout, parse_layout, plan_layouts, predict_config
from .step_time import PlanError

__all__ = ["GPU_NAMES", "add_parser", "run_plan"]

HELP = "rank the layouts of a model on a cluster by predicted tokens/s, the ones that fit"
DESCRIPTION = """Predict the memory per rank and the step time of every layout of a model on a
cluster (dp with FSDP or DDP, tp, pp with microbatches, cp, ep for a mixture of experts, and the
activation checkpointing), drop those that do not fit the device, rank the rest by tokens/s per GPU
and print the best few, each with the torchrun command that launches it. Nothing is allocated:
fake steps of two and three layers of the model (slapo.plan.profile), extended to its depth, give
the counts; the device and cluster description turns them into seconds. --layout predicts the one
layout you name. --calibrate measures this machine instead and writes a device file."""

#: ``--gpu`` spellings of the presets.
GPU_NAMES = {
    "h100": "h100-sxm", "h200": "h200", "a100": "a100-80gb-sxm", "b200": "b200",
    "4090": "rtx-4090", "rtx4090": "rtx-4090", "a800": "a800-80gb-sxm",
    **{name: name for name in PRESETS},
}  # fmt: skip


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``argparse`` subparsers object (handler in ``func``).

    Example:
        >>> parser = argparse.ArgumentParser(prog="slapo")
        >>> _ = add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["plan", "--model", "llama", "--size", "8b"]).gpus
        8
    """
    p = subparsers.add_parser("plan", help=HELP, description=DESCRIPTION)
    p.add_argument(
        "--model", help="a config-only model directory (config.json), or a model type with "
        f"--size ({', '.join(_known_sizes())})",
    )  # fmt: skip
    p.add_argument("--size", help="the published size of --model's type (e.g. 70b)")
    p.add_argument(
        "--config-dir", help="where --model TYPE --size writes the config.json the commands "
        "use (default: ./TYPE-SIZE)",
    )  # fmt: skip
    p.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8)")
    p.add_argument(
        "--gpu", default="h100", help=f"the device preset: {', '.join(sorted(GPU_NAMES))}"
    )
    p.add_argument("--device-file", help="a device description (JSON) instead of --gpu")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument(
        "--inter-node-gbps", type=float, default=50.0,
        help="network bandwidth per GPU and direction between nodes, GB/s (default 50: 400 Gb/s)",
    )  # fmt: skip
    p.add_argument(
        "--host-gib", type=float, default=None,
        help="host memory per node for RoundPipe's model state (default 1024)",
    )  # fmt: skip
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence")
    p.add_argument(
        "--global-batch", type=int, default=None,
        help="sequences per optimizer step over all replicas (default: 2 per GPU)",
    )  # fmt: skip
    p.add_argument(
        "--layout", help="predict this layout only, e.g. fsdp=32,tp=8 or "
        "dp=8,pp=8,tp=8,schedule=1f1b,microbatches=32 (names: fsdp|ddp|dp, tp, pp, cp, ep, "
        "schedule, microbatches, ac, batch)",
    )  # fmt: skip
    p.add_argument(
        "--ac", choices=sorted(AC_CHOICES), action="append",
        help="activation checkpointing to consider (repeat for several; default: all)",
    )  # fmt: skip
    p.add_argument("--compile", action="store_true", help="the blocks run torch.compile'd")
    p.add_argument("--float8", action="store_true", help="matmuls at the device's fp8 rate")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--top", type=int, default=5, help="layouts printed (default 5)")
    p.add_argument("--json", action="store_true", help="every prediction as JSON on stdout")
    p.add_argument(
        "--calibrate", metavar="FILE", help="measure this machine's matmul, attention, memory "
        "and collective rates and write them as a device file (then --device-file FILE)",
    )  # fmt: skip
    p.set_defaults(func=run_plan)
    return p


def _known_sizes() -> list[str]:
    from .models import MODEL_SIZES

    return [f"{t} {'/'.join(sizes)}" for t, sizes in MODEL_SIZES.items()]


def _device(args: argparse.Namespace) -> DeviceSpec:
    if args.device_file:
        return load_device(args.device_file)
    name = GPU_NAMES.get(str(args.gpu).lower())
    if name is None:
        raise PlanError(f"--gpu {args.gpu}: one of {sorted(GPU_NAMES)}, or --device-file")
    return PRESETS[name]


def _model_dir(args: argparse.Namespace) -> str:
    from .models import write_model_config

    if not args.model:
        raise PlanError("--model: give a config-only model directory, or a type with --size")
    if args.size:
        target = args.config_dir or f"{args.model}-{args.size.lower()}"
        path = write_model_config(args.model, args.size, target)
        print(f"model config: {path}/config.json", file=sys.stderr)
        return str(path)
    if not (Path(args.model) / "config.json").is_file():
        raise PlanError(
            f"--model {args.model}: no config.json there; give a model directory, or a model "
            f"type with --size ({', '.join(_known_sizes())})"
        )
    return args.model


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from .calibrate import write_calibration

    on_gpu = torch.cuda.is_available()
    base = _device(args) if on_gpu and not args.device_file else None
    device = write_calibration(
        args.calibrate, device="cuda" if on_gpu else "cpu",
        dtype="bf16" if on_gpu or args.precision != "fp32" else "fp32", base=base,
    )  # fmt: skip
    print(json.dumps({"file": args.calibrate, "device": device.name,
                      "efficiency": device.efficiency, "source": device.source}, indent=2))  # fmt: skip
    return 0


def _one_layout(args: argparse.Namespace, model_dir: str, cluster: ClusterSpec) -> PlannedLayout:
    from ..train.config import TrainConfig

    fields = parse_layout(args.layout)
    ac = fields.pop("ac", (args.ac or ["selective"])[0])
    tp, pp, cp = (fields.get(k, 1) for k in ("tp", "pp", "cp"))
    dp = fields.pop("dp", None) or args.gpus // (tp * pp * cp)
    if dp * tp * pp * cp != args.gpus:
        raise PlanError(
            f"--layout {args.layout}: dp {dp} x tp {tp} x pp {pp} x cp {cp} is not --gpus "
            f"{args.gpus}"
        )
    global_batch = args.global_batch or 2 * args.gpus
    batch = fields.pop("batch_size", None) or global_batch // dp
    if batch < 1:
        raise PlanError(f"--global-batch {global_batch}: under one sequence per replica ({dp})")
    if pp > 1:
        fields.setdefault("num_microbatches", batch)
    cfg = TrainConfig(
        model=model_dir, device="cuda", precision=args.precision, seq_len=args.seq_len,
        batch_size=batch, compile_blocks=args.compile, progress=False,
        **{"target": "fsdp", **fields}, **AC_CHOICES[ac],
    )  # fmt: skip
    pred = predict_config(cfg, cluster, dp=dp, float8=args.float8)
    return PlannedLayout(cfg, dp, ac, pred, pred.memory_bytes <= cluster.device.hbm_gib * 2**30)


def run_plan(args: argparse.Namespace) -> int:
    """Handle parsed ``plan`` arguments; return the exit code (0: a layout fits; 1: none does).

    Example:
        >>> from slapo.cli import build_parser
        >>> args = build_parser().parse_args(["plan", "--model", "llama", "--size", "8b"])
        >>> # illustration: tracing and ranking every layout of an 8B model takes seconds
        >>> run_plan(args)  # prints the ranked layouts  # doctest: +SKIP
        0
    """
    try:
        if args.calibrate:
            return _calibrate(args)
        for name in ("gpus", "gpus_per_node", "seq_len", "top"):
            if getattr(args, name) < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be a positive int")
        host = {} if args.host_gib is None else {"host_gib": args.host_gib}
        cluster = ClusterSpec(
            _device(args), gpus_per_node=min(args.gpus_per_node, args.gpus),
            inter_node_gbps=args.inter_node_gbps, **host,
        )  # fmt: skip
        model_dir = _model_dir(args)
        start = time.perf_counter()
        if args.layout:
            plans = [_one_layout(args, model_dir, cluster)]
        else:
            plans = plan_layouts(
                model_dir, cluster, gpus=args.gpus, seq_len=args.seq_len,
                global_batch=args.global_batch or 2 * args.gpus,
                ac=tuple(args.ac or AC_CHOICES), compile=args.compile,
                precision=args.precision, float8=args.float8, keep_all=args.json,
            )  # fmt: skip
        seconds = time.perf_counter() - start
    except SlapoError as exc:
        print(f"slapo plan: {exc}", file=sys.stderr)
        return 2
    fitting = [p for p in plans if p.fits]
    if args.json:
        print(json.dumps([p.as_dict(cluster) for p in plans], indent=2))
    else:
        _print(args, cluster, model_dir, plans, fitting, seconds)
    return 0 if fitting else 1


def _print(
    args: argparse.Namespace, cluster: ClusterSpec, model_dir: str,
    plans: list[PlannedLayout], fitting: list[PlannedLayout], seconds: float,
) -> None:  # fmt: skip
    dev = cluster.device
    print(
        f"{model_dir} on {args.gpus} x {dev.name} ({format_bytes(dev.hbm_gib * 2**30)}, "
        f"{cluster.gpus_per_node} per node, {cluster.inter_node_gbps:g} GB/s per GPU between "
        f"nodes), sequence {args.seq_len}, {args.precision}"
        + (", compiled" if args.compile else "") + (", float8 matmuls" if args.float8 else "")
    )  # fmt: skip
    what = "the layout given" if args.layout else f"{len(fitting)} layouts fit"
    print(f"{what}; predicted in {seconds:.1f} s\n")
    shown = (fitting or plans)[: args.top]
    for i, plan in enumerate(shown, 1):
        p = plan.prediction
        mark = "" if plan.fits else "  DOES NOT FIT"
        print(f"{i}. {plan}{mark}")
        print("   time:   " + ", ".join(f"{k} {v:.2f}s" for k, v in p.top_terms(4)))
        top_memory = sorted(p.memory_terms.items(), key=lambda kv: -kv[1])[:4]
        print("   memory: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in top_memory))
        print(f"   {plan.command(cluster)}\n")
    if args.float8:
        print("float8: slapo train does not train in float8 yet; the commands run bf16 matmuls")
    if not fitting:
        print(f"no layout fits {format_bytes(dev.hbm_gib * 2**30)} per GPU, nor RoundPipe's "
              f"model state in {format_bytes(cluster.host_gib * 2**30)} of host memory "
              "(--host-gib): more GPUs, a shorter sequence or a smaller global batch")  # fmt: skip

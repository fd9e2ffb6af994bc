"""The main job: train a small transformers model on the embedded corpus with a ready schedule.

Run it as ``slapo train`` (or ``python -m slapo train``); ``slapo train --help`` lists the options.
Under ``torchrun --nproc-per-node N`` it runs tensor (``--tp``), data (``--target ddp|fsdp``) or
pipeline (``--target pipeline --num-stages N``) parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .build import build
from .data import VOCAB_SIZE, ByteBatches, MaskedByteBatches, default_corpus
from .exceptions import SlapoError, TargetError
from .schedule import Schedule, create_schedule

__all__ = ["TrainConfig", "train", "build_model", "default_schedule", "add_parser", "MODELS"]

MODELS = ("llama", "gpt2", "bert", "opt", "t5")
TARGETS = ("eager", "ddp", "fsdp", "pipeline", "roundpipe")
CAUSAL = ("llama", "gpt2", "opt")

# name -> (hidden, layers, heads, kv heads, intermediate)
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (128, 4, 4, 2, 352),
    "small": (256, 6, 8, 4, 688),
    "base": (512, 8, 8, 4, 1376),
}


@dataclass
class TrainConfig:
    """Options of the main job; every field is a ``slapo train --flag``."""

    model: str = "llama"
    preset: str = "tiny"
    steps: int = 500  # about a minute on 2 idle CPU cores (measured: 200 steps in 21 s)
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    seed: int = 0
    # the schedule's knobs (slapo.model_schedule.apply_schedule)
    ckpt_ratio: float = 0.5
    attn_op: str | None = None
    fuse_ops: bool = False
    fused_loss: bool = False
    sequence_parallel: bool = False
    tp: int = 1
    num_stages: int = 1
    target: str = "eager"
    num_microbatches: int = 2
    # the run
    compare: bool = False
    unscheduled: bool = False
    output_dir: str | None = None
    save: str | None = None
    resume: str | None = None
    progress: bool = True


def build_model(cfg: TrainConfig) -> nn.Module:
    """A ``cfg.model`` model of size ``cfg.preset`` from a config, with random weights.

    Example:
        >>> model = build_model(TrainConfig(model="gpt2", preset="tiny"))
    """
    import transformers as tf

    if cfg.model not in MODELS:
        raise SlapoError(f"model must be one of {MODELS}, got {cfg.model!r}")
    if cfg.preset not in PRESETS:
        raise SlapoError(f"preset must be one of {sorted(PRESETS)}, got {cfg.preset!r}")
    hidden, layers, heads, kv_heads, inter = PRESETS[cfg.preset]
    # use_cache=False: training reads no key/value cache (checkpointed layers run without one).
    positions = max(cfg.seq_len, 128)
    if cfg.model == "llama":
        config = tf.LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=positions, tie_word_embeddings=True, use_cache=False,
        )  # fmt: skip
        return tf.LlamaForCausalLM(config)
    if cfg.model == "gpt2":
        config = tf.GPT2Config(
            vocab_size=VOCAB_SIZE, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=inter,
            n_positions=positions, bos_token_id=0, eos_token_id=0, use_cache=False,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(config)
    if cfg.model == "opt":
        config = tf.OPTConfig(
            vocab_size=VOCAB_SIZE, hidden_size=hidden, ffn_dim=inter, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=positions,
            word_embed_proj_dim=hidden, bos_token_id=0, eos_token_id=0, pad_token_id=1,
            use_cache=False,
        )  # fmt: skip
        return tf.OPTForCausalLM(config)
    if cfg.model == "bert":
        config = tf.BertConfig(
            vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, intermediate_size=inter, max_position_embeddings=positions,
            use_cache=False,
        )  # fmt: skip
        return tf.BertForMaskedLM(config)
    config = tf.T5Config(  # half the layers in the encoder, half in the decoder
        vocab_size=VOCAB_SIZE, d_model=hidden, d_kv=hidden // heads, d_ff=inter,
        num_layers=max(layers // 2, 1), num_heads=heads, decoder_start_token_id=0, pad_token_id=0,
        use_cache=False,
    )  # fmt: skip
    return tf.T5ForConditionalGeneration(config)


def default_schedule(model: nn.Module, ckpt_ratio: float = 0.5, **knobs: Any) -> Schedule:
    """The model's ready schedule (``slapo.model_schedule``), checkpointing ``ckpt_ratio``."""
    from .model_schedule import apply_schedule

    try:
        return apply_schedule(model, ckpt_ratio=ckpt_ratio, **knobs)
    except SlapoError as exc:
        if "ckpt_ratio" in str(exc):
            raise ValueError(str(exc)) from exc
        raise


# ----- memory -------------------------------------------------------------------------------
class PeakMemory:
    """Peak tensor memory of a training run, comparable between runs in one process.

    On CUDA, the allocator's peak. On CPU (where the process's resident size keeps what an earlier
    run freed), the model state (parameters, gradients, optimizer state) plus the most bytes saved
    for backward in one step, counted with ``saved_tensors_hooks``; a checkpointed block's inner
    tensors are recomputed in backward and so not counted.

    Example:
        >>> with PeakMemory(model, optimizer) as mem:
        ...     model(**batch).loss.backward(); mem.next_step()
        >>> mem.peak_mb > 0
        True
    """

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self.peak_mb = self.activation_mb = 0.0
        self._step_bytes = 0
        self._seen: set[int] = set()
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        t = _local(t)
        ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
        if ptr not in self._seen and ptr not in self._params:
            self._seen.add(ptr)
            self._step_bytes += t.untyped_storage().nbytes()
        return t

    def next_step(self) -> None:
        """Close one step: keep its saved bytes if they are the most so far."""
        self.activation_mb = max(self.activation_mb, self._step_bytes / 2**20)
        self._step_bytes = 0
        self._seen.clear()

    def __enter__(self) -> PeakMemory:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated() / 2**20
            return self
        self._params = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if torch.cuda.is_available():
            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20 - self._base
            return
        self._hooks.__exit__(*exc)
        self.next_step()
        state = sum(2 * _local(p).numel() * p.element_size() for p in self.model.parameters())
        for per_param in getattr(self.optimizer, "state", {}).values():
            state += sum(_local(v).numel() * v.element_size() for v in per_param.values()
                         if isinstance(v, torch.Tensor))  # fmt: skip
        self.peak_mb = state / 2**20 + self.activation_mb


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 and tensor-parallel parameters), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


# ----- distributed layout ---------------------------------------------------------------------
@dataclass
class Layout:
    """How this process takes part: tensor-parallel group, data-parallel rank and size."""

    rank: int = 0
    world: int = 1
    tp_group: Any = None
    dp_group: Any = None
    dp_rank: int = 0
    dp_size: int = 1


def setup_layout(cfg: TrainConfig) -> Layout:
    """Start the process group under torchrun and split the ranks into (dp, tp)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.target in ("ddp", "fsdp", "pipeline") or world > 1 or cfg.tp > 1:
        from . import env

        env.setup()
        world = dist.get_world_size()
    if world == 1:
        if cfg.tp > 1:
            raise SlapoError(f"--tp {cfg.tp} needs {cfg.tp} processes: torchrun --nproc-per-node")
        return Layout()
    if world % cfg.tp:
        raise SlapoError(f"--tp {cfg.tp} does not divide the {world} processes")
    rank = dist.get_rank()
    if cfg.target == "pipeline":
        if cfg.tp > 1:
            raise SlapoError("--target pipeline with --tp is not wired in slapo train")
        return Layout(rank, world)
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"] if cfg.tp > 1 else None
    dp_rank = mesh["dp"].get_local_rank()
    return Layout(rank, world, tp, mesh["dp"], dp_rank, world // cfg.tp)


# ----- one run ----------------------------------------------------------------------------------
def _batches(cfg: TrainConfig, layout: Layout) -> ByteBatches:
    cls = MaskedByteBatches if cfg.model == "bert" else ByteBatches
    # each data-parallel rank draws its own batches; tensor-parallel peers draw the same ones
    return cls(default_corpus(), cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1000 * layout.dp_rank)


def _schedule(cfg: TrainConfig, model: nn.Module, layout: Layout, scheduled: bool) -> Schedule:
    if not scheduled:
        return create_schedule(model)
    knobs = {
        "attn_op": cfg.attn_op, "fuse_ops": cfg.fuse_ops, "fused_loss": cfg.fused_loss,
        "sequence_parallel": cfg.sequence_parallel, "num_stages": cfg.num_stages,
    }  # fmt: skip
    if layout.tp_group is not None:
        knobs["group"] = layout.tp_group
    return default_schedule(model, cfg.ckpt_ratio, **knobs)


def _causal_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class Runner:
    """A built model and its optimizer with one ``step(batch) -> loss`` for every target."""

    def __init__(self, cfg: TrainConfig, layout: Layout, scheduled: bool) -> None:
        self.cfg, self.layout = cfg, layout
        torch.manual_seed(cfg.seed)  # the same initial weights for every run and every rank
        model = build_model(cfg)
        model.train()
        self.sch = _schedule(cfg, model, layout, scheduled)
        opt = {"optimizer": torch.optim.AdamW, "optimizer_kwargs": {"lr": cfg.lr}}
        target = cfg.target if cfg.target != "eager" else None
        if cfg.target in ("ddp", "fsdp"):
            opt["group"] = layout.dp_group
        if cfg.target == "pipeline":
            if cfg.model not in CAUSAL:
                raise TargetError(f"--target pipeline supports {CAUSAL} in slapo train, not {cfg.model}")
            if cfg.num_stages < 2:
                raise TargetError("--target pipeline needs --num-stages 2 or more")
            ids = torch.zeros(cfg.batch_size, cfg.seq_len, dtype=torch.long)
            opt.update(
                schedule="1F1B", num_microbatches=cfg.num_microbatches, loss_fn=_causal_loss,
                example_inputs=(ids,),
            )  # fmt: skip
        self.model, self.optimizer = build(self.sch, target=target, init_weights=False, **opt)
        self.sp = scheduled and cfg.sequence_parallel and layout.tp_group is not None

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        if self.cfg.target == "pipeline":
            ids, labels = batch["input_ids"], batch["labels"]
            shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
            loss = self.model.step(ids, target=shifted)
        else:
            loss = self.model(**batch).loss
            loss.backward()
            if self.sp:
                from .sharding import allreduce_sequence_parallel_grads

                allreduce_sequence_parallel_grads(self.model, self.layout.tp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def _checkpoint_path(path: str, layout: Layout) -> Path:
    p = Path(path)
    return p if layout.world == 1 else p.with_name(f"{p.name}.rank{layout.rank}")


def save_state(path: Path, runner: Runner, batches: ByteBatches, record: dict[str, Any]) -> None:
    """Model, optimizer, data generator, RNG and the curve so far, written atomically, no pickle.

    ``path`` becomes a directory (``slapo.checkpoint_io.save_tree``): the model's tensors in
    ``model.safetensors`` under their state-dict names (with ``config.json``), the optimizer, data
    generator and RNG state (a uint8 tensor) in ``state.safetensors``, the loss record and the
    hyperparameters in JSON. A DTensor (FSDP2) is stored as this rank's part.
    """
    from .checkpoint_io import save_tree

    state = {
        "model": runner.model.state_dict(),
        "optimizer": runner.optimizer.state_dict(),
        "data": batches.state_dict(),
        "rng": torch.get_rng_state(),
        "record": record,
    }
    save_tree(path, state, config=getattr(runner.model, "config", None))


def load_state(path: Path, runner: Runner, batches: ByteBatches) -> dict[str, Any]:
    """Restore what :func:`save_state` wrote into ``runner`` and ``batches``; returns the record.

    Reads only JSON and safetensors. DTensor entries are rebuilt like the live model's.
    """
    from itertools import chain

    from .checkpoint_io import CheckpointError, dtensor_like, load_tree

    try:
        state = load_tree(path)
    except CheckpointError as err:
        raise CheckpointError(f"--resume {path}: {err}") from err
    absent = [k for k in ("model", "optimizer", "data", "rng", "record") if k not in state]
    if absent:
        raise CheckpointError(
            f"--resume {path} holds no {absent}: not a `slapo train --save` state"
        )
    try:
        live = runner.model.state_dict()
        model_state = {k: dtensor_like(v, live.get(k)) for k, v in state["model"].items()}
        optim_state = state["optimizer"]
        saved_ids = chain.from_iterable(g["params"] for g in optim_state.get("param_groups", []))
        params = chain.from_iterable(g["params"] for g in runner.optimizer.param_groups)
        by_id = dict(zip(saved_ids, params))
        for i, per_param in optim_state.get("state", {}).items():
            for key, value in per_param.items():  # exp_avg & co. are laid out like the parameter
                per_param[key] = dtensor_like(value, by_id.get(i))
        runner.model.load_state_dict(model_state)
        runner.optimizer.load_state_dict(optim_state)
        batches.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"--resume {path} does not fit this run (saved with other options?): {err}"
        ) from err
    return state["record"]


def run_once(cfg: TrainConfig, layout: Layout, scheduled: bool, label: str) -> dict[str, Any]:
    """Train one model (the scheduled or the unscheduled one); returns its record."""
    runner = Runner(cfg, layout, scheduled)
    batches = _batches(cfg, layout)
    record: dict[str, Any] = {"losses": [], "step_tokens_per_s": [], "seconds": 0.0}
    if cfg.resume:
        record = load_state(_checkpoint_path(cfg.resume, layout), runner, batches)
    tokens = cfg.batch_size * cfg.seq_len * layout.dp_size
    start = len(record["losses"])
    progress = _progress(cfg.steps, start, cfg.progress and layout.rank == 0, label)
    with PeakMemory(runner.model, runner.optimizer) as mem:
        t_run = time.perf_counter()
        for _ in range(start, cfg.steps):
            t0 = time.perf_counter()
            record["losses"].append(runner.step(batches.next()))
            mem.next_step()
            record["step_tokens_per_s"].append(tokens / (time.perf_counter() - t0))
            progress.set_postfix(
                loss=f"{record['losses'][-1]:.3f}", tok_s=f"{record['step_tokens_per_s'][-1]:,.0f}"
            )
            progress.update()
        record["seconds"] += time.perf_counter() - t_run
    progress.close()
    if cfg.save:
        save_state(_checkpoint_path(cfg.save, layout), runner, batches, record)
    losses = record["losses"]
    return {
        "label": label,
        "parameters": sum(p.numel() for p in runner.model.parameters()),
        "primitives": [str(r) + f" @ {r.path}" for r in runner.sch.metadata.primitives],
        "checkpointed_layers": sum(r.name == "checkpoint" for r in runner.sch.metadata.primitives),
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": sum(losses[-10:]) / max(len(losses[-10:]), 1),
        "tokens_per_s": _tokens_per_s(record["step_tokens_per_s"]),
        "peak_memory_mb": mem.peak_mb,
        "activation_mb": mem.activation_mb,
        "seconds": record["seconds"],
        "losses": losses,
        "step_tokens_per_s": record["step_tokens_per_s"],
    }


def _tokens_per_s(step_tps: list[float]) -> float:
    """Tokens/s over the steps after the first (which pays one-time warm-up costs)."""
    steady = step_tps[1:] or step_tps
    if not steady:
        return 0.0
    return len(steady) / sum(1.0 / x for x in steady)  # total tokens / total time, per step


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train and return a summary: per-step losses, tokens/s, peak memory (and the baseline's,
    with ``compare``).

    Example:
        >>> summary = train(TrainConfig(steps=3, batch_size=2, seq_len=16, progress=False))
        >>> len(summary["losses"])
        3
    """
    _check(cfg)
    started_group = not dist.is_initialized()
    try:
        layout = setup_layout(cfg)
        runs = []
        if cfg.compare:
            runs.append(run_once(replace(cfg, save=None), layout, scheduled=False, label="unscheduled"))
        runs.append(run_once(cfg, layout, scheduled=not cfg.unscheduled, label="scheduled"))
    finally:
        if started_group and dist.is_initialized():  # leave the process as we found it
            from . import env

            env.teardown()
    summary = {"config": asdict(cfg), "world_size": layout.world, **runs[-1]}
    if cfg.compare:
        summary["baseline"] = runs[0]
    if cfg.output_dir and layout.rank == 0:
        write_outputs(Path(cfg.output_dir), summary, runs)
    return summary


def _check(cfg: TrainConfig) -> None:
    for name in ("steps", "batch_size", "seq_len", "tp", "num_stages", "num_microbatches"):
        if getattr(cfg, name) <= 0:
            raise SlapoError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if cfg.model not in MODELS:
        raise SlapoError(f"--model must be one of {MODELS}, got {cfg.model!r}")
    if cfg.target not in TARGETS:
        raise SlapoError(f"--target must be one of {TARGETS}, got {cfg.target!r}")
    if cfg.compare and (cfg.save or cfg.resume):
        raise SlapoError("--compare trains two models; run --save/--resume without it")
    if cfg.target == "pipeline" and (cfg.save or cfg.resume):
        raise SlapoError("--save/--resume are not wired for --target pipeline yet")


def write_outputs(out: Path, summary: dict[str, Any], runs: list[dict[str, Any]]) -> Path | None:
    """Write ``metrics.json`` (atomically, first) and then ``loss.png`` into ``out``.

    Returns the plot's path, or None when it was skipped. The plot never costs a run its
    results: without matplotlib (or if drawing fails) one line on stderr says why and how to
    get it, and the metrics are already on disk.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp())
        >>> s = {"config": {"model": "llama", "preset": "tiny"}, "losses": [2.0, 1.5]}
        >>> write_outputs(out, s, [{"label": "scheduled", "losses": [2.0, 1.5]}]).name
        'loss.png'
    """
    import sys

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "metrics.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "metrics.json")
    plot = out / "loss.png"
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(
            f"slapo train: skipped {plot}: matplotlib is not installed (pip install matplotlib); "
            f"the metrics are in {out / 'metrics.json'}",
            file=sys.stderr,
        )
        return None
    try:
        # A bare Figure on an Agg canvas: no pyplot state, no display, the caller's backend kept.
        fig = Figure(figsize=(6, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for run in runs:
            ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=run["label"])
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"slapo train: {summary['config']['model']} ({summary['config']['preset']})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, format="png")
    except Exception as exc:  # noqa: BLE001  (the plot is a by-product; the metrics are safe)
        print(
            f"slapo train: skipped {plot}: drawing it failed ({type(exc).__name__}: {exc}); "
            f"the metrics are in {out / 'metrics.json'}",
            file=sys.stderr,
        )
        return None
    return plot


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run table; with ``--compare``, the baseline and the scheduled run side by side."""
    runs = [summary["baseline"], summary] if "baseline" in summary else [summary]
    cfg = summary["config"]

    def cells(run: dict[str, Any]) -> list[str]:
        return [
            f"{run['parameters']:,}",
            str(run["checkpointed_layers"]),
            f"{run['first_loss']:.3f} -> {run['final_loss']:.3f}",
            f"{run['tokens_per_s']:,.0f}",
            f"{run['peak_memory_mb']:,.1f}",
            f"{run['activation_mb']:,.1f}",
            f"{run['seconds']:.1f}",
        ]

    names = [
        "parameters", "checkpointed layers", "loss (first -> last 10 mean)", "tokens/s",
        "peak memory (MiB)", "  of which saved activations", "time (s)",
    ]  # fmt: skip
    cols = [cells(r) for r in runs]
    header = [""] + [("unscheduled" if i == 0 and len(runs) > 1 else "scheduled") for i in range(len(runs))]
    width = max(len(n) for n in names)
    colw = [max(len(header[j + 1]), *(len(cell) for cell in col)) for j, col in enumerate(cols)]
    lines = [
        "",
        f"slapo train: {cfg['model']} ({cfg['preset']}), {cfg['steps']} steps, target "
        f"{cfg['target']}, {summary['world_size']} process(es)",
        "-" * (width + 2 + sum(w + 2 for w in colw)),
        f"{'':<{width}}  " + "  ".join(f"{h:>{w}}" for h, w in zip(header[1:], colw)),
    ]
    for i, name in enumerate(names):
        lines.append(f"{name:<{width}}  " + "  ".join(f"{c[i]:>{w}}" for c, w in zip(cols, colw)))
    if len(runs) > 1 and runs[0]["tokens_per_s"]:
        ratio = runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"]
        lines.append(f"{'scheduled / unscheduled tokens/s':<{width}}  {ratio:.2f}x")
    return "\n".join(lines)


def _progress(total: int, done: int, enabled: bool, label: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total, initial=done, desc=label, unit="step", disable=not enabled, dynamic_ncols=True
    )


# ----- command line -------------------------------------------------------------------------------
def _flag_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _attn_op(text: str) -> str | None:
    return None if text.lower() in ("none", "model") else text


def add_parser(subparsers: Any) -> None:
    """Register ``slapo train`` on an argparse subparsers object."""
    d = TrainConfig()
    p = subparsers.add_parser(
        "train", help="train a small transformers model on the embedded corpus with a schedule",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--model", choices=MODELS, default=d.model, help="model family")
    p.add_argument("--preset", choices=sorted(PRESETS), default=d.preset, help="model size")
    p.add_argument("--steps", type=int, default=d.steps, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    k = p.add_argument_group("schedule knobs (slapo.model_schedule.apply_schedule)")
    k.add_argument("--ckpt-ratio", type=float, default=d.ckpt_ratio, help="fraction of blocks checkpointed")
    k.add_argument("--attn-op", type=_attn_op, default=d.attn_op, help="eager, sdpa, flash (CUDA) or none")
    for name, text in (
        ("fuse-ops", "fuse bias+GELU / bias+dropout+residual"),
        ("fused-loss", "chunked LM head + cross-entropy"),
        ("sequence-parallel", "sequence parallelism with --tp (gpt2)"),
    ):
        k.add_argument(f"--{name}", type=_flag_bool, nargs="?", const=True, default=False, help=text)
    k.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (under torchrun)")
    k.add_argument("--num-stages", type=int, default=d.num_stages, help="pipeline stages")
    p.add_argument("--target", choices=TARGETS, default=d.target, help="build target")
    p.add_argument("--num-microbatches", type=int, default=d.num_microbatches, help="pipeline only")
    p.add_argument("--compare", action="store_true", help="also train the unscheduled baseline")
    p.add_argument("--unscheduled", action="store_true", help="train without the schedule")
    p.add_argument("--output-dir", default=None, help="write metrics.json and loss.png there")
    p.add_argument("--save", default=None, help="write a checkpoint there at the end")
    p.add_argument("--resume", default=None, help="continue from a --save checkpoint up to --steps")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument(
        "--json", action="store_true",
        help='end with one JSON line {"throughput": tokens/s, ...} (what `slapo tune` reads)',
    )  # fmt: skip
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    fields = TrainConfig.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields}
    cfg = TrainConfig(**values, progress=not args.no_progress)
    try:
        summary = train(cfg)
    except SlapoError as exc:
        raise SystemExit(f"slapo train: {exc}") from exc
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if summary["world_size"] == 1 or int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(summary))
        if args.json:
            keys = ("final_loss", "peak_memory_mb", "tokens_per_s")
            print(json.dumps({"throughput": summary["tokens_per_s"], **{k: summary[k] for k in keys}}))
    return 0

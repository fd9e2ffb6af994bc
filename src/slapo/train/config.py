"""The options of the main job: one dataclass whose fields are the ``slapo train`` flags.

Each field carries its help text and constraints in ``metadata`` (see :func:`option`); the
command line (``slapo.train.train_cli``) and :meth:`TrainConfig.check` are generated from them.

Example:
    >>> cfg = TrainConfig(model="gpt2", steps=3)
    >>> cfg.check()
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..exceptions import InputError
from ..model_schedule import ATTN_OPS, CKPT_POLICIES, Knobs
from ..precision import DEVICES, PRECISIONS
from ..primitives.compile_rng import RNG_MODES
from .presets import MODELS, PRESETS
from .uses import DEFAULT_TARGET, target_choices

#: ``--lr-schedule``: what the learning rate does after the warmup.
LR_SCHEDULES = ("constant", "cosine", "linear")

__all__ = [
    "LR_SCHEDULES",
    "PIPELINE_SCHEDULES",
    "SCHEDULE_KNOBS",
    "InputError",
    "TrainConfig",
    "knob_fields",
    "option",
    "parse_attn_op",
]

#: ``--pipeline-schedule``: the torch.distributed.pipelining schedules of one stage per rank.
PIPELINE_SCHEDULES = ("1F1B", "GPipe")
SCHEDULE_KNOBS = "schedule knobs (slapo.model_schedule.apply_schedule)"


def knob_fields() -> tuple[str, ...]:
    """The :class:`TrainConfig` fields that are knobs of the ready schedules
    (:class:`slapo.model_schedule.Knobs`'s fields, under the same names); a None value means
    the family's recommended one.

    Example:
        >>> knob_fields()[:2]
        ('ckpt_ratio', 'ckpt_policy')
    """
    knobs = Knobs.__dataclass_fields__
    return tuple(f.name for f in fields(TrainConfig) if f.name in knobs)


def parse_attn_op(text: str) -> str:
    """``--attn-op``: ``none`` (or ``model``) keeps the model's own attention.

    Example:
        >>> parse_attn_op("none"), parse_attn_op("sdpa")
        ('model', 'sdpa')
    """
    return "model" if text.lower() in ("none", "model") else text


def option(
    default: Any,
    help: str,  # noqa: A002  (argparse's name for it)
    *,
    choices: tuple[str, ...] | list[str] | None = None,
    group: str | None = None,
    parse: Any = None,
    positive: bool = False,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A :class:`TrainConfig` field and its flag: ``help`` text, allowed ``choices``, the
    argparse ``group`` it is listed under, a ``parse`` function for the flag's text (default: the
    field's type), whether it must be ``positive``, and older spellings of the flag (``aliases``). A bool field defaulting to True becomes a
    ``--no-<name>`` flag whose ``help`` says what it turns off.

    Example:
        >>> steps: int = option(500, "total optimizer steps", positive=True)
    """
    meta = {
        "help": help, "choices": choices, "group": group, "parse": parse, "positive": positive,
        "aliases": aliases,
    }  # fmt: skip
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Options of the main job; every field is a ``slapo train --flag`` (``--batch-size`` for
    ``batch_size``; ``--no-progress`` for ``progress``).

    Example:
        >>> from slapo.train import train
        >>> # three real training steps take 10-30 seconds on a laptop CPU: not run by the test suite
        >>> summary = train(TrainConfig(steps=3, batch_size=2, seq_len=16, progress=False))  # doctest: +SKIP
    """

    model: str = option(
        "llama", f"a model family ({', '.join(MODELS)}), a transformers causal-LM model type "
        "(e.g. phi3, qwen3: a --preset sized model) or a local model directory (config.json and "
        "safetensors weights, as save_pretrained writes them)",
    )  # fmt: skip
    preset: str = option("tiny", "model size", choices=sorted(PRESETS))
    # about a minute on 2 idle CPU cores (measured: 200 steps in 21 s)
    steps: int = option(500, "total optimizer steps", positive=True)
    batch_size: int = option(8, "per data-parallel rank", positive=True)
    seq_len: int = option(128, "tokens per sequence", positive=True)
    lr: float = option(3e-3, "AdamW learning rate")
    seed: int = option(0, "seed of the weights and the data")
    # where and in what precision (slapo.precision): resolved once per run (slapo.train.run)
    device: str = option(
        "auto", "where the model trains: auto is cuda:LOCAL_RANK where a GPU is, else the CPU "
        "(NCCL between GPUs, gloo between CPU processes)", choices=DEVICES,
    )  # fmt: skip
    precision: str | None = option(
        None, "fp32, or mixed precision with bf16 or fp16 compute (float32 master weights and "
        "optimizer state; fp16 scales the loss). Default: bf16 on a GPU that has it, else fp32",
        choices=PRECISIONS,
    )  # fmt: skip
    peak_tflops: float | None = option(
        None, "the device's peak dense TFLOPS in the run's precision, for MFU (default: a table "
        "of common GPUs; none on the CPU)",
    )  # fmt: skip
    # the data (slapo.train.token_cache): the embedded corpus unless --data names files
    data: str | None = option(
        None, "train on a .txt, .jsonl or .parquet file, or a directory of them, tokenized once "
        "and cached beside it (default: the embedded corpus)",
    )  # fmt: skip
    data_field: str = option("text", "the text field of --data's .jsonl records / parquet column")
    tokenizer: str | None = option(
        None, "a tokenizer directory (default: the model directory's, else one token per byte)"
    )
    # the schedule's knobs (slapo.model_schedule.apply_schedule); None: the family's
    # recommended value (slapo.model_schedule.recommended_knobs, see schedule_knobs)
    ckpt_ratio: float | None = option(
        None, "fraction of blocks checkpointed (default: recommended)", group=SCHEDULE_KNOBS
    )
    ckpt_policy: str | None = option(
        None, "how a checkpointed block recomputes: full, or a selective policy (default: "
        "recommended)", group=SCHEDULE_KNOBS, choices=CKPT_POLICIES,
    )  # fmt: skip
    compile_blocks: bool | None = option(
        None, "compile each block with inductor (default: recommended)", group=SCHEDULE_KNOBS
    )
    compile_model: bool | None = option(
        None, "compile the whole model (default: recommended on --target eager)",
        group=SCHEDULE_KNOBS,
    )  # fmt: skip
    compile_rng: str | None = option(
        None, "where compiled dropout draws its masks (bulk: cheap masks; default: recommended)",
        group=SCHEDULE_KNOBS, choices=RNG_MODES,
    )  # fmt: skip
    attn_op: str | None = option(
        None, "the attention kernel (flash: CUDA; none or model: the model's own; default: "
        "recommended)", group=SCHEDULE_KNOBS, parse=parse_attn_op, choices=("model", *ATTN_OPS),
    )  # fmt: skip
    fuse_ops: bool | None = option(
        None, "fuse bias+GELU / bias+dropout+residual (default: recommended)",
        group=SCHEDULE_KNOBS,
    )  # fmt: skip
    fused_loss: bool | None = option(
        None, "chunked LM head + cross-entropy (default: recommended)", group=SCHEDULE_KNOBS
    )
    sequence_parallel: bool = option(False, "sequence parallelism with --tp", group=SCHEDULE_KNOBS)
    tp: int = option(
        1, "tensor-parallel size (under torchrun)", group=SCHEDULE_KNOBS, positive=True
    )
    pp: int = option(
        1, "pipeline-parallel stages (under torchrun; --num-stages is the older spelling); the "
        "processes left over form data-parallel replicas: dp = N / (tp * pp)",
        group=SCHEDULE_KNOBS, positive=True, aliases=("--num-stages",),
    )  # fmt: skip
    cp: int = option(
        1, "context-parallel size (under torchrun): each rank holds 1/cp of every sequence and "
        "attention gathers keys and values over the cp group; dp = N / (tp * pp * cp)",
        group=SCHEDULE_KNOBS, positive=True,
    )  # fmt: skip
    ep: int = option(
        1, "expert-parallel size (under torchrun): the experts of each MoE layer split over ep "
        "ranks borrowed from dp x cp (ep divides dp * cp and is a multiple of cp)",
        group=SCHEDULE_KNOBS, positive=True,
    )  # fmt: skip
    target: str = option(
        DEFAULT_TARGET, "build target; with torchrun's processes beyond --tp x --pp, the "
        "data-parallel engine of the replicas: eager and ddp average whole replicas' gradients, "
        "fsdp shards them (FSDP2)", choices=target_choices(),
    )  # fmt: skip
    num_microbatches: int = option(2, "microbatches per step of a pipeline (--pp)", positive=True)
    pipeline_schedule: str = option(
        "1F1B", "the pipeline's schedule: 1F1B keeps fewer microbatches' activations in flight "
        "than GPipe", choices=PIPELINE_SCHEDULES,
    )  # fmt: skip
    # the run
    compare: bool = option(False, "train the unscheduled baseline for all --steps")
    baseline_steps: int = option(
        20, "steps of the unscheduled baseline measured first, beside the scheduled run (0: none)"
    )
    unscheduled: bool = option(False, "train without the schedule")
    output_dir: str | None = option(
        None, "write metrics.json and loss.png there (slapo train: runs/<model>-<time> if not set)"
    )
    sample: bool = option(True, "skip the text the trained model generates at the end")
    # the optimizer's learning rate over the steps (slapo.train.lr_schedule)
    lr_schedule: str = option(
        "constant", "the learning rate after the warmup: cosine or linear decay to 0 at --steps, "
        "or constant", choices=LR_SCHEDULES,
    )  # fmt: skip
    warmup_steps: int = option(0, "steps of linear warmup to --lr")
    # checkpoints (slapo.train.state)
    save: str | None = option(
        None, "write a Hugging Face model directory there at the end (from_pretrained loads "
        "it; with the tokenizer of the run) and the training state --resume continues from",
    )  # fmt: skip
    save_every: int | None = option(
        None, "also save every N steps into --save's DIR/step-NNNNNN", positive=True
    )
    keep: int = option(3, "the --save-every checkpoints kept (the latest)", positive=True)
    resume: str | None = option(
        None, "continue exactly from a --save directory (or the latest DIR/step-NNNNNN in it) "
        "up to --steps",
    )  # fmt: skip
    # evaluation (slapo.train.evaluation)
    eval_data: str | None = option(
        None, "held-out data (as --data) whose loss and perplexity are measured"
    )
    eval_fraction: float | None = option(
        None, "hold out this fraction (0 to 1) of the end of the training data for evaluation"
    )
    eval_every: int | None = option(
        None, "evaluate every N steps too (always: after the last step)", positive=True
    )
    tensorboard: bool = option(True, "write no TensorBoard event files into the run directory")
    progress: bool = option(True, "hide the progress bar")

    @property
    def num_stages(self) -> int:
        """The pipeline stages (``--pp``; ``--num-stages`` is its older spelling)."""
        return self.pp

    def check(self) -> None:
        """Raise an :class:`InputError` naming the flag of the first option out of its range.

        Example:
            >>> TrainConfig(steps=0).check()
            Traceback (most recent call last):
            slapo.exceptions.InputError: --steps must be positive, got 0
        """
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            flag = "--" + f.name.replace("_", "-")
            if meta.get("positive") and value is not None and value <= 0:
                raise InputError(f"{flag} must be positive, got {value}")
            choices = meta.get("choices")
            if choices is not None and value is not None and value not in choices:  # None: default
                raise InputError(f"{flag} must be one of {meta['choices']}, got {value!r}")
        if self.baseline_steps < 0:
            raise InputError(f"--baseline-steps must be 0 or more, got {self.baseline_steps}")
        if self.compare and (self.save or self.resume):
            raise InputError("--compare trains two models; run --save/--resume without it")
        self._check_run_options()

    def _check_run_options(self) -> None:
        """The checkpoint, learning-rate and evaluation flags, alone and together."""
        if self.warmup_steps < 0:
            raise InputError(f"--warmup-steps must be 0 or more, got {self.warmup_steps}")
        if self.save_every is not None and not self.save:
            raise InputError(
                f"--save-every {self.save_every} needs --save DIR: the directory the "
                "checkpoints go into"
            )
        fraction = self.eval_fraction
        if fraction is not None and not 0 < fraction < 1:
            raise InputError(f"--eval-fraction must be between 0 and 1 (e.g. 0.05), got {fraction}")
        if fraction is not None and self.eval_data is not None:
            raise InputError("--eval-data and --eval-fraction both name eval data; pass one")
        if self.eval_every is not None and self.eval_data is None and fraction is None:
            raise InputError(
                f"--eval-every {self.eval_every} needs eval data: --eval-data PATH or "
                "--eval-fraction F"
            )

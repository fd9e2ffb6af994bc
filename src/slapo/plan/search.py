"""``plan_layouts``: every layout of a model on a cluster, predicted, the ones that fit ranked.

A layout is what ``slapo train`` runs (a :class:`~slapo.train.TrainConfig`) on ``dp`` replicas:
tensor parallelism within a node, pipeline stages (1F1B, microbatches of one sequence),
context parallelism, expert parallelism for a mixture-of-experts model, the data-parallel engine
(FSDP2 or DDP) and the activation checkpointing (none, a selective policy, or full recompute of
every block). Each is predicted by :func:`predict_config` (memory and step time, from fake steps
of two and three layers: :mod:`slapo.plan.profile`), those that do not fit the device are dropped
and the rest ranked by tokens/s per GPU.

Two rules keep the search short without losing its best answers:

* a layout whose parameters, gradients and optimizer state alone exceed the device is dropped
  before any fake step;
* of the checkpointing choices of one layout, only the fastest that fits is kept: each of
  :data:`AC_CHOICES` recomputes more than the one before it and so is slower; once one fits,
  the slower ones cannot rank higher.

Example:
    >>> import transformers
    >>> transformers.LlamaConfig(  # Llama 3 70B's sizes: config.json only, no weights
    ...     hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    ...     num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
    ... ).save_pretrained("llama3-70b-config")
    >>> from slapo.plan import PRESETS
    >>> cluster = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, inter_node_gbps=50.0)
    >>> # illustration: predicting every layout of 256 GPUs takes a minute on a CPU
    >>> best = plan_layouts("./llama3-70b-config", cluster, gpus=256, seq_len=8192,
    ...                     global_batch=256)[0]  # doctest: +SKIP
    >>> print(best.command(cluster))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..exceptions import SlapoError
from ..memory import format_bytes
from .hardware import ClusterSpec
from .profile import model_shape, profile_config, shallow_configs
from .step_time import PlanError, StepPrediction, time_step

__all__ = [
    "AC_CHOICES",
    "PlannedLayout",
    "candidate_layouts",
    "parse_layout",
    "plan_layouts",
    "predict_config",
]

#: Activation checkpointing, fastest first: ``slapo train``'s ``--ckpt-ratio``/``--ckpt-policy``.
AC_CHOICES: dict[str, dict[str, Any]] = {
    "none": {"ckpt_ratio": 0.0, "ckpt_policy": None},
    "selective": {"ckpt_ratio": 1.0, "ckpt_policy": "save_matmuls"},
    "selective-narrow": {"ckpt_ratio": 1.0, "ckpt_policy": "save_narrow_matmuls"},
    "full": {"ckpt_ratio": 1.0, "ckpt_policy": "full"},
}
#: The most pipeline stages and context-parallel ranks tried.
MAX_PP, MAX_CP = 16, 8
#: The fewest tokens of a sequence a context-parallel rank holds in a candidate: shorter chunks
#: spend more on gathering keys and values than they save (context parallelism is for long
#: sequences; an 8k sequence is tried on 2 and 4 ranks).
MIN_CP_CHUNK = 2048
#: Bytes per parameter of float32 parameters, gradients and AdamW's two moments.
_STATE_BYTES = 16


@dataclass(frozen=True)
class PlannedLayout:
    """One predicted layout.

    Attributes:
        cfg: the ``slapo train`` configuration (one data-parallel rank's ``batch_size``).
        dp: its data-parallel replicas.
        ac: its :data:`AC_CHOICES` name.
        prediction: the rank's step (:class:`~slapo.plan.step_time.StepPrediction`).
        fits: whether its memory fits the device.
    """

    cfg: Any
    dp: int
    ac: str
    prediction: StepPrediction
    fits: bool
    devices: int = 1

    @property
    def gpus(self) -> int:
        if self.cfg.target == "roundpipe":  # one process, every GPU of its node
            return self.devices
        return self.dp * self.cfg.tp * self.cfg.pp * self.cfg.cp

    def describe(self) -> str:
        """The layout in words, e.g. ``fsdp dp32 x tp8, ac selective``."""
        c = self.cfg
        if c.target == "roundpipe":
            return f"roundpipe on {self.gpus} GPU(s), ac {self.ac}, batch {c.batch_size}"
        parts = [f"dp{self.dp}"] + [
            f"{name}{size}" for name, size in (("pp", c.pp), ("cp", c.cp), ("tp", c.tp)) if size > 1
        ]
        text = f"{c.target} {' x '.join(parts)}"
        if c.ep > 1:
            text += f", ep{c.ep}"
        if c.pp > 1:
            text += f", {c.pipeline_schedule} x{c.num_microbatches}"
        return f"{text}, ac {self.ac}, batch {c.batch_size}/rank"

    def flags(self) -> list[str]:
        """``slapo train``'s flags for this layout."""
        c = self.cfg
        flags = [
            "--model", c.model, "--device", "cuda", "--precision", c.precision,
            "--seq-len", str(c.seq_len), "--batch-size", str(c.batch_size),
            "--target", c.target, "--ckpt-ratio", str(c.ckpt_ratio),
        ]  # fmt: skip
        if c.ckpt_policy:
            flags += ["--ckpt-policy", c.ckpt_policy]
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(c, name) > 1:
                flags += [f"--{name}", str(getattr(c, name))]
        if c.pp > 1:
            flags += [
                "--num-microbatches", str(c.num_microbatches),
                "--pipeline-schedule", c.pipeline_schedule,
            ]  # fmt: skip
        if c.compile_blocks:
            flags += ["--compile-blocks"]
        return flags

    def command(self, cluster: ClusterSpec) -> str:
        """The exact launch: ``torchrun`` over ``gpus`` processes, one node or several.

        Example:
            >>> from slapo.plan import PRESETS
            >>> cluster = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8)
            >>> # illustration: the plan of a 70B config over 256 GPUs takes a minute on a CPU
            >>> layout = plan_layouts("./llama3-70b-config", cluster, 256, 8192, 256)[0]  # doctest: +SKIP
            >>> layout.command(cluster)  # doctest: +SKIP
            'torchrun --nnodes 32 --nproc-per-node 8 --rdzv-backend c10d ... -m slapo train ...'
        """
        if self.cfg.target == "roundpipe":  # one process drives the node's GPUs
            return " ".join(shlex.quote(w) for w in ["slapo", "train", *self.flags()])
        per_node = min(self.gpus, cluster.gpus_per_node)
        nodes = -(-self.gpus // per_node)
        launch = ["torchrun"]
        if nodes > 1:
            launch += [
                "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "$MASTER_ADDR:29500",
            ]  # fmt: skip
        else:
            launch += ["--nproc-per-node", str(per_node)]
        words = [*launch, "-m", "slapo", "train", *self.flags()]
        return " ".join(w if w.startswith("$") else shlex.quote(w) for w in words)

    def as_dict(self, cluster: ClusterSpec | None = None) -> dict[str, Any]:
        """Everything predicted, JSON-ready."""
        p = self.prediction
        out = {
            "layout": self.describe(), "gpus": self.gpus, "dp": self.dp, "tp": self.cfg.tp,
            "pp": self.cfg.pp, "cp": self.cfg.cp, "ep": self.cfg.ep, "target": self.cfg.target,
            "ac": self.ac, "batch_size": self.cfg.batch_size,
            "num_microbatches": self.cfg.num_microbatches if self.cfg.pp > 1 else 1,
            "fits": self.fits, "memory_bytes": p.memory_bytes,
            "memory_gib": round(p.memory_bytes / 2**30, 2),
            "step_seconds": p.seconds, "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
            "mfu": p.mfu, "time_terms": dict(p.top_terms(8)), "memory_terms": p.memory_terms,
            "flags": self.flags(),
        }  # fmt: skip
        if cluster is not None:
            out["command"] = self.command(cluster)
        return out

    def __str__(self) -> str:
        p = self.prediction
        return (
            f"{self.describe()}: {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {p.mfu:.1%}, "
            f"step {p.seconds:.2f} s, memory {format_bytes(p.memory_bytes)}"
        )


def _model_config(cfg: Any) -> dict[str, Any]:
    """The raw ``config.json`` of ``cfg.model``: a model directory's, or that of the model
    ``slapo train`` builds for a family or model type (``--preset``), built on the meta device."""
    path = Path(cfg.model) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    if Path(cfg.model).exists():
        raise PlanError(
            f"--model {cfg.model!r}: no config.json there; give a config-only model directory "
            "(save_pretrained's config.json) or a model type with --size"
        )
    from ..initialization import init_empty_weights
    from ..train.presets import build_model

    with init_empty_weights():
        model = build_model(cfg, weights=False)
    return model.config.to_dict()


def _state_lower_bound(config: dict[str, Any], cfg: Any, dp: int) -> float:
    """Bytes one rank holds at least: float32 parameters, gradients and AdamW state of its
    share (an estimate from the config: the embeddings, the head and the layers' matrices)."""
    h = config["hidden_size"]
    layers = config["num_hidden_layers"]
    inter = config.get("intermediate_size") or 4 * h
    experts = config.get("num_experts") or config.get("num_local_experts") or 1
    moe_inter = config.get("moe_intermediate_size") or inter
    mlp = 3 * h * (moe_inter * experts / max(cfg.ep, 1) if experts > 1 else inter)
    per_layer = 4 * h * h + mlp
    ends = config["vocab_size"] * h * (1 if config.get("tie_word_embeddings") else 2)
    params = (layers * per_layer / cfg.pp + ends / cfg.pp) / cfg.tp
    shards = dp * cfg.cp if cfg.target == "fsdp" else 1
    return params * _STATE_BYTES / shards


def predict_config(
    cfg: Any,
    cluster: ClusterSpec,
    *,
    dp: int,
    shallow: dict[int, str] | None = None,
    cache: dict[Any, Any] | None = None,
    float8: bool = False,
) -> StepPrediction:
    """Predict one step of what ``slapo train`` builds from ``cfg`` on ``dp`` replicas, on
    ``cluster``: memory of the stage needing most, seconds, tokens/s per GPU, MFU.

    ``cfg.model`` is a config-only model directory (or any model directory); a run that compiles
    its blocks or its whole model (``cfg.compile_blocks``, or the knobs ``slapo train`` resolves)
    is predicted compiled. ``shallow`` (:func:`slapo.plan.profile.shallow_configs` of its
    config) and ``cache`` let many predictions share their fake steps.

    Example:
        >>> import transformers
        >>> from slapo.plan import PRESETS
        >>> from slapo.train import TrainConfig
        >>> transformers.LlamaConfig(  # Llama 3 8B's sizes: config.json only, no weights
        ...     hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        ...     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        ... ).save_pretrained("llama3-8b-config")
        >>> cluster = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8)
        >>> cfg = TrainConfig(model="./llama3-8b-config", device="cuda", precision="bf16",
        ...                   target="fsdp", batch_size=2, seq_len=8192, ckpt_ratio=1.0)
        >>> predict_config(cfg, cluster, dp=8).tokens_per_s_per_gpu > 0
        True
    """
    from ..train.run_memory import layout_spec

    config = _model_config(cfg)
    layers = model_shape(config)["num_hidden_layers"]
    spec = layout_spec(cfg, 0, dp)
    if spec.target == "roundpipe":  # one process streaming to every GPU of its node
        spec = dataclasses.replace(spec, devices=cluster.gpus_per_node, prefetch=True)
    if shallow is None:
        with shallow_configs(config) as dirs:
            return predict_config(cfg, cluster, dp=dp, shallow=dirs, cache=cache, float8=float8)
    profile = profile_config(cfg, spec, shallow, layers, cache=cache)
    tokens = cfg.batch_size * cfg.seq_len // spec.cp
    return time_step(
        profile.counts, profile.estimate, profile.model, tokens, cfg.seq_len, spec, cluster,
        compile=_compiled(cfg), float8=float8,
    )  # fmt: skip


def _compiled(cfg: Any) -> bool:
    """Whether the run compiles its blocks or its whole model (``--compile-blocks``, or the
    knob ``slapo train`` resolves: the whole model on one eager process, as recommended)."""
    from ..train.job_layout import schedule_knobs

    knobs = schedule_knobs(cfg)
    return bool(knobs.get("compile_blocks") or knobs.get("compile_model"))


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def candidate_layouts(
    config: dict[str, Any],
    base: Any,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    targets: tuple[str, ...] = ("fsdp", "ddp"),
    min_cp_chunk: int = MIN_CP_CHUNK,
) -> Iterator[tuple[Any, int]]:
    """Every ``(TrainConfig, dp)`` of ``base`` laid out over ``gpus`` (checkpointing left to
    :func:`plan_layouts`): tp a power of two within a node dividing the heads; pp dividing the
    layers (up to :data:`MAX_PP`; microbatches of one sequence, at least pp of them);
    cp a power of two (up to :data:`MAX_CP`, chunks of :data:`MIN_CP_CHUNK` tokens or more)
    dividing the sequence in 2 x cp chunks, without pp (``slapo train`` refuses both); ep for a mixture of experts, without tp; dp the rest, which
    must divide ``global_batch``.

    Example:
        >>> from slapo.train import TrainConfig
        >>> config = {"num_attention_heads": 64, "num_key_value_heads": 8,
        ...           "num_hidden_layers": 80, "model_type": "llama"}  # a config.json's keys
        >>> base = TrainConfig(model="./llama3-70b-config", device="cuda", seq_len=8192)
        >>> next(candidate_layouts(config, base, 8, 8, 16))[1]  # (TrainConfig, dp): dp 8
        8
    """
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    layers = config["num_hidden_layers"]
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    tps = [t for t in _powers_of_two(gpus_per_node) if heads % t == 0 and kv_heads % t == 0]
    pps = [p for p in _divisors(layers, MAX_PP) if gpus % p == 0]
    cps = [
        c for c in _powers_of_two(MAX_CP)
        if base.seq_len % (2 * c) == 0 and (c == 1 or base.seq_len // c >= min_cp_chunk)
    ]  # fmt: skip
    for tp in tps:
        for pp in pps:
            for cp in cps if pp == 1 else [1]:
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if global_batch % dp:
                    continue
                batch = global_batch // dp
                eps = [1]
                if experts and tp == 1:
                    eps += [
                        e for e in _powers_of_two(dp * cp)[1:]
                        if experts % e == 0 and (dp * cp) % e == 0 and e % cp == 0
                    ]  # fmt: skip
                # microbatches of one sequence: with the batch fixed, larger ones only widen
                # the bubble (fewer of them) and hold more in flight
                micro_options = [None] if pp == 1 else [1] if batch >= pp else []
                for ep in eps:
                    for micro in micro_options:
                        for target in targets:
                            fields = dict(tp=tp, pp=pp, cp=cp, ep=ep, batch_size=batch,
                                          target=target)  # fmt: skip
                            if micro is not None:
                                fields["num_microbatches"] = batch // micro
                            yield dataclasses.replace(base, **fields), dp


def parse_layout(text: str) -> dict[str, Any]:
    """``--layout``'s ``name=value`` list: ``fsdp=32,tp=8`` (fsdp/ddp/dp give dp and the
    engine), ``pp``, ``cp``, ``ep``, ``schedule``, ``microbatches``, ``ac``, ``batch``.

    Example:
        >>> parse_layout("dp=8,pp=8,tp=8,schedule=interleaved-1f1b,microbatches=32")
        Traceback (most recent call last):
        ...
        slapo.plan.step_time.PlanError: --layout schedule=interleaved-1f1b: ...
        >>> parse_layout("fsdp=32,tp=8")
        {'target': 'fsdp', 'dp': 32, 'tp': 8}
    """
    out: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep:
            raise PlanError(f"--layout {item!r}: write name=value (e.g. fsdp=32,tp=8)")
        if name in ("fsdp", "ddp", "dp"):
            if name != "dp":
                out["target"] = name
            name = "dp"
        if name == "schedule":
            from ..memory import PIPELINE_SCHEDULES

            match = {s.lower(): s for s in PIPELINE_SCHEDULES}.get(value.strip().lower())
            if match is None:
                raise PlanError(
                    f"--layout schedule={value}: slapo train runs {PIPELINE_SCHEDULES} (an "
                    "interleaved schedule is not built yet)"
                )
            out["pipeline_schedule"] = match
            continue
        if name == "ac":
            if value not in AC_CHOICES:
                raise PlanError(f"--layout ac={value}: one of {sorted(AC_CHOICES)}")
            out["ac"] = value
            continue
        key = {"microbatches": "num_microbatches", "batch": "batch_size"}.get(name, name)
        if key not in ("dp", "tp", "pp", "cp", "ep", "num_microbatches", "batch_size"):
            raise PlanError(
                f"--layout {name}=: unknown; use fsdp|ddp|dp, tp, pp, cp, ep, schedule, "
                "microbatches, ac, batch"
            )
        try:
            out[key] = int(value)
        except ValueError:
            raise PlanError(f"--layout {name}={value}: a positive integer") from None
        if out[key] < 1:
            raise PlanError(f"--layout {name}={value}: a positive integer")
    return out


def plan_layouts(
    model_dir: str,
    cluster: ClusterSpec,
    *,
    gpus: int,
    seq_len: int,
    global_batch: int,
    ac: tuple[str, ...] = tuple(AC_CHOICES),
    targets: tuple[str, ...] = ("fsdp", "ddp"),
    compile: bool = False,
    precision: str = "bf16",
    float8: bool = False,
    keep_all: bool = False,
    min_cp_chunk: int = MIN_CP_CHUNK,
) -> list[PlannedLayout]:
    """Predict every candidate layout (:func:`candidate_layouts`) of the model in ``model_dir``
    on ``gpus`` GPUs of ``cluster``, each with the fastest checkpointing of ``ac`` that fits;
    return those that fit, fastest first (with ``keep_all``, the rest after them). Nothing
    fitting, RoundPipe on one node is tried. ``min_cp_chunk``: see :func:`candidate_layouts`.

    Example:
        >>> import transformers
        >>> transformers.LlamaConfig(  # Llama 3 70B's sizes: config.json only, no weights
        ...     hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        ...     num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
        ... ).save_pretrained("llama3-70b-config")
        >>> from slapo.plan import PRESETS
        >>> cluster = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, inter_node_gbps=50.0)
        >>> # illustration: predicting every layout of 256 GPUs takes a minute on a CPU
        >>> ranked = plan_layouts("./llama3-70b-config", cluster, gpus=256, seq_len=8192,
        ...                       global_batch=256)  # doctest: +SKIP
        >>> ranked[0].fits  # doctest: +SKIP
        True
    """
    from ..train.config import TrainConfig

    if gpus < 1 or global_batch < 1 or seq_len < 1:
        raise PlanError("gpus, seq_len and global_batch must be positive")
    unknown = set(ac) - set(AC_CHOICES)
    if unknown:
        raise PlanError(f"ac {sorted(unknown)}: choose from {sorted(AC_CHOICES)}")
    base = TrainConfig(
        model=model_dir, device="cuda", precision=precision, seq_len=seq_len,
        compile_blocks=compile, progress=False,
    )  # fmt: skip
    config = _model_config(base)
    shape = model_shape(config)
    budget = cluster.device.hbm_gib * 2**30
    order = [name for name in AC_CHOICES if name in ac]
    fitting: list[PlannedLayout] = []
    rest: list[PlannedLayout] = []
    cache: dict[Any, Any] = {}
    with shallow_configs(config) as shallow:
        for cfg, dp in candidate_layouts(
            shape, base, gpus, cluster.gpus_per_node, global_batch, targets, min_cp_chunk
        ):
            if _state_lower_bound(shape, cfg, dp) > budget:
                continue
            # the least memory first (the last of ``order``): where it does not fit, nothing
            # does; then the fastest that fits, by bisection (each choice of ``order`` keeps
            # less than the one before it)
            evaluate = functools.partial(_predict, cfg, dp, cluster, shallow, cache, budget, float8)
            best = evaluate(order[-1])
            if not best.fits:
                rest.append(best)
                continue
            low, high = 0, len(order) - 1  # order[high] fits; find the first that does
            while low < high:
                middle = (low + high) // 2
                planned = evaluate(order[middle])
                if planned.fits:
                    best, high = planned, middle
                else:
                    rest.append(planned)
                    low = middle + 1
            fitting.append(best)
        if not fitting and "roundpipe" not in targets:
            # nothing fits the devices: RoundPipe keeps the model state in host memory and
            # streams the layers, one process per node
            one = dataclasses.replace(
                base, target="roundpipe", batch_size=global_batch, tp=1, pp=1, cp=1, ep=1
            )  # fmt: skip
            for name in order:
                planned = _predict(one, 1, cluster, shallow, cache, budget, float8, name)
                planned = dataclasses.replace(planned, devices=cluster.gpus_per_node)
                (fitting if planned.fits else rest).append(planned)
                if planned.fits:
                    break
    fitting.sort(key=lambda p: -p.prediction.tokens_per_s_per_gpu)
    return fitting + (rest if keep_all else [])


def _predict(
    cfg: Any, dp: int, cluster: ClusterSpec, shallow: dict[int, str], cache: dict[Any, Any],
    budget: float, float8: bool, ac: str,
) -> PlannedLayout:  # fmt: skip
    run = dataclasses.replace(cfg, **AC_CHOICES[ac])
    try:
        pred = predict_config(run, cluster, dp=dp, shallow=shallow, cache=cache, float8=float8)
    except SlapoError:
        raise
    except Exception as exc:
        raise PlanError(
            f"{run.target} dp{dp} tp{run.tp} pp{run.pp} cp{run.cp} ep{run.ep} ac {ac}: the fake "
            f"step failed: {type(exc).__name__}: {exc}"
        ) from exc
    fits = pred.memory_bytes <= budget
    if run.target == "roundpipe":  # and the model state (activations too) in host memory
        fits = fits and pred.memory.required <= cluster.host_gib * 2**30
    return PlannedLayout(run, dp, ac, pred, fits)

"""Peak tensor memory of a training run, comparable between runs in one process, and the
estimate of it that :func:`slapo.estimate_memory` makes before the run."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from ..pipeline.replicas import local_part

__all__ = [
    "PeakMemory",
    "estimate_config",
    "estimate_placement",
    "estimate_run",
    "estimated_peak_mb",
    "estimated_schedule",
    "layout_spec",
]


class PeakMemory:
    """Peak tensor memory of a training run, comparable between runs in one process.

    For a model with its parameters on CUDA, the allocator's peak above what was allocated when
    the run began (its weights). Otherwise (where the process's resident size keeps what an
    earlier run freed) the model state (parameters, buffers, gradients, optimizer state) plus the
    most bytes saved for backward alive at once (:class:`slapo.memory.LiveSaved`: counted when
    autograd saves them, uncounted when freed); a checkpointed block's inner tensors are
    recomputed in backward and so not counted. In one process that is every byte a step saves
    (all of it is alive at the end of the forward); on a pipeline stage, the microbatches its
    schedule keeps in flight (1F1B frees one's saved tensors as its backward runs). This is the
    ``peak`` of :func:`slapo.estimate_memory` and :func:`slapo.estimate_layout` (see
    :func:`estimated_peak_mb`), so it also counts the data-parallel engine's own bytes, as the
    estimate's ``engine`` does (:class:`slapo.memory.EngineBytes`): DDP's gradient buckets, the
    most parameters FSDP2 holds gathered at once (not counted as saved for backward), DeepSpeed's
    fp32 partition. ``engine_mb`` is that share of ``peak_mb``.

    Counting runs a Python hook per saved tensor, which slows a step (an eager model, saving more
    tensors, more than a compiled one): with ``sample_steps=n`` only the first ``n`` steps are
    counted and later steps run without hooks, so that their time is the model's own. A model
    whose shapes do not change between steps saves the same bytes in every step.

    Example:
        >>> import torch
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> ids = torch.randint(0, 100, (2, 8))
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> with PeakMemory(model, optimizer) as mem:
        ...     model(**batch).loss.backward(); mem.next_step()
        >>> mem.peak_mb > 0
        True
    """

    def __init__(self, model: Any, optimizer: Any, sample_steps: int | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.sample_steps = sample_steps
        self._counted = 0
        self.peak_mb = self.activation_mb = self.engine_mb = 0.0
        self.engine_parts: dict[str, int] = {}
        self._live: Any = None
        self._engine: Any = None
        # the device the model trains on: a CPU model on a machine with a GPU is still a CPU run
        self.cuda = torch.cuda.is_available() and any(
            local_part(p).device.type == "cuda" for p in model.parameters()
        )

    def next_step(self) -> None:
        """Close one step: stop counting once ``sample_steps`` steps are counted."""
        live = self._live
        if live is None or not live.counting:
            return  # not counting: on CUDA, or past the sampled steps
        self.activation_mb = live.peak / 2**20
        self._counted += 1
        if self._counted == self.sample_steps:
            live.__exit__(None, None, None)

    def __enter__(self) -> PeakMemory:
        from ..memory import EngineBytes, LiveSaved

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated() / 2**20
            return self
        params = {local_part(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        self._engine = engine = EngineBytes(self.model)
        if "gathered" in engine.parts():  # FSDP2's gathered parameters: sampled, not saved
            self._live = LiveSaved(skip=lambda: params | engine.skip(), sample=engine.sample)
        else:
            self._live = LiveSaved(skip=params)
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20 - self._base
            return
        if self._live is not None:
            self.activation_mb = self._live.peak / 2**20
            self._live.__exit__(*exc)
        state = sum(2 * local_part(p).numel() * p.element_size() for p in self.model.parameters())
        # the pipeline engine exposes its stages' parameters but is no nn.Module
        buffers = self.model.buffers() if hasattr(self.model, "buffers") else ()
        state += sum(local_part(b).numel() * b.element_size() for b in buffers)
        # RoundPipe's optimizer copies: storages of their own beside the model's parameters
        copies = getattr(self.model, "optim_parameters", None)
        if callable(copies):
            state += sum(c.numel() * c.element_size() for c in copies())
        for per_param in getattr(self.optimizer, "state", {}).values():
            state += sum(local_part(v).numel() * v.element_size() for v in per_param.values()
                         if isinstance(v, torch.Tensor))  # fmt: skip
        if self._engine is not None:
            self.engine_parts = self._engine.parts()
        self.engine_mb = sum(self.engine_parts.values()) / 2**20
        self.peak_mb = state / 2**20 + self.activation_mb + self.engine_mb


def estimated_peak_mb(estimate: Any) -> float | None:
    """The estimate (MiB) of what :class:`PeakMemory` measures: for a model on CUDA the
    allocator's peak above the weights already there (``live_peak`` less parameters and buffers),
    otherwise the estimate's ``peak``. None for no estimate.

    Example:
        >>> estimated_peak_mb(None) is None
        True
    """
    if estimate is None:
        return None
    if estimate.device == "cuda":
        return (estimate.live_peak - estimate.params - estimate.buffers) / 2**20
    return estimate.peak / 2**20


def estimate_placement(cfg: Any) -> tuple[str, Any]:
    """The device type and :class:`~slapo.precision.Precision` a memory estimate of ``cfg`` is
    for: ``cfg.device`` and ``cfg.precision`` resolved as ``slapo train`` resolves them
    (``--device auto``: a GPU where one is; no ``--precision``: bf16 on a GPU with bf16, else
    fp32). ``--device cuda`` on a machine without a GPU is still estimated for CUDA (everything
    is fake), and its default precision is then bf16: that of a GPU that has it.

    Example:
        >>> from slapo.train import TrainConfig
        >>> estimate_placement(TrainConfig(device="cpu"))
        ('cpu', Precision(name='fp32'))
        >>> estimate_placement(TrainConfig(device="cuda"))[1].name     # with or without a GPU
        'bf16'
    """
    from ..exceptions import InputError
    from ..precision import (
        DeviceError,
        Precision,
        PrecisionError,
        default_precision,
        resolve_device,
    )

    device = getattr(cfg, "device", None) or "auto"
    try:
        if str(device).strip().lower().split(":", 1)[0] == "cuda" and not torch.cuda.is_available():
            kind, default = "cuda", Precision("bf16")
        else:
            kind = resolve_device(device).type
            default = default_precision(kind)
    except DeviceError as exc:
        raise InputError(f"--device {device}: {exc}") from exc
    given = getattr(cfg, "precision", None)
    try:
        return kind, default if given is None else Precision.of(given)
    except PrecisionError as exc:
        raise InputError(f"--precision {given}: {exc}") from exc


def layout_spec(
    cfg: Any,
    rank: int = 0,
    dp: int | None = None,
    pipeline_schedule: str | None = None,
    precision: Any = None,
) -> Any:
    """The :class:`~slapo.memory.LayoutSpec` of rank ``rank`` of a ``slapo train`` run of ``cfg``
    on ``dp`` data-parallel replicas (default ``cfg.dp`` where the config has it, else 1), with
    its ``--cp`` and ``--ep``: the engine a stage's replicas (dp x cp) share gradients with, the
    pipeline's schedule (default ``cfg.pipeline_schedule`` where the config has it, else 1F1B, as
    slapo train runs) and microbatches, and the precision (default: the config's,
    :func:`estimate_placement`).

    Example:
        >>> from slapo.train import TrainConfig
        >>> layout_spec(TrainConfig(pp=2, num_microbatches=4), rank=1).describe()
        'pipeline dp1 x pp2 x tp1 (1F1B, 4 microbatches)'
        >>> layout_spec(TrainConfig(target="fsdp", precision="bf16"), dp=8).describe()
        'fsdp dp8 x pp1 x tp1 bf16'
        >>> layout_spec(TrainConfig(cp=2, ep=2)).describe()     # eager replicas: DDP
        'ddp dp1 x pp1 x cp2 x tp1 ep2'
    """
    from ..memory import LayoutSpec
    from .uses import DEEPSPEED_ZERO_STAGE, replica_engine

    pp = getattr(cfg, "pp", None) or cfg.num_stages
    dp = dp if dp is not None else getattr(cfg, "dp", 1) or 1
    cp, ep = getattr(cfg, "cp", 1) or 1, getattr(cfg, "ep", 1) or 1
    # the pipeline engine (its replicas share gradients as --target says), or the engine of
    # the replicas (dp x cp: the cp ranks average gradients too) as slapo train builds them
    # (DDP for eager ones)
    target = replica_engine(cfg.target, pp, dp * cp)
    return LayoutSpec(
        target=target, dp=dp, pp=pp, tp=cfg.tp, cp=cp, ep=ep, rank=rank,
        num_microbatches=cfg.num_microbatches if pp > 1 else 1,
        pipeline_schedule=pipeline_schedule or getattr(cfg, "pipeline_schedule", "1F1B"),
        zero_stage=DEEPSPEED_ZERO_STAGE,
        precision=precision if precision is not None else estimate_placement(cfg)[1],
    )  # fmt: skip


def _next_batch(batches: Any) -> Any:
    state = batches.state_dict()
    try:
        return batches.next()
    finally:
        batches.load_state_dict(state)  # the run trains on the very same batches


def estimate_run(runner: Any, batches: Any) -> Any:
    """The memory estimate of one step of ``runner``'s rank on the next batch of ``batches``
    (not consumed), with its optimizer: :func:`slapo.estimate_memory` of the schedule's module
    for an eager run, :func:`slapo.estimate_layout` of this rank's share of the layout for every
    other target (its model rebuilt on the meta device, scheduled as the run's, over the run's
    tensor-parallel group). None if the estimate fails (one line on stderr says why: the run goes
    on).

    Example:
        >>> from slapo.train import Runner, TrainConfig, make_batches
        >>> from slapo.train.job_layout import Layout
        >>> cfg = TrainConfig(batch_size=2, seq_len=16)
        >>> est = estimate_run(Runner(cfg, Layout(), True), make_batches(cfg, Layout()))
        >>> est.peak > 0
        True
    """
    from ..memory import estimate_memory  # deferred: fake tensors load on first use
    from .uses import TARGET_USES

    batch = _next_batch(batches)
    try:
        device, precision = _run_placement(runner)
        whole = TARGET_USES[runner.target].whole_estimate
        if whole and runner.model is runner.sch.mod:
            # the optimizer itself (its parameter groups), a loss scaler's wrapper unwrapped
            optimizer = _inner_optimizer(runner.optimizer)
            return estimate_memory(runner.sch, batch, optimizer=optimizer, precision=precision)
        layout = runner.layout
        spec = layout_spec(runner.cfg, _spec_rank(layout), layout.dp_size, precision=precision)
        optimizer = _optimizer_of(runner.optimizer)
        groups = {
            "cp": getattr(layout, "cp_group", None), "ep": getattr(layout, "ep_group", None),
            "replicas": getattr(layout, "ep_replicas", None),
        }  # fmt: skip
        return _estimate_spec(runner.cfg, spec, batch, layout, optimizer, device, groups)
    except Exception as exc:  # noqa: BLE001  (the estimate is a by-product; the run goes on)
        print(f"slapo train: no memory estimate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _spec_rank(layout: Any) -> int:
    """This process's rank on the estimate's ``("dp", "pp", "cp", "tp")`` mesh
    (:class:`~slapo.memory.LayoutSpec`), from its coordinates on the run's mesh (whatever order
    the run lays its dimensions out in); the run's rank where it has no named mesh."""
    mesh = getattr(layout, "mesh", None)
    names = getattr(mesh, "mesh_dim_names", None)
    coords = mesh.get_coordinate() if names else None
    if not coords:
        return layout.rank
    at = dict(zip(names, coords))
    sizes = dict(zip(names, mesh.mesh.shape))
    rank = 0
    for name in ("dp", "pp", "cp", "tp"):
        rank = rank * sizes.get(name, 1) + at.get(name, 0)
    return rank


def _split_context_experts(model: Any, spec: Any, groups: dict[str, Any], batch: Any) -> Any:
    """Prepare ``model`` for ``spec``'s context and expert parallelism as ``slapo train`` does
    (``slapo.sharding.ParallelMesh.apply``): its attention over ``groups["cp"]``, its experts
    split over ``groups["ep"]``, their gradients reduced by hooks over ``groups["replicas"]``
    (the ranks holding the same experts; None: none) and averaged over dp x cp. Returns this
    cp rank's part of ``batch`` (``batch`` itself without cp)."""
    from ..sharding.context_parallel import context_parallel
    from ..sharding.expert_grads import reduce_expert_grads
    from ..sharding.expert_parallel import expert_parallel

    context = None
    if spec.cp > 1:
        context = context_parallel(model, groups["cp"])
    if spec.ep > 1:
        expert_parallel(model, groups["ep"])
        reduce_expert_grads(model, groups.get("replicas"), average_over=spec.replicas)
    return batch if context is None else context.model_batch(batch)


def _run_placement(runner: Any) -> tuple[str, Any]:
    """The device type and precision of a runner's run (its resolved run where it has one): a
    target that keeps the model state on the host (RoundPipe) is estimated there."""
    run = getattr(runner, "run", None)
    if run is None:
        return estimate_placement(runner.cfg)
    on_host = run.record.host_state
    return ("cpu" if on_host else run.device.type), run.precision


def _inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer that steps: an engine's wrapper (DeepSpeed's, RoundPipe's or a loss
    scaler's, itself a torch optimizer around the one that steps) holds it as ``.optimizer``."""
    inner = optimizer
    while hasattr(inner, "optimizer") and (
        not isinstance(inner, torch.optim.Optimizer)
        or isinstance(inner.optimizer, torch.optim.Optimizer)
    ):
        inner = inner.optimizer
    return inner


def _optimizer_of(optimizer: Any) -> tuple[Any, dict[str, Any]]:
    """The class and hyperparameters of a run's optimizer (an engine's wrapper unwrapped)."""
    inner = _inner_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return torch.optim.AdamW, {}
    kwargs = {k: v for k, v in inner.defaults.items() if k in ("lr", "betas", "eps", "momentum")}
    return type(inner), kwargs


def _within_vocab(batch: dict[str, Any], model: Any) -> dict[str, Any]:
    """``batch`` with its token ids taken modulo the model's vocabulary where it has fewer
    tokens than the byte corpus's 256 (a small configuration); ignored labels (-100) kept."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        return batch
    out = {}
    for key, ids in batch.items():
        too_large = isinstance(ids, torch.Tensor) and ids.dtype == torch.long and ids.max() >= vocab
        out[key] = torch.where(ids >= 0, ids % vocab, ids) if too_large else ids
    return out


def estimated_schedule(
    cfg: Any, spec: Any, batch: Any, layout: Any, groups: dict[str, Any] | None = None
) -> tuple[Any, Any]:
    """The schedule ``slapo train`` would build from ``cfg`` for one rank of ``spec``, its model
    on the meta device (a model directory's weights stay unread), over ``layout``'s
    tensor-parallel group, its attention and experts over the cp and ep ``groups``; and that
    rank's part of ``batch``. What :func:`estimate_config` estimates, and the planner
    (:mod:`slapo.plan`) counts.

    Example:
        >>> import slapo
        >>> from slapo.train import TrainConfig, make_batches
        >>> from slapo.train.job_layout import Layout
        >>> cfg = TrainConfig(batch_size=2, seq_len=16)
        >>> batch = make_batches(cfg, Layout()).next()
        >>> with slapo.memory.fake_layout_groups(cp=2) as groups:
        ...     sch, local = estimated_schedule(cfg, layout_spec(cfg), batch, Layout(), groups)
    """
    from ..initialization import init_empty_weights
    from .job_layout import schedule_for  # the very schedule slapo train builds from cfg
    from .presets import build_model

    with init_empty_weights():
        model = build_model(cfg, weights=False)
    model.train()
    batch = _within_vocab(batch, model)
    sch = schedule_for(cfg, model, layout, scheduled=not cfg.unscheduled)
    return sch, _split_context_experts(sch.mod, spec, groups or {}, batch)


def _estimate_spec(
    cfg: Any,
    spec: Any,
    batch: Any,
    layout: Any,
    optimizer: tuple[Any, dict[str, Any]],
    device: str | None = None,
    groups: dict[str, Any] | None = None,
) -> Any:
    """``estimate_layout`` of ``cfg``'s model, on the meta device, scheduled over ``layout``,
    its attention and experts over the cp and ep ``groups`` (:func:`_split_context_experts`),
    for ``device`` (a type; None: the CPU)."""
    from ..memory import estimate_layout

    sch, batch = estimated_schedule(cfg, spec, batch, layout, groups)
    fields = {f.name for f in dataclasses.fields(spec)}
    return estimate_layout(
        sch, batch, **{k: getattr(spec, k) for k in fields},
        optimizer=optimizer[0], optimizer_kwargs=optimizer[1], device=device,
    )  # fmt: skip


def estimate_config(
    cfg: Any,
    rank: int | None = None,
    optimizer: Any = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    dp: int | None = None,
    pipeline_schedule: str | None = None,
) -> Any:
    """The memory estimate of one step of rank ``rank`` of what ``slapo train`` would build from
    ``cfg`` (a :class:`~slapo.train.TrainConfig`) on ``dp`` data-parallel replicas: its model (on
    the meta device: nothing allocated), its schedule (``pipeline_schedule``: GPipe or 1F1B with
    ``cfg.pp > 1``), its optimizer (AdamW with ``cfg.lr``,
    unless ``optimizer`` and ``optimizer_kwargs`` name another) and one batch, on ``cfg.device``
    in ``cfg.precision`` (:func:`estimate_placement`). ``cfg.model`` may be a directory that holds
    only a ``config.json``: no weights are read. ``rank`` is the
    global rank on the ``("dp", "pp", "cp", "tp")`` mesh (None: the pipeline stage needing the
    most, what a memory budget must hold on every rank); with ``cfg.tp``, ``cfg.cp`` or ``cfg.ep``
    over 1 its share is estimated in this process over fake process groups
    (:func:`slapo.memory.fake_layout_groups`): its tensor-parallel shards, its ``seq_len / cp``
    tokens of each sequence (with the keys and values its attention gathers), its
    ``num_experts / ep`` experts of each MoE layer. Every target is modelled
    (:func:`slapo.estimate_layout`); with ``cfg.compare``, the larger of the scheduled and the
    unscheduled run.

    Example:
        >>> from slapo.train import TrainConfig
        >>> print(estimate_config(TrainConfig(model="gpt2", ckpt_ratio=1.0)))  # the tiny preset
        memory estimate: GPT2LMHeadModel on cpu, optimizer AdamW
          parameters ...
        >>> estimate_config(TrainConfig(model="gpt2", target="fsdp"), dp=4).target
        'fsdp'
        >>> import transformers
        >>> transformers.LlamaConfig(  # Llama 3 8B's sizes: config.json only, no weights
        ...     hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        ...     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        ... ).save_pretrained("llama3-8b-config")
        >>> cfg = TrainConfig(model="./llama3-8b-config", device="cuda", precision="bf16",
        ...                   target="fsdp", batch_size=2, seq_len=8192)
        >>> # illustration: tracing an 8B model at 8192 tokens takes seconds on a CPU
        >>> estimate_config(cfg, dp=8).engine_parts["fsdp gathered parameters"] > 0  # doctest: +SKIP
        True
        >>> estimate_config(TrainConfig(model="qwen3_moe", cp=2, ep=2)).layout
        {'dp': 1, 'pp': 1, 'tp': 1, 'cp': 2, 'ep': 2}
    """
    import contextlib

    from ..data import ByteBatches, MaskedByteBatches, default_corpus
    from ..memory import fake_layout_groups
    from .job_layout import Layout

    cfg.check()
    if cfg.compare:  # the run trains the unscheduled baseline too: the larger of the two counts
        runs = [dataclasses.replace(cfg, compare=False, unscheduled=u) for u in (True, False)]
        estimates = [
            estimate_config(run, rank, optimizer, optimizer_kwargs, dp, pipeline_schedule)
            for run in runs
        ]
        return max(estimates, key=lambda e: e.required)
    if rank is None:
        first = layout_spec(cfg, 0, dp)
        ranks = [stage * first.cp * first.tp for stage in range(first.pp)]  # dp, cp, tp rank 0
        estimates = [
            estimate_config(cfg, r, optimizer, optimizer_kwargs, dp, pipeline_schedule)
            for r in ranks
        ]
        return max(estimates, key=lambda e: e.required)
    device, precision = estimate_placement(cfg)
    spec = layout_spec(cfg, rank, dp, pipeline_schedule, precision)
    batches = (MaskedByteBatches if cfg.model == "bert" else ByteBatches)(
        default_corpus(max(100_000, 4 * cfg.seq_len)), cfg.batch_size, cfg.seq_len, cfg.seed
    )
    if optimizer is None:
        optimizer, optimizer_kwargs = torch.optim.AdamW, {"lr": cfg.lr}
    with contextlib.ExitStack() as ctx:
        layout, groups = Layout(), {}
        tp = cfg.tp if not cfg.unscheduled else 1  # the unscheduled model is not sharded
        if max(tp, spec.cp, spec.ep) > 1:
            tp_rank = spec.coords()[2] if tp > 1 else 0
            groups = ctx.enter_context(fake_layout_groups(tp, spec.cp, spec.ep, tp_rank))
            if tp > 1:
                layout = Layout(rank=tp_rank, world=tp, tp_group=groups["tp"], tp_size=tp)
        # the ranks holding the same experts sum their gradients in a hook (an all-reduce in
        # place: no bytes kept), left out of the fake step (groups["replicas"] is None)
        spec_args = (optimizer, dict(optimizer_kwargs or {}))
        return _estimate_spec(cfg, spec, batches.next(), layout, spec_args, device, groups)

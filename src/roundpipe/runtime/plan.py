"""Execution plans (which layers form each pipeline stage) and their runtime tracking."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from ..devices.device import get_devices, get_min_gpu_memory, get_num_devices
from ..devices.threads import RoundPipeAborted, RunState, wait_until
from ..errors import RoundPipeError, RoundPipeValueError

if TYPE_CHECKING:
    from torch import nn

    from ..devices.attribute import LayerAttribute
    from .timer import ModelTimer

__all__ = [
    "InvalidPlanError",
    "ModelExecutePlan",
    "ModelTracker",
    "PipelineModel",
    "partition_layers",
]


class PipelineModel(Protocol):
    """What the planner and the runtime read from a RoundPipe model.

    :class:`roundpipe.RoundPipe` provides it; naming the protocol here keeps the scheduler
    and the runtime below the model wrapper in the import layers.
    """

    name: str
    num_layers: int
    layers: list[nn.Module]
    layer_attrs: list[LayerAttribute]
    layer_bytes: list[int]
    layer_grad_bytes: list[int]
    model_timer: ModelTimer


RunType = Literal["infer", "train", "fused"]
_RUN_TYPES = ("infer", "train", "fused")


def _check_run_type(run_type: str) -> None:
    if run_type not in _RUN_TYPES:
        raise RoundPipeValueError(f"run_type must be one of {_RUN_TYPES}, got {run_type!r}")


def _greedy(
    times: Sequence[float], sizes: Sequence[float], time_cap: float, mem_cap: float
) -> list[range]:
    """Pack consecutive layers into stages bounded by ``time_cap`` and ``mem_cap``."""
    stages: list[range] = []
    start, t, m = 0, 0.0, 0.0
    for i, (ti, mi) in enumerate(zip(times, sizes)):
        if i > start and (t + ti > time_cap or m + mi > mem_cap):
            stages.append(range(start, i))
            start, t, m = i, 0.0, 0.0
        t += ti
        m += mi
    stages.append(range(start, len(times)))
    return stages


def partition_layers(
    times: Sequence[float],
    sizes: Sequence[float],
    min_stages: int,
    upper_threshold: float,
    mem_cap: float,
) -> list[range]:
    """Split layers ``0..n-1`` into contiguous stages.

    A stage may take at most ``upper_threshold`` times the slowest layer (so the pipeline
    is paced by its slowest layer) and hold at most ``mem_cap`` bytes; the time cap is then
    lowered until there are at least ``min_stages`` stages (or one layer per stage).

    Example:
        >>> partition_layers([1, 1, 1, 1], [1, 1, 1, 1], 2, 2.0, 100)
        [range(0, 2), range(2, 4)]
    """
    n = len(times)
    if n == 0:
        raise RoundPipeValueError("cannot partition a model with no layers")
    for i, s in enumerate(sizes):
        if s > 2 * mem_cap:
            raise RoundPipeValueError(
                f"layer {i} needs {s:.0f} bytes, more than model_memory_limit allows "
                f"({2 * mem_cap:.0f}); "
                "raise model_memory_limit or split the layer"
            )
    slowest = max(times)
    cap = max(slowest * upper_threshold, 1e-12)
    stages = _greedy(times, sizes, cap, mem_cap)
    if len(stages) < min(min_stages, n):
        lo, hi = 0.0, cap  # largest cap in [lo, hi] giving >= min_stages stages
        for _ in range(60):
            mid = (lo + hi) / 2
            if len(_greedy(times, sizes, mid, mem_cap)) >= min(min_stages, n):
                lo = mid
            else:
                hi = mid
        stages = _greedy(times, sizes, lo, mem_cap)
    return stages


def _common_cap(
    series: Sequence[Sequence[float]],
    sizes: Sequence[Sequence[float]],
    min_stages: int,
    upper_threshold: float,
    mem_cap: float,
) -> float:
    """The per-stage time target shared by several models: ``upper_threshold`` times the
    slowest layer of any of them, lowered until each model has at least ``min_stages`` stages
    (or one per layer)."""
    for times, sz in zip(series, sizes):
        partition_layers(times, sz, 1, upper_threshold, mem_cap)  # validates each model
    cap = max(max(max(t) for t in series) * upper_threshold, 1e-12)

    def enough(c: float) -> bool:
        return all(
            len(_greedy(t, sz, c, mem_cap)) >= min(min_stages, len(t))
            for t, sz in zip(series, sizes)
        )

    if enough(cap):
        return cap
    lo, hi = 0.0, cap
    for _ in range(60):
        mid = (lo + hi) / 2
        if enough(mid):
            lo = mid
        else:
            hi = mid
    return lo


class _Estimates:
    """Per-layer inputs of the planner for one model: forward and backward time (ms, or
    bytes before any timing exists), parameter bytes and parameter + gradient bytes."""

    def __init__(
        self,
        fwd: list[float],
        bwd: list[float],
        infer_mem: list[float],
        train_mem: list[float],
        timed: bool,
    ) -> None:
        self.fwd, self.bwd = fwd, bwd
        self.infer_mem, self.train_mem = infer_mem, train_mem
        self.timed = timed
        self.n = len(fwd)


def _estimates(model: PipelineModel, run_type: RunType, timed: bool) -> _Estimates:
    if timed:
        _, fwd, bwd = model.model_timer.get_estimate(run_type)
    else:  # the size-based estimate the timer gives before it measured anything
        fwd = [max(float(b), 1.0) for b in model.layer_bytes]
        bwd = [3.0 * v for v in fwd]
    infer_mem = [float(b) for b in model.layer_bytes]
    train_mem = [float(b + g) for b, g in zip(model.layer_bytes, model.layer_grad_bytes)]
    return _Estimates(list(fwd), list(bwd), infer_mem, train_mem, timed)


def _link_of_devices() -> tuple[float | None, float]:
    """(the devices' modelled link in GB/s, or None when any has none; the activation bytes a
    stage moved host -> device, on average, as the devices measured it)."""
    devs = get_devices()
    links = [d.link_gbps for d in devs]
    if not devs or any(g is None for g in links):
        return None, 0.0
    acts = [d.activation_bytes_per_stage for d in devs if d.activation_bytes_per_stage]
    return min(g for g in links if g is not None), (sum(acts) / len(acts) if acts else 0.0)


class StageCost:
    """Estimated costs of one stage in a simulated step (see :func:`simulate_step`): compute
    ``compute`` ms on the worker, ``upload`` ms of link for its parameters, ``download`` ms of
    link for its gradients and ``activations`` ms of link for its inputs."""

    __slots__ = ("compute", "upload", "download", "activations")

    def __init__(
        self, compute: float, upload: float, download: float = 0.0, activations: float = 0.0
    ) -> None:
        self.compute, self.upload = compute, upload
        self.download, self.activations = download, activations


def simulate_step(stages: Sequence[StageCost], num_devices: int = 1) -> float:
    """Estimated time (ms) of one step whose stages run in this order, round-robin on
    ``num_devices`` devices, each with one host -> device and one device -> host link.

    A device uploads its stages in order, each as soon as its link is free (the prefetch of
    :class:`~roundpipe.devices.device.DeviceManager`); a stage computes once its upload landed
    and its device finished the stage before; the activations it uploads hold the link meanwhile
    (delaying the next uploads), and its gradients leave on the other link when it ends. The
    step ends when the last compute and the last gradient download did.

    Example:
        >>> simulate_step([StageCost(10, 5), StageCost(10, 5)])  # the 2nd upload is hidden
        25.0
        >>> simulate_step([StageCost(2, 5), StageCost(2, 5)])  # transfer-bound
        12.0
    """
    up = [0.0] * num_devices
    down = [0.0] * num_devices
    free = [0.0] * num_devices
    prev_start = 0.0
    for k, s in enumerate(stages):
        d = k % num_devices
        landed = up[d] + s.upload
        start = max(free[d], landed, prev_start)
        up[d] = landed + s.activations
        free[d] = start + s.compute
        prev_start = start
        if s.download:
            down[d] = max(down[d], free[d]) + s.download
    return max(max(free), max(down))


# model -> (setting, the layout auto chose last time, the inputs it chose from)
_chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _close(a: Sequence[float], b: Sequence[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in zip(a, b))


def _weigh_transfers_memo(
    model: PipelineModel,
    base: ModelExecutePlan,
    run_type: RunType,
    est: _Estimates,
    mem_cap: float,
    link_gbps: float,
    activation_bytes: float,
    num_devices: int,
) -> ModelExecutePlan:
    """:func:`_weigh_transfers` for ``model``, re-run only when its inputs moved by more than
    10% since the layout was last chosen (a step's planning stays cheap and layouts stable)."""
    key = (run_type, link_gbps, mem_cap, num_devices, tuple(base.fwd_plan), tuple(base.bwd_plan))
    seen = _chosen.get(model)
    inputs = [*est.fwd, *est.bwd, activation_bytes]
    if seen is not None and seen[0] == key and _close(seen[2], inputs, 0.1):
        return seen[1]
    previous = seen[1] if seen is not None and seen[0][0] == run_type else None
    plan = _weigh_transfers(
        base,
        run_type,
        est,
        mem_cap,
        link_gbps * 1e6,  # bytes per ms
        activation_bytes,
        num_devices,
        previous,
    )
    _chosen[model] = (key, plan, inputs)
    return plan


_CAP_MULTIPLES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
# a layout that weighs transfers replaces the compute-balanced one when it is this much faster
_TRANSFER_GAIN = 0.97


def _stage_costs(
    plan: ModelExecutePlan,
    run_type: RunType,
    est: _Estimates,
    bytes_per_ms: float,
    activation_ms: float,
) -> list[StageCost]:
    """The stages of one step of ``plan`` in execution order, as :class:`StageCost`."""

    def cost(r: range, with_grad: bool) -> StageCost:
        params = sum(est.infer_mem[i] for i in r)
        grads = sum(est.train_mem[i] for i in r) - params if with_grad else 0.0
        times = est.bwd if with_grad else est.fwd
        return StageCost(
            sum(times[i] for i in r),
            params / bytes_per_ms,
            grads / bytes_per_ms,
            activation_ms,
        )

    fwd = plan.fwd_plan[:-1] if run_type == "fused" else plan.fwd_plan
    return [cost(r, False) for r in fwd] + [cost(r, True) for r in plan.bwd_plan]


def _weigh_transfers(
    base: ModelExecutePlan,
    run_type: RunType,
    est: _Estimates,
    mem_cap: float,
    bytes_per_ms: float,
    activation_bytes: float,
    num_devices: int,
    previous: ModelExecutePlan | None = None,
) -> ModelExecutePlan:
    """The layout among ``base`` and larger-staged candidates with the shortest simulated step
    (:func:`simulate_step`), ``base`` unless a candidate is clearly faster; ``base`` as well
    where its transfers already hide (its step is within 3% of its compute alone).

    Candidates: forward and backward stages cut at multiples of ``base``'s longest stages and,
    for a fused run, the fused last stage grown by whole backward stages of ``base``; every
    stage within ``mem_cap``. ``previous`` (the layout chosen last time) is kept while it
    stays within 3% of the best: measured timings fluctuate, layouts should not.
    """
    act_ms = activation_bytes / bytes_per_ms
    n = est.n

    def score(plan: ModelExecutePlan) -> float:
        return simulate_step(_stage_costs(plan, run_type, est, bytes_per_ms, act_ms), num_devices)

    fwd_base = base.fwd_plan[:-1] if run_type == "fused" else base.fwd_plan
    cap_f = max((sum(est.fwd[i] for i in r) for r in fwd_base), default=0.0) or max(est.fwd)
    cap_b = max(sum(est.bwd[i] for i in r) for r in base.bwd_plan)

    def build(head: int, mf: float, mb: float) -> ModelExecutePlan | None:
        """Fused: stage [head, n) fused; otherwise head == n. None where memory forbids."""
        plan = ModelExecutePlan()
        fwd = _greedy(est.fwd[:head], est.infer_mem[:head], cap_f * mf, mem_cap) if head else []
        rev = (
            _greedy(est.bwd[:head][::-1], est.train_mem[:head][::-1], cap_b * mb, mem_cap)
            if head
            else []
        )
        bwd = [range(head - r.stop, head - r.start) for r in rev]
        if any(sum(est.infer_mem[i] for i in r) > mem_cap for r in fwd) or any(
            sum(est.train_mem[i] for i in r) > mem_cap for r in bwd
        ):
            return None  # a single layer above the cap: only base may hold it
        if run_type == "fused":
            last = range(head, n)
            if sum(est.train_mem[i] for i in last) > mem_cap:
                return None
            plan.fwd_plan, plan.bwd_plan = fwd + [last], [last] + bwd
        else:
            plan.fwd_plan, plan.bwd_plan = fwd, bwd
        return plan

    best, best_t = base, score(base)
    alone = simulate_step(
        [StageCost(c.compute, 0.0) for c in _stage_costs(base, run_type, est, bytes_per_ms, 0.0)],
        num_devices,
    )
    if best_t * _TRANSFER_GAIN <= alone:
        return base  # the transfers already hide behind the compute-balanced stages
    heads = sorted({r.start for r in base.bwd_plan}) if run_type == "fused" else [n]
    for head in heads:
        if run_type == "fused" and head == n:
            continue
        choice: tuple[float, float] = (1.0, 1.0)
        choice_t = float("inf")
        for axis in (0, 1):  # forward multiple first, then backward given it
            for mult in _CAP_MULTIPLES:
                pick = (mult, choice[1]) if axis == 0 else (choice[0], mult)
                plan = build(head, *pick)
                if plan is None:
                    continue
                t = score(plan)
                if t < choice_t:
                    choice, choice_t = pick, t
        if choice_t < best_t * (_TRANSFER_GAIN if best is base else 1.0):
            plan = build(head, *choice)
            assert plan is not None
            best, best_t = plan, choice_t
    if previous is not None and previous != best:
        try:
            previous.check_valid(n, run_type)
        except ValueError:
            return best
        if score(previous) * _TRANSFER_GAIN <= best_t:
            return previous
    return best


class InvalidPlanError(RoundPipeError, ValueError):
    """An execution plan that does not fit the model it runs (see
    :meth:`ModelExecutePlan.check_valid`)."""


class ModelExecutePlan:
    """Forward and backward stage layouts of a RoundPipe model.

    ``fwd_plan`` lists layer ranges in forward execution order; ``bwd_plan`` lists them in
    backward execution order (last layers first; each range ascending). In a ``"fused"`` run
    (``forward_backward``) the first backward stage also runs its layers' forward: ``fwd_plan``
    either stops right before it (the user guide's spelling) or ends with it (what :meth:`auto`
    returns); see :meth:`check_valid`.

    Example:
        >>> plan = ModelExecutePlan()
        >>> plan.fwd_plan = [range(0, 2)]                   # the guide's spelling
        >>> plan.bwd_plan = [range(2, 4), range(0, 2)]
        >>> plan.check_valid(4, "fused")
        >>> plan.fwd_plan = [range(0, 2), range(2, 4)]      # auto()'s spelling
        >>> plan.check_valid(4, "fused")
    """

    def __init__(self) -> None:
        self.fwd_plan: list[range] = []
        self.bwd_plan: list[range] = []

    def __repr__(self) -> str:
        def fmt(plan: list[range]) -> str:
            return "[" + ", ".join(f"{r.start}-{r.stop - 1}" for r in plan) + "]"

        return f"ModelExecutePlan(fwd={fmt(self.fwd_plan)}, bwd={fmt(self.bwd_plan)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelExecutePlan):
            return NotImplemented
        return self.fwd_plan == other.fwd_plan and self.bwd_plan == other.bwd_plan

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def auto(
        cls,
        run_type: RunType,
        /,
        *models: PipelineModel,
        min_stages: int | None = None,
        upper_threshold: float = 1.1,
        model_memory_limit: float | None = None,
        link_gbps: float | None = None,
        activation_bytes: float | None = None,
    ) -> ModelExecutePlan | tuple[ModelExecutePlan, ...]:
        """Plan stages from the models' measured (or size-estimated) layer timings.

        With one model, returns its plan. With several (e.g. chained RoundPipe models, which
        may have different numbers of layers), returns one plan per model, in order: every
        model's stages are cut against the same per-stage time target (``upper_threshold``
        times the slowest layer of any of them, lowered until each has ``min_stages``), so the
        models pipeline evenly one after the other.

        **Transfers.** Where the devices' link is known (CPU virtual devices with
        ``ROUNDPIPE_VIRTUAL_LINK_GBPS``, or ``link_gbps``) and layer timings were measured, a
        single model's plan also weighs transfer time against compute, as RoundPipe's own
        partitioner does: candidate layouts (larger stages, a larger fused last stage) are
        scored by :func:`simulate_step` (a stage's upload overlapping the compute of the stages
        before it, upload(stage k + 1) <= compute(stage k) where memory allows) and the
        fastest replaces the compute-balanced plan when it is clearly (3%) faster; stages then
        may exceed ``upper_threshold``, never the memory cap. Without a known link (a GPU), the
        plan is the compute-balanced one.

        Args:
            run_type: ``"infer"``, ``"train"`` (forward then separate backward) or ``"fused"``.
            models: RoundPipe models (:class:`PipelineModel`).
            min_stages: at least this many stages when possible. Default: number of devices.
            upper_threshold: a stage takes at most this multiple of the slowest layer's time.
            model_memory_limit: GB per device for parameters (and grads when training);
                each stage gets half of it so the next stage can be prefetched.
                Default: 60% of the smallest device memory.
            link_gbps: host <-> device bandwidth (GB/s) to weigh transfers with. Default: the
                devices' modelled link, if every device has one.
            activation_bytes: bytes of stage inputs a stage uploads. Default: the average the
                devices measured.

        Example:
            >>> from torch import nn
            >>> from roundpipe import RoundPipe
            >>> a = RoundPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), pin_model="off")
            >>> b = RoundPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)]), pin_model="off")
            >>> plan_a, plan_b = ModelExecutePlan.auto("fused", a, b, min_stages=2)
            >>> len(plan_a.fwd_plan), len(plan_b.fwd_plan)
            (4, 2)
        """
        _check_run_type(run_type)
        if not models:
            raise RoundPipeValueError("ModelExecutePlan.auto needs at least one model")
        if not upper_threshold >= 1.0:
            raise RoundPipeValueError(f"upper_threshold must be >= 1.0, got {upper_threshold}")
        min_stages = get_num_devices() if min_stages is None else min_stages
        if not isinstance(min_stages, int) or min_stages < 1:
            raise RoundPipeValueError(f"min_stages must be a positive int, got {min_stages!r}")
        limit_gb = get_min_gpu_memory() * 0.6 if model_memory_limit is None else model_memory_limit
        if limit_gb <= 0:
            raise RoundPipeValueError(
                f"model_memory_limit must be positive, got {model_memory_limit}"
            )
        mem_cap = limit_gb * (1024**3) / 2
        timed = all(m.model_timer.get_estimate(run_type)[0] == "time" for m in models)
        ests = [_estimates(m, run_type, timed) for m in models]
        if len(models) == 1:
            plan = cls._balanced(run_type, ests, min_stages, upper_threshold, mem_cap)[0]
            if timed and run_type != "infer":
                if link_gbps is None:
                    link_gbps, measured = _link_of_devices()
                    activation_bytes = measured if activation_bytes is None else activation_bytes
                if link_gbps is not None:
                    plan = _weigh_transfers_memo(
                        models[0],
                        plan,
                        run_type,
                        ests[0],
                        mem_cap,
                        link_gbps,
                        activation_bytes or 0.0,
                        get_num_devices(),
                    )
            plan.check_valid(ests[0].n, run_type)
            return plan
        plans = cls._balanced(run_type, ests, min_stages, upper_threshold, mem_cap)
        for plan, e in zip(plans, ests):
            plan.check_valid(e.n, run_type)
        return tuple(plans)

    @classmethod
    def _balanced(
        cls,
        run_type: RunType,
        ests: list[_Estimates],
        min_stages: int,
        upper_threshold: float,
        mem_cap: float,
    ) -> list[ModelExecutePlan]:
        """Compute-balanced plans, every model cut against the same per-stage time target."""

        def cut(series: list[list[float]], sizes: list[list[float]], k: int) -> list[list[range]]:
            cap = _common_cap(series, sizes, k, upper_threshold, mem_cap)
            return [_greedy(t, sz, cap, mem_cap) for t, sz in zip(series, sizes)]

        plans = [cls() for _ in ests]
        if run_type == "infer":
            fwds = cut([e.fwd for e in ests], [e.infer_mem for e in ests], min_stages)
            for plan, f in zip(plans, fwds):
                plan.fwd_plan = f
            return plans
        # backward is planned on reversed layers, by recompute + backward time
        revs = cut([e.bwd[::-1] for e in ests], [e.train_mem[::-1] for e in ests], min_stages)
        for plan, rev, e in zip(plans, revs, ests):
            plan.bwd_plan = [range(e.n - r.stop, e.n - r.start) for r in rev]
        if run_type == "train":
            fwds = cut([e.fwd for e in ests], [e.infer_mem for e in ests], min_stages)
            for plan, f in zip(plans, fwds):
                plan.fwd_plan = f
            return plans
        heads = [plan.bwd_plan[0].start for plan in plans]
        with_head = [i for i, h in enumerate(heads) if h > 0]
        if with_head:
            fwds = cut(
                [ests[i].fwd[: heads[i]] for i in with_head],
                [ests[i].infer_mem[: heads[i]] for i in with_head],
                max(min_stages - 1, 1),
            )
        for plan in plans:
            plan.fwd_plan = [plan.bwd_plan[0]]
        for i, f in zip(with_head, fwds if with_head else []):
            plans[i].fwd_plan = f + [plans[i].bwd_plan[0]]
        return plans

    def check_valid(self, num_layers: int, run_type: RunType) -> None:
        """Raise :class:`InvalidPlanError` (a ``ValueError``) unless the plan fits the model.

        Both layouts cover every layer exactly once, ``fwd_plan`` shallow to deep and
        ``bwd_plan`` deep to shallow. For ``"fused"`` (``forward_backward``) the first backward
        stage also runs its layers' forward, and two spellings are accepted:

        * the user guide's: ``fwd_plan`` stops right before that stage (its last layer + 1 is
          ``bwd_plan[0].start``; ``fwd_plan`` is empty when the fused stage is the whole model);
        * the one :meth:`auto` returns: ``fwd_plan`` covers every layer and ends with
          ``bwd_plan[0]``.

        ``"infer"`` and ``"train"`` (``forward()``) need a ``fwd_plan`` over every layer.

        Example:
            >>> plan = ModelExecutePlan()
            >>> plan.fwd_plan = [range(0, 3)]            # forward stops before the fused stage
            >>> plan.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
            >>> plan.check_valid(4, "fused")
            >>> try:
            ...     plan.check_valid(4, "train")
            ... except InvalidPlanError as err:
            ...     print(str(err).split(";")[0])
            fwd_plan covers layers 0..2 but the model has 4 layers (0..3)
        """
        _check_run_type(run_type)
        if not isinstance(num_layers, int) or num_layers < 1:
            raise InvalidPlanError(f"num_layers must be a positive int, got {num_layers!r}")
        fused = run_type == "fused"
        _check_ranges(self.fwd_plan, "fwd_plan", allow_empty=fused)
        if run_type != "infer":
            _check_ranges(self.bwd_plan, "bwd_plan", allow_empty=False)
            _check_cover(self.bwd_plan[::-1], "bwd_plan", num_layers, "deep to shallow")
        if not fused:
            _check_cover(
                self.fwd_plan,
                "fwd_plan",
                num_layers,
                "shallow to deep",
                f"; for run_type {run_type!r} ({_CALLS[run_type]}) fwd_plan must cover every "
                "layer. A plan whose fwd_plan stops before the first bwd_plan stage is for "
                "forward_backward() only",
            )
            return
        head = self.bwd_plan[0]
        if self.fwd_plan and self.fwd_plan[-1] == head:  # auto()'s spelling
            _check_cover(self.fwd_plan, "fwd_plan", num_layers, "shallow to deep")
            return
        end = self.fwd_plan[-1].stop if self.fwd_plan else 0
        if end != head.start:
            raise InvalidPlanError(
                "for forward_backward() (run_type 'fused') the last fwd_plan layer + 1 must equal "
                f"the first layer of bwd_plan[0]: fwd_plan ends at layer {end - 1} but bwd_plan[0] "
                f"is {head!r}. Stop fwd_plan at layer {head.start - 1} (the fused stage {head!r} "
                f"runs its own forward), or end fwd_plan with the stage {head!r} itself"
            )
        _check_cover(self.fwd_plan, "fwd_plan", head.start, "shallow to deep")

    def fused_layout(self) -> ModelExecutePlan:
        """This (valid) plan with the fused stage closing ``fwd_plan``: the layout the runtime
        executes a ``forward_backward`` with. A plan in the user guide's spelling (``fwd_plan``
        stopping before ``bwd_plan[0]``) gets ``bwd_plan[0]`` appended, as a new plan; any other
        plan is returned as is.

        Example:
            >>> plan = ModelExecutePlan()
            >>> plan.fwd_plan = [range(0, 3)]
            >>> plan.bwd_plan = [range(3, 4), range(0, 3)]
            >>> plan.fused_layout()
            ModelExecutePlan(fwd=[0-2, 3-3], bwd=[3-3, 0-2])
        """
        if not self.bwd_plan:
            return self
        head = self.bwd_plan[0]
        end = self.fwd_plan[-1].stop if self.fwd_plan else 0
        if end != head.start or (self.fwd_plan and self.fwd_plan[-1] == head):
            return self
        out = ModelExecutePlan()
        out.fwd_plan = [*self.fwd_plan, head]
        out.bwd_plan = list(self.bwd_plan)
        return out


_CALLS = {"infer": "forward() without gradients", "train": "forward()"}


def _check_ranges(plan: object, name: str, allow_empty: bool) -> None:
    if not isinstance(plan, list) or (not plan and not allow_empty):
        raise InvalidPlanError(f"{name} must be a non-empty list of ranges, got {plan!r}")
    for r in plan:
        if not isinstance(r, range) or r.step != 1 or len(r) == 0:
            raise InvalidPlanError(
                f"{name} entries must be non-empty ranges with step 1, got {r!r}"
            )


def _check_cover(
    ordered: list[range], name: str, stop: int, order: str, short_hint: str = ""
) -> None:
    """``ordered`` (shallow to deep) must cover layers ``0..stop - 1`` contiguously, each once;
    ``short_hint`` is appended when it stops early."""
    pos = 0
    for r in ordered:
        if r.start != pos:
            raise InvalidPlanError(
                f"{name} does not cover layers contiguously ({order}, each layer once): expected "
                f"a stage starting at layer {pos}, got {r!r}"
            )
        pos = r.stop
    if pos > stop:
        raise InvalidPlanError(
            f"{name} covers layers 0..{pos - 1} but the model has {stop} layers (0..{stop - 1})"
        )
    if pos < stop:
        raise InvalidPlanError(
            f"{name} covers layers 0..{pos - 1} but the model has {stop} layers "
            f"(0..{stop - 1}){short_hint}"
        )


class ModelTracker:
    """Progress of one run: how many microbatches each stage finished, with bounded waits.

    Microbatches pass through a stage in order, so a count per stage is enough:
    stage ``g`` may process microbatch ``m`` once stage ``g - 1`` finished ``m + 1`` of them.
    """

    def __init__(self, execute_plan: ModelExecutePlan, state: RunState) -> None:
        self.fwd_plan = execute_plan.fwd_plan
        self.bwd_plan = execute_plan.bwd_plan
        self.state = state
        self.cond = threading.Condition()
        self.fwd_done = [0] * len(self.fwd_plan)
        self.bwd_done = [0] * len(self.bwd_plan)
        self._bwd_starts = {r.start for r in self.bwd_plan}

    def backward_need_input(self, layer_id: int) -> bool:
        """Whether backward recompute starts at ``layer_id`` (so forward must keep its input)."""
        return layer_id in self._bwd_starts

    def _notify(self, counts: list[int], gid: int) -> None:
        with self.cond:
            counts[gid] += 1
            self.cond.notify_all()

    def forward_notify(self, layer_group_id: int) -> None:
        """One more microbatch finished forward group ``layer_group_id``."""
        self._notify(self.fwd_done, layer_group_id)

    def backward_notify(self, layer_group_id: int) -> None:
        """One more microbatch finished backward group ``layer_group_id``."""
        self._notify(self.bwd_done, layer_group_id)

    def _wait_for(self, kind: str, counts: list[int], gid: int, microbatch_id: int) -> None:
        if self.state.failed():
            raise RoundPipeAborted(kind)
        if gid > 0:
            wait_until(
                lambda: counts[gid - 1] > microbatch_id,
                f"{kind} group {gid - 1} microbatch {microbatch_id}",
                self.cond,
                self.state,
            )

    def forward_wait_for(self, layer_group_id: int, microbatch_id: int) -> None:
        """Block until forward group ``layer_group_id - 1`` finished ``microbatch_id``."""
        self._wait_for("forward", self.fwd_done, layer_group_id, microbatch_id)

    def backward_wait_for(self, layer_group_id: int, microbatch_id: int) -> None:
        """Block until backward group ``layer_group_id - 1`` finished ``microbatch_id``."""
        self._wait_for("backward", self.bwd_done, layer_group_id, microbatch_id)

    def forward_ready(self, layer_group_id: int, microbatch_id: int) -> bool:
        """Whether forward group ``layer_group_id`` may process ``microbatch_id`` now (its input
        is on the host), without waiting.

        Example:
            >>> plan = ModelExecutePlan()
            >>> plan.fwd_plan = plan.bwd_plan = [range(0, 1)]
            >>> ModelTracker(plan, RunState("demo")).forward_ready(0, 5)
            True
        """
        with self.cond:
            return layer_group_id == 0 or self.fwd_done[layer_group_id - 1] > microbatch_id

    def backward_ready(self, layer_group_id: int, microbatch_id: int) -> bool:
        """Whether backward group ``layer_group_id`` may process ``microbatch_id`` now."""
        with self.cond:
            return layer_group_id == 0 or self.bwd_done[layer_group_id - 1] > microbatch_id

    def forward_wait_complete(self, num_microbatch: int) -> None:
        """Block until the last forward group finished ``num_microbatch`` microbatches."""
        g = len(self.fwd_plan) - 1
        wait_until(
            lambda: self.fwd_done[g] >= num_microbatch, "forward completion", self.cond, self.state
        )

    def backward_wait_complete(self, num_microbatch: int) -> None:
        """Block until the last backward group finished ``num_microbatch`` microbatches."""
        g = len(self.bwd_plan) - 1
        wait_until(
            lambda: self.bwd_done[g] >= num_microbatch, "backward completion", self.cond, self.state
        )

"""Execution plans (which layers form each pipeline stage) and their runtime tracking."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from ..devices.device import get_min_gpu_memory, get_num_devices
from ..devices.threads import RoundPipeAborted, RunState, wait_until

if TYPE_CHECKING:
    from torch import nn

    from ..wrapping.attribute import LayerAttribute
    from .timer import ModelTimer

__all__ = ["ModelExecutePlan", "ModelTracker", "PipelineModel", "partition_layers"]


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
        raise ValueError(f"run_type must be one of {_RUN_TYPES}, got {run_type!r}")


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
        raise ValueError("cannot partition a model with no layers")
    for i, s in enumerate(sizes):
        if s > 2 * mem_cap:
            raise ValueError(
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


class ModelExecutePlan:
    """Forward and backward stage layouts of a RoundPipe model.

    ``fwd_plan`` lists layer ranges in forward execution order; ``bwd_plan`` lists them in
    backward execution order (last layers first; each range ascending). For ``"fused"``
    runs the last forward stage is also the first backward stage.

    Example:
        >>> plan = ModelExecutePlan()
        >>> plan.fwd_plan = [range(0, 2), range(2, 4)]
        >>> plan.bwd_plan = [range(2, 4), range(0, 2)]
        >>> plan.check_valid(4, "fused")
    """

    def __init__(self) -> None:
        self.fwd_plan: list[range] = []
        self.bwd_plan: list[range] = []

    def __repr__(self) -> str:
        def fmt(plan: list[range]) -> str:
            return "[" + ", ".join(f"{r.start}-{r.stop - 1}" for r in plan) + "]"

        return f"ModelExecutePlan(fwd={fmt(self.fwd_plan)}, bwd={fmt(self.bwd_plan)})"

    @classmethod
    def auto(
        cls,
        run_type: RunType,
        /,
        *models: PipelineModel,
        min_stages: int | None = None,
        upper_threshold: float = 1.1,
        model_memory_limit: float | None = None,
    ) -> ModelExecutePlan:
        """Plan stages from the models' measured (or size-estimated) layer timings.

        Args:
            run_type: ``"infer"``, ``"train"`` (forward then separate backward) or ``"fused"``.
            models: RoundPipe models (:class:`PipelineModel`) with the same number of layers;
                their estimates add up.
            min_stages: at least this many stages when possible. Default: number of devices.
            upper_threshold: a stage takes at most this multiple of the slowest layer's time.
            model_memory_limit: GB per device for parameters (and grads when training);
                each stage gets half of it so the next stage can be prefetched.
                Default: 60% of the smallest device memory.
        """
        _check_run_type(run_type)
        if not models:
            raise ValueError("ModelExecutePlan.auto needs at least one model")
        n = models[0].num_layers
        if any(m.num_layers != n for m in models):
            raise ValueError(
                "all models passed to ModelExecutePlan.auto must have the same number of layers"
            )
        if not upper_threshold >= 1.0:
            raise ValueError(f"upper_threshold must be >= 1.0, got {upper_threshold}")
        min_stages = get_num_devices() if min_stages is None else min_stages
        if not isinstance(min_stages, int) or min_stages < 1:
            raise ValueError(f"min_stages must be a positive int, got {min_stages!r}")
        limit_gb = get_min_gpu_memory() * 0.6 if model_memory_limit is None else model_memory_limit
        if limit_gb <= 0:
            raise ValueError(f"model_memory_limit must be positive, got {model_memory_limit}")
        mem_cap = limit_gb * (1024**3) / 2
        fwd = [0.0] * n
        bwd = [0.0] * n
        infer_mem = [0.0] * n
        train_mem = [0.0] * n
        for m in models:
            _, f, b = m.model_timer.get_estimate(run_type)
            for i in range(n):
                fwd[i] += f[i]
                bwd[i] += b[i]
                infer_mem[i] += m.layer_bytes[i]
                train_mem[i] += m.layer_bytes[i] + m.layer_grad_bytes[i]
        plan = cls()
        if run_type == "infer":
            plan.fwd_plan = partition_layers(fwd, infer_mem, min_stages, upper_threshold, mem_cap)
        else:
            # backward is planned on reversed layers, by recompute + backward time
            rev = partition_layers(bwd[::-1], train_mem[::-1], min_stages, upper_threshold, mem_cap)
            plan.bwd_plan = [range(n - r.stop, n - r.start) for r in rev]
            if run_type == "train":
                plan.fwd_plan = partition_layers(
                    fwd, infer_mem, min_stages, upper_threshold, mem_cap
                )
            else:
                last = plan.bwd_plan[0]
                head = (
                    partition_layers(
                        fwd[: last.start],
                        infer_mem[: last.start],
                        max(min_stages - 1, 1),
                        upper_threshold,
                        mem_cap,
                    )
                    if last.start > 0
                    else []
                )
                plan.fwd_plan = head + [last]
        plan.check_valid(n, run_type)
        return plan

    def check_valid(self, num_layers: int, run_type: RunType) -> None:
        """Raise ``ValueError`` unless the plans cover every layer exactly once, in order."""
        _check_run_type(run_type)

        def check(plan: list[range], name: str, reverse: bool) -> None:
            if not isinstance(plan, list) or not plan:
                raise ValueError(f"{name} must be a non-empty list of ranges, got {plan!r}")
            for r in plan:
                if not isinstance(r, range) or r.step != 1 or len(r) == 0:
                    raise ValueError(
                        f"{name} entries must be non-empty ranges with step 1, got {r!r}"
                    )
            ordered = plan[::-1] if reverse else plan
            pos = 0
            for r in ordered:
                if r.start != pos:
                    raise ValueError(
                        f"{name} does not cover layers contiguously: expected a stage "
                        f"starting at layer {pos}, got {r!r}"
                    )
                pos = r.stop
            if pos != num_layers:
                raise ValueError(
                    f"{name} covers layers 0..{pos - 1} but the model has {num_layers}"
                )

        check(self.fwd_plan, "fwd_plan", reverse=False)
        if run_type == "infer":
            return
        check(self.bwd_plan, "bwd_plan", reverse=True)
        if run_type == "fused" and self.fwd_plan[-1] != self.bwd_plan[0]:
            raise ValueError(
                "for fused forward-backward the last fwd_plan stage must equal the "
                f"first bwd_plan stage, got {self.fwd_plan[-1]!r} and {self.bwd_plan[0]!r}"
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

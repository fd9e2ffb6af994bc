"""Per-layer latency measurement feeding the stage planner.

Before any measurement, estimates are proportional to layer size. Afterwards each layer's
forward and recompute + backward time is an exponential moving average (bias-corrected,
starting from 0). The first measured iteration is dropped as warm-up.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Literal

import torch

__all__ = ["IterTimer", "LayerTimingContext", "ModelTimer"]


class LayerTimingContext:
    """Measures the wall time of a block (CUDA events on a stream on GPU, else a clock)."""

    def __init__(self, start_event: Any, end_event: Any, stream: Any, sink: Any = None) -> None:
        self.start_event = start_event
        self.end_event = end_event
        self.stream = stream
        self.sink = sink
        self.t0 = 0.0

    def __enter__(self) -> LayerTimingContext:
        if self.start_event is not None:
            self.start_event.record(self.stream)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *args: Any) -> None:
        if self.end_event is not None:
            self.end_event.record(self.stream)
            ms: Any = (self.start_event, self.end_event)
        else:
            ms = (time.perf_counter() - self.t0) * 1000.0
        if self.sink is not None:
            self.sink(ms)


class IterTimer:
    """Collects the timings of one run and hands them to its :class:`ModelTimer`."""

    def __init__(self, parent: ModelTimer, use_cuda_events: bool) -> None:
        self.parent = parent
        self.use_cuda_events = use_cuda_events
        self.fwd_events: dict[int, list[Any]] = {}
        self.bwd_events: dict[tuple[int, int], list[Any]] = {}
        self.bwd_dict_lock = threading.Lock()

    def _events(self) -> tuple[Any, Any]:
        if self.use_cuda_events:
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return None, None

    def time_fwd(
        self, action: Literal["fwd", "re"], layer_idx: int, stream: Any
    ) -> LayerTimingContext:
        """Time one layer's forward (``"re"``: recompute, not recorded separately)."""

        def sink(v: Any) -> None:
            if action == "fwd":
                with self.bwd_dict_lock:
                    self.fwd_events.setdefault(layer_idx, []).append(v)

        s, e = self._events()
        return LayerTimingContext(s, e, stream, sink)

    def time_bwd(self, layer_ids: range, stream: Any) -> LayerTimingContext:
        """Time recompute + backward of a layer group."""

        def sink(v: Any) -> None:
            with self.bwd_dict_lock:
                self.bwd_events.setdefault((layer_ids.start, layer_ids.stop), []).append(v)

        s, e = self._events()
        return LayerTimingContext(s, e, stream, sink)

    def finish(self) -> None:
        """Push this run's measurements to the parent timer."""
        self.parent.iter_results.append(self)


def _ms(v: Any) -> float:
    if isinstance(v, tuple):
        v[1].synchronize()
        return float(v[0].elapsed_time(v[1]))
    return float(v)


class ModelTimer:
    """Smoothed per-layer forward and backward time estimates.

    Example:
        >>> t = ModelTimer(2, [100, 300])
        >>> t.get_estimate("train")[0]
        'memory'
    """

    SMOOTH_RATE = 0.3
    BACKWARD_MULTIPLIER = 3.0  # recompute (1x) + backward (~2x)
    VERBOSE = False

    def __init__(self, n_layers: int, layer_sizes: list[int]) -> None:
        self.n_layers = n_layers
        base = [max(float(s), 1.0) for s in layer_sizes]
        self.size_estimate = base
        self.stage = {"fwd": 0, "bwd": 0}
        self.scale = {"fwd": 0.0, "bwd": 0.0}
        self.estimate: dict[str, list[float]] = {"fwd": [0.0] * n_layers, "bwd": [0.0] * n_layers}
        self.iter_results: list[IterTimer] = []
        self._lock = threading.Lock()

    def new_iter(self, use_cuda_events: bool) -> IterTimer:
        """Start collecting timings of one run."""
        return IterTimer(self, use_cuda_events)

    def _update(self, kind: str, values: list[float | None]) -> None:
        if all(v is None for v in values):
            return
        if self.stage[kind] == 0:  # drop the first (warm-up) measurement
            self.stage[kind] = 1
            return
        self.stage[kind] = 2
        r = self.SMOOTH_RATE
        self.scale[kind] = self.scale[kind] * (1 - r) + r
        est = self.estimate[kind]
        for i, v in enumerate(values):
            if v is not None:
                est[i] = est[i] * (1 - r) + r * v

    def update_times(self) -> None:
        """Fold finished runs into the estimates."""
        with self._lock:
            results, self.iter_results = self.iter_results, []
        for it in results:
            fwd: list[float | None] = [None] * self.n_layers
            for i, vals in it.fwd_events.items():
                fwd[i] = sum(_ms(v) for v in vals)
            self._update("fwd", fwd)
            bwd: list[float | None] = [None] * self.n_layers
            for (a, b), vals in it.bwd_events.items():
                total = sum(_ms(v) for v in vals)
                # split a group's time over its layers proportionally to their forward time
                weights = [
                    max(self.estimate["fwd"][i], 1e-9)
                    if self.stage["fwd"] == 2
                    else self.size_estimate[i]
                    for i in range(a, b)
                ]
                wsum = sum(weights)
                for i, w in zip(range(a, b), weights):
                    bwd[i] = total * w / wsum
            self._update("bwd", bwd)
            if self.VERBOSE:
                print(f"[roundpipe timer] fwd={self.estimate['fwd']} bwd={self.estimate['bwd']}")

    def get_estimate(
        self, run_type: Literal["infer", "train", "fused"]
    ) -> tuple[str, list[float], list[float]]:
        """Return ``(source, fwd, bwd)``: source is ``"time"`` (ms) or ``"memory"`` (bytes)."""
        self.update_times()
        if self.stage["fwd"] == 2 and (run_type == "infer" or self.stage["bwd"] == 2):
            fwd = [v / self.scale["fwd"] for v in self.estimate["fwd"]]
            if run_type == "infer":
                return "time", fwd, [0.0] * self.n_layers
            bwd = [v / self.scale["bwd"] for v in self.estimate["bwd"]]
            return "time", fwd, bwd
        fwd = list(self.size_estimate)
        return "memory", fwd, [v * self.BACKWARD_MULTIPLIER for v in fwd]

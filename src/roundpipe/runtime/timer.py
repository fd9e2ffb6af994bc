"""Per-layer latency measurement feeding the stage planner.

Three passes are timed per layer: ``fwd`` (a forward stage), ``re`` (the forward a backward
stage runs again: recompute, or the fused stage's only forward) and ``bwd`` (the rest of a
backward stage: back-propagation, and the loss in the fused stage). Before any measurement,
estimates are proportional to layer size. Afterwards each is an exponential moving average
(bias-corrected, starting from 0); the first measured iteration of each pass is dropped as
warm-up. The planner reads forward time and recompute + backward time.

``ModelTimer.VERBOSE = True`` prints, after every iteration, one line per layer and pass to
stderr::

    Layer 0 fwd  new record: 1.234 ms  new estimate: 1.200 ms
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Literal, TextIO

import torch

__all__ = ["IterTimer", "LayerTimingContext", "ModelTimer"]

Pass = Literal["fwd", "re", "bwd"]
PASSES: tuple[Pass, ...] = ("fwd", "re", "bwd")


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
    """Collects the timings of one run and hands them to its :class:`ModelTimer`.

    A run may finish in two parts (``forward()`` then the backward of its output): each
    :meth:`finish` hands over what was recorded since the previous one, so every record is
    folded into the estimates once.
    """

    def __init__(self, parent: ModelTimer, use_cuda_events: bool) -> None:
        self.parent = parent
        self.use_cuda_events = use_cuda_events
        self.fwd_events: dict[int, list[Any]] = {}
        self.re_events: dict[int, list[Any]] = {}
        self.bwd_events: dict[tuple[int, int], list[Any]] = {}
        self.bwd_dict_lock = threading.Lock()

    def _events(self) -> tuple[Any, Any]:
        if self.use_cuda_events:
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return None, None

    def time_fwd(
        self, action: Literal["fwd", "re"], layer_idx: int, stream: Any
    ) -> LayerTimingContext:
        """Time one layer's forward (``"fwd"``) or the forward a backward stage runs
        (``"re"``: recompute, or the fused stage's forward)."""
        name = "fwd_events" if action == "fwd" else "re_events"

        def sink(v: Any) -> None:
            with self.bwd_dict_lock:
                getattr(self, name).setdefault(layer_idx, []).append(v)

        s, e = self._events()
        return LayerTimingContext(s, e, stream, sink)

    def time_bwd(self, layer_ids: range, stream: Any) -> LayerTimingContext:
        """Time a whole backward (or fused) stage: its ``re`` records are subtracted later."""

        def sink(v: Any) -> None:
            with self.bwd_dict_lock:
                self.bwd_events.setdefault((layer_ids.start, layer_ids.stop), []).append(v)

        s, e = self._events()
        return LayerTimingContext(s, e, stream, sink)

    def finish(self) -> None:
        """Push the measurements recorded since the last push to the parent timer (and print
        them when verbose)."""
        with self.bwd_dict_lock:
            part = _Records(self.fwd_events, self.re_events, self.bwd_events)
            self.fwd_events, self.re_events, self.bwd_events = {}, {}, {}
        with self.parent._lock:
            self.parent.iter_results.append(part)
        if self.parent.VERBOSE:
            self.parent.update_times()


class _Records:
    """One push of an :class:`IterTimer`: per-layer ``fwd`` / ``re`` and per-stage records."""

    __slots__ = ("fwd_events", "re_events", "bwd_events")

    def __init__(
        self,
        fwd_events: dict[int, list[Any]],
        re_events: dict[int, list[Any]],
        bwd_events: dict[tuple[int, int], list[Any]],
    ) -> None:
        self.fwd_events, self.re_events, self.bwd_events = fwd_events, re_events, bwd_events


def _ms(v: Any) -> float:
    if isinstance(v, tuple):
        v[1].synchronize()
        return float(v[0].elapsed_time(v[1]))
    return float(v)


def _per_layer(n: int, events: dict[int, list[Any]]) -> list[float | None]:
    out: list[float | None] = [None] * n
    for i, vals in events.items():
        out[i] = sum(_ms(v) for v in vals)
    return out


class ModelTimer:
    """Smoothed per-layer forward, recompute and backward time estimates.

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
        self.stage: dict[str, int] = {k: 0 for k in PASSES}
        self.scale: dict[str, float] = {k: 0.0 for k in PASSES}
        self.estimate: dict[str, list[float]] = {k: [0.0] * n_layers for k in PASSES}
        self.iter_results: list[_Records] = []
        self._lock = threading.RLock()

    def new_iter(self, use_cuda_events: bool) -> IterTimer:
        """Start collecting timings of one run."""
        return IterTimer(self, use_cuda_events)

    def _update(self, kind: str, values: list[float | None]) -> bool:
        """Fold one iteration's records of ``kind`` in; False for none or the warm-up."""
        if all(v is None for v in values):
            return False
        if self.stage[kind] == 0:  # drop the first (warm-up) measurement
            self.stage[kind] = 1
            return False
        self.stage[kind] = 2
        r = self.SMOOTH_RATE
        self.scale[kind] = self.scale[kind] * (1 - r) + r
        est = self.estimate[kind]
        for i, v in enumerate(values):
            if v is not None:
                est[i] = est[i] * (1 - r) + r * v
        return True

    def _backward_only(
        self, bwd_events: dict[tuple[int, int], list[Any]], re: list[float | None]
    ) -> list[float | None]:
        """Each stage's time minus its layers' ``re`` records, split over its layers in
        proportion to their recompute time (their size before any)."""
        out: list[float | None] = [None] * self.n_layers
        for (a, b), vals in bwd_events.items():
            rest = sum(_ms(v) for v in vals) - sum(re[i] or 0.0 for i in range(a, b))
            weights = [re[i] if re[i] else self.size_estimate[i] for i in range(a, b)]
            wsum = sum(weights)
            for i, w in zip(range(a, b), weights):
                out[i] = max(rest, 0.0) * w / wsum
        return out

    def update_times(self) -> None:
        """Fold finished runs into the estimates (printing them when :attr:`VERBOSE`)."""
        with self._lock:
            results, self.iter_results = self.iter_results, []
            for it in results:
                records = {
                    "fwd": _per_layer(self.n_layers, it.fwd_events),
                    "re": _per_layer(self.n_layers, it.re_events),
                }
                records["bwd"] = self._backward_only(it.bwd_events, records["re"])
                folded = {k: self._update(k, records[k]) for k in PASSES}
                if self.VERBOSE:
                    self._print(records, folded, sys.stderr)

    def _print(
        self, records: dict[str, list[float | None]], folded: dict[str, bool], out: TextIO
    ) -> None:
        """One line per layer and folded pass: this iteration's record and the new estimate."""
        lines = []
        for i in range(self.n_layers):
            for k in PASSES:
                v = records[k][i]
                if folded[k] and v is not None:
                    est = self.estimate[k][i] / self.scale[k]
                    lines.append(
                        f"Layer {i} {k:<3}  new record: {v:.3f} ms  new estimate: {est:.3f} ms"
                    )
        if lines:
            print("\n".join(lines), file=out, flush=True)

    def get_estimate(
        self, run_type: Literal["infer", "train", "fused"]
    ) -> tuple[str, list[float], list[float]]:
        """Return ``(source, fwd, bwd)``: source is ``"time"`` (ms) or ``"memory"`` (bytes);
        ``bwd`` is a backward stage's time per layer (recompute + backward)."""
        self.update_times()
        with self._lock:
            ready = self.stage["fwd"] == 2 and (
                run_type == "infer" or (self.stage["bwd"] == 2 and self.stage["re"] == 2)
            )
            if ready:
                fwd = [v / self.scale["fwd"] for v in self.estimate["fwd"]]
                if run_type == "infer":
                    return "time", fwd, [0.0] * self.n_layers
                bwd = [
                    r / self.scale["re"] + b / self.scale["bwd"]
                    for r, b in zip(self.estimate["re"], self.estimate["bwd"])
                ]
                return "time", fwd, bwd
        fwd = list(self.size_estimate)
        return "memory", fwd, [v * self.BACKWARD_MULTIPLIER for v in fwd]

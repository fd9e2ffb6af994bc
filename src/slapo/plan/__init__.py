"""Planning a run before trying it: the step time of a layout on a described cluster.

* :mod:`~slapo.plan.hardware`: :class:`DeviceSpec` and :class:`ClusterSpec`, shipped presets
  and a JSON device file;
* :mod:`~slapo.plan.step_time`: :func:`predict_step`, the seconds, tokens/s, MFU and memory
  of one rank's training step, from the fake step the memory planner runs.
"""

from __future__ import annotations

from . import tune_predictor  # noqa: F401, E402  (registers slapo tune --predict for slapo train)
from .calibrate import calibrate_collectives, calibrate_device, calibrate_shapes, write_calibration
from .hardware import (
    PRESETS,
    ClusterSpec,
    DeviceSpec,
    DeviceSpecError,
    Link,
    load_device,
    save_device,
)
from .step_time import PlanError, StepCounter, StepPrediction, predict_step

__all__ = [
    "PRESETS",
    "ClusterSpec",
    "DeviceSpec",
    "DeviceSpecError",
    "Link",
    "PlanError",
    "StepCounter",
    "StepPrediction",
    "calibrate_collectives",
    "calibrate_device",
    "calibrate_shapes",
    "load_device",
    "predict_step",
    "save_device",
    "write_calibration",
]

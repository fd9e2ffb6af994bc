"""``slapo tune --predict DEVICE`` for ``slapo train`` commands: the planner registers its
prediction of each trial with the tuner (which sits below the planner and imports none of it).

Example:
    >>> from slapo.tune.predict import command_predictor
    >>> predict, capacity = command_predictor(["slapo", "train", "--model", "opt"], "h100")
    >>> capacity == int(PRESETS["h100-sxm"].hbm_gib * 2**30)
    True
    >>> predict({"ckpt_ratio": 1.0}).tokens_per_s_per_gpu > 0  # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..train.train_cli import trial_config
from ..tune.memory_budget import train_argv
from ..tune.predict import Predictor, register_command_predictor
from ..tune.space import Value
from .hardware import PRESETS, ClusterSpec, DeviceSpec, DeviceSpecError, load_device

__all__ = ["device_named", "train_predictor"]


def device_named(name: str) -> DeviceSpec:
    """A preset by ``slapo plan --gpu``'s names (``h100``, ``h200``, ...), else a device file.

    Example:
        >>> device_named("h100").name
        'h100-sxm'
    """
    from .plan_cli import GPU_NAMES

    preset = GPU_NAMES.get(str(name).lower())
    if preset:
        return PRESETS[preset]
    if not Path(name).is_file():
        raise DeviceSpecError(
            f"device {name!r}: neither a preset ({', '.join(sorted(GPU_NAMES))}) nor a device "
            "file (write one with slapo plan --calibrate FILE)"
        )
    return load_device(name)


@register_command_predictor
def train_predictor(command: Sequence[str], device: str) -> tuple[Predictor, int] | None:
    """``predict(cfg)`` of a ``slapo train`` command's trials on ``device`` (a preset name or a
    device file), and the device's memory in bytes; None for any other command. Each trial's
    step is predicted as :func:`slapo.plan.search.predict_config` predicts it.

    Example:
        >>> predict, capacity = train_predictor(["slapo", "train", "--model", "opt"], "h100")
        >>> predict({"ckpt_ratio": 1.0}).tokens_per_s_per_gpu > 0  # doctest: +SKIP
        True
    """
    argv = train_argv(command)
    if argv is None:
        return None
    from .search import predict_config  # deferred: fake tensors load on first use

    spec = device_named(device)
    cluster = ClusterSpec(spec)
    cache: dict[Any, Any] = {}

    def predict(cfg: Mapping[str, Value]) -> Any:
        train_cfg, dp = trial_config(argv, cfg)
        return predict_config(train_cfg, cluster, dp=dp or 1, cache=cache)

    return predict, int(spec.hbm_gib * 2**30)

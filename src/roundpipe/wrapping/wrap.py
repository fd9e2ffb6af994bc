"""Wrap user models with RoundPipe: explicit layers, family presets, or a size heuristic."""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

from torch import nn

from ..devices.device import get_num_devices
from ..errors import RoundPipeTypeError, RoundPipeValueError
from ..models import find_preset, wrap_model
from ..runtime.run_config import RoundPipeRunConfig
from .model import AutoRoundPipe, RoundPipe, RoundPipeBase
from .sizes import get_call_location, get_model_size

__all__ = ["wrap_model_recursive", "wrap_model_to_roundpipe"]


def wrap_model_recursive(
    model: nn.Module,
    lower_threshold: int,
    upper_threshold: int,
    skip_modules: Container[nn.Module],
    override_config: dict[nn.Module, RoundPipeRunConfig],
    model_run_config: RoundPipeRunConfig,
    name: str,
    **roundpipe_kwargs: Any,
) -> nn.Module:
    """Replace the heavy parts of ``model`` by RoundPipe instances (in place where possible).

    A module between ``lower_threshold`` and ``upper_threshold`` bytes becomes one RoundPipe
    layer; an ``nn.Sequential`` above it becomes a RoundPipe over its children; any other
    large module is descended into. Modules below ``lower_threshold`` stay on the host.
    """
    if model in skip_modules or isinstance(model, RoundPipeBase):
        return model
    size = get_model_size(model)
    cfg = override_config.get(model, model_run_config)
    if size < lower_threshold:
        return model
    if size <= upper_threshold:
        return RoundPipe(model, name=name, model_run_config=cfg, **roundpipe_kwargs)
    if isinstance(model, nn.Sequential):
        return RoundPipe(model, name=name, model_run_config=cfg, **roundpipe_kwargs)
    for child_name, child in list(model.named_children()):
        new = wrap_model_recursive(
            child,
            lower_threshold,
            upper_threshold,
            skip_modules,
            override_config,
            model_run_config,
            f"{name}.{child_name}",
            **roundpipe_kwargs,
        )
        if new is not child:
            setattr(model, child_name, new)
    return model


def wrap_model_to_roundpipe(
    model: nn.Module,
    use_sequential_preset: bool | None = None,
    lower_threshold: int = 16 * 1024,
    upper_threshold: int | None = None,
    skip_modules: Container[nn.Module] = (),
    override_config: dict[nn.Module, RoundPipeRunConfig] | None = None,
    model_run_config: RoundPipeRunConfig | None = None,
    name: str | None = None,
    layers: Sequence[nn.Module] | None = None,
    **roundpipe_kwargs: Any,
) -> RoundPipeBase:
    """Wrap ``model`` for RoundPipe training.

    Resolution order: explicit ``layers`` (a list of modules in execution order, e.g. from a
    schedule's pipeline cuts) -> the family preset (Llama, Qwen3, Qwen3-MoE, GPT-OSS, GPT-2; also
    inside a ``peft`` LoRA model; see :mod:`roundpipe.models` for its loss) -> the recursive size
    heuristic, returning an :class:`AutoRoundPipe` around the partly wrapped model.

    Parameters frozen at this point (``requires_grad=False``, e.g. a LoRA model's base weights)
    get no optimizer copy: ``optim_parameters()`` yields the trainable ones only.

    Args:
        model: module to wrap.
        use_sequential_preset: ``None``/``True`` try the family preset (``True``: it must exist);
            ``False`` skips it.
        lower_threshold / upper_threshold: size bounds (bytes) of the heuristic; the upper one
            defaults to the model size divided by (number of devices + 1).
        skip_modules: modules the heuristic must leave untouched.
        override_config: run config per module for the heuristic.
        model_run_config: default run config.
        name: label (default: ``file:line`` of the call).
        layers: explicit layer list; layer ``i + 1`` receives layer ``i``'s output.
        **roundpipe_kwargs: forwarded to :class:`RoundPipe` (``pin_model``, ``optim_dtype``).

    Raises:
        NotImplementedError: ``use_sequential_preset=True`` but no preset fits the model.
        ValueError: the model has no parameters or buffers (e.g. an empty ``nn.Sequential``).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> rp = wrap_model_to_roundpipe(net, layers=list(net), pin_model="off")
        >>> rp.num_layers
        3
    """
    if not isinstance(model, nn.Module):
        raise RoundPipeTypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if use_sequential_preset not in (None, True, False):
        raise RoundPipeTypeError(
            f"use_sequential_preset must be None or a bool, got {use_sequential_preset!r}"
        )
    model_run_config = model_run_config or RoundPipeRunConfig()
    name = name or get_call_location(1)
    if layers is None and get_model_size(model) == 0:
        what = "has no layers" if not list(model.children()) else "has no parameters or buffers"
        raise RoundPipeValueError(
            f"wrap_model_to_roundpipe: the model ({type(model).__name__}) {what}, so RoundPipe "
            "has nothing to stream to the devices or train; wrap a model that has parameters"
        )
    if layers is not None:
        return RoundPipe(
            model, name=name, model_run_config=model_run_config, layers=layers, **roundpipe_kwargs
        )
    if use_sequential_preset is not False:
        if find_preset(model) is not None or use_sequential_preset:
            return wrap_model(
                model, name=name, model_run_config=model_run_config, **roundpipe_kwargs
            )
    if upper_threshold is None:
        upper_threshold = max(get_model_size(model) // (get_num_devices() + 1), 1)
    if lower_threshold < 0 or upper_threshold < lower_threshold:
        raise RoundPipeValueError(
            "need 0 <= lower_threshold <= upper_threshold, got "
            f"{lower_threshold}, {upper_threshold}"
        )
    wrapped = wrap_model_recursive(
        model,
        lower_threshold,
        upper_threshold,
        skip_modules,
        override_config or {},
        model_run_config,
        name,
        **roundpipe_kwargs,
    )
    if isinstance(wrapped, RoundPipe):
        return wrapped
    auto = AutoRoundPipe(wrapped, name=name, optim_dtype=roundpipe_kwargs.get("optim_dtype"))
    return auto

"""The ``"roundpipe"`` target: train the scheduled model on the RoundPipe runtime.

All model state stays in CPU memory and layers stream round-robin to the devices. The layers are
the children of an ``nn.Sequential`` root, or RoundPipe's family preset (Llama, Qwen3, GPT-2) or
its size heuristic otherwise. Pipeline cuts (``cut_pipeline_stage``) become RoundPipe's stage
plan: a cut after a module ends a stage after the RoundPipe layer that holds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..exceptions import TargetError
from ..precision import PRECISIONS, Precision
from ..primitives.cut_pipeline_stage import pipeline_cuts
from ..surgery import carry_signature
from .common import OptimizerSpec, make_optimizer
from .mixed_precision import GRAD_SCALER_ATTR
from .target_registry import register_target

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["build_roundpipe", "stage_plan"]


@register_target("roundpipe", precisions=PRECISIONS, host_state=True, memory="roundpipe")
def build_roundpipe(
    sch: Schedule,
    num_microbatch: int | None = None,
    run_config: Any = None,
    pin_model: str = "alloc",
    optimizer: OptimizerSpec = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    async_step: bool = False,
    precision: Precision | str | torch.dtype | None = None,
    **roundpipe_kwargs: Any,
) -> tuple[Any, Any]:
    """Wrap the scheduled model with RoundPipe; returns ``(roundpipe_model, optimizer)``.

    The optimizer is a ``roundpipe.optim.RoundPipeOptimizer`` around ``optimizer`` created over
    RoundPipe's optimizer copies (``model.optim_parameters()``), so the ordinary loop
    (``loss.backward(); opt.step(); opt.zero_grad()``, lr schedulers, state dicts) and the
    training-loop contract (``slapo.train_step(model, batch)``, then the optimizer) train the
    model; the inner optimizer is ``opt.optimizer``.

    Args:
        num_microbatch: microbatches per step (ignored when ``run_config`` is given).
        run_config: a ``roundpipe.RoundPipeRunConfig``.
        pin_model: ``"alloc"``, ``"register"`` or ``"off"`` (pinning only where a device has it).
        optimizer: e.g. ``roundpipe.optim.Adam`` or ``torch.optim.AdamW``.
        async_step: ``False`` (default): ``opt.step()`` returns once the model holds the new
            weights, as in torch. ``True``: RoundPipe's asynchronous step; the next iteration
            runs on one-step-stale weights while the optimizer thread steps.
        precision: ``"bf16"``/``"fp16"``: RoundPipe's mixed precision: the model (in host
            memory, streamed to the devices) is cast to that dtype and computes in it, while
            the optimizer steps float32 copies (``optim_dtype=torch.float32``): the master
            weights and their state. fp16 scales the loss with ``roundpipe.GradScaler``
            (``slapo.train_step`` scales it; the optimizer unscales on RoundPipe's optimizer
            thread and skips a step that overflowed).
        **roundpipe_kwargs: passed to ``roundpipe.wrap_model_to_roundpipe``.

    Example:
        >>> import roundpipe
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
        >>> sch["1"].cut_pipeline_stage()
        >>> model, opt = slapo.build(sch, target="roundpipe", num_microbatch=2,
        ...                          optimizer=roundpipe.optim.Adam)
        >>> loss = ((model(torch.randn(4, 8)) - torch.randn(4, 1)) ** 2).mean()
        >>> loss.backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """
    # deferred: `import slapo` does not start the RoundPipe runtime (its C++ optimizer, threads)
    import roundpipe
    from roundpipe.optim import RoundPipeOptimizer

    if not isinstance(async_step, bool):
        raise TargetError(f"async_step must be True or False, got {async_step!r}")
    if run_config is None:
        run_config = roundpipe.RoundPipeRunConfig(num_microbatch=num_microbatch)
    elif num_microbatch is not None:
        raise TargetError("pass num_microbatch inside run_config, not both")
    precision = Precision.of(precision)
    root = sch.mod
    if precision.mixed:
        if roundpipe_kwargs.get("optim_dtype", torch.float32) != torch.float32:
            raise TargetError(
                f"precision={precision.name!r} keeps float32 optimizer copies (the master "
                "weights); drop optim_dtype="
            )
        roundpipe_kwargs["optim_dtype"] = torch.float32
        root.to(precision.compute_dtype)
    layers = list(root) if isinstance(root, nn.Sequential) else None
    model = roundpipe.wrap_model_to_roundpipe(
        root, layers=layers, model_run_config=run_config, pin_model=pin_model, **roundpipe_kwargs
    )
    # RoundPipe's forward(*args, roundpipe_run_config=None, **kwargs) shows the model's own
    # (roundpipe_run_config= is still taken)
    carry_signature(model, root)
    cuts = pipeline_cuts(sch)
    if cuts:
        if run_config.execute_plan is not None:
            raise TargetError(
                "the schedule has pipeline cuts and run_config has an execute_plan: keep one"
            )
        layer_list = getattr(model, "layers", None)
        if layer_list is None:
            raise TargetError(
                "pipeline cuts need a model RoundPipe splits into a layer list (an nn.Sequential "
                f"or a Llama/Qwen3/GPT-2 model); {type(root).__name__} went to the size heuristic"
            )
        run_config.execute_plan = stage_plan(layer_list, [(p, root.get_submodule(p)) for p in cuts])
    inner = make_optimizer(model.optim_parameters(), optimizer, optimizer_kwargs)
    if inner is None:
        return model, None
    if not isinstance(inner, torch.optim.Optimizer):
        raise TargetError(
            f"optimizer= made a {type(inner).__name__}; target roundpipe needs a "
            "torch.optim.Optimizer (e.g. optimizer=torch.optim.AdamW or roundpipe.optim.Adam)"
        )
    scaler = roundpipe.GradScaler() if precision.loss_scaling else None
    if scaler is not None:  # slapo.train_step scales the loss with it
        object.__setattr__(model, GRAD_SCALER_ATTR, scaler)
    return model, RoundPipeOptimizer(model, inner, is_async=async_step, scaler=scaler)


def stage_plan(layers: list[nn.Module], cuts: list[tuple[str, nn.Module]]) -> Any:
    """A RoundPipe plan whose stages end after the layers holding the cut modules.

    Example:
        >>> seq = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
        >>> stage_plan(list(seq), [("1", seq[1])]).fwd_plan   # 5 layers, a cut after layer 1
        [range(0, 2), range(2, 5)]
    """
    import roundpipe  # deferred: as in build_roundpipe

    ends = sorted({_layer_index(layers, path, module) for path, module in cuts})
    if ends[-1] == len(layers) - 1:
        raise TargetError(
            f"a cut after the last RoundPipe layer ({len(layers) - 1}) leaves an empty stage; "
            "remove the cut after the model's last module"
        )
    bounds = [-1, *ends, len(layers) - 1]
    stages = [range(a + 1, b + 1) for a, b in zip(bounds, bounds[1:])]
    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = stages
    plan.bwd_plan = stages[::-1]
    plan.check_valid(len(layers), "fused")
    return plan


def _layer_index(layers: list[nn.Module], path: str, module: nn.Module) -> int:
    members = set(module.modules())
    hits = [
        i for i, layer in enumerate(layers) if module in set(layer.modules()) or layer in members
    ]
    if not hits:
        raise TargetError(f'cut_pipeline_stage on "{path}": no RoundPipe layer holds this module')
    return max(hits)

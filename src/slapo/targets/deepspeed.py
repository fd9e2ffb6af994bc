"""The ``"deepspeed"`` target: ZeRO data parallelism through ``deepspeed.initialize``.

Registered whether or not DeepSpeed is installed, so that asking for it without DeepSpeed says
how to get it instead of "no such target".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ..exceptions import TargetError
from .common import OptimizerSpec, make_optimizer, require_distributed
from .registry import register_target

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["build_deepspeed"]


def _import_deepspeed() -> Any:
    try:
        import deepspeed  # deferred: optional and heavy; asking for the target says how to get it
    except ImportError as exc:
        raise TargetError(
            'target "deepspeed" needs DeepSpeed, which is not installed: pip install deepspeed '
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return deepspeed


@register_target("deepspeed")
def build_deepspeed(
    sch: Schedule,
    config: dict[str, Any] | None = None,
    zero_stage: int | None = None,
    micro_batch_size: int = 1,
    optimizer: OptimizerSpec = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    **initialize_kwargs: Any,
) -> tuple[nn.Module, Any]:
    """Wrap the scheduled model in a DeepSpeed engine (``deepspeed.initialize``).

    Args:
        config: a DeepSpeed config dict; default: ZeRO ``zero_stage`` with
            ``train_micro_batch_size_per_gpu=micro_batch_size``.
        zero_stage: 0, 1, 2 or 3; overrides ``config["zero_optimization"]["stage"]`` when given.
        optimizer: an optimizer class or factory created over the model's parameters (else the
            config's ``"optimizer"`` section, if any, makes one).
        initialize_kwargs: passed on to ``deepspeed.initialize``.

    Returns ``(engine, optimizer)``; train with ``engine(**batch).loss``,
    ``engine.backward(loss)``, ``engine.step()``.

    Example:
        >>> engine, opt = slapo.build(sch, target="deepspeed", zero_stage=2,
        ...                           optimizer=torch.optim.AdamW)
        >>> loss = engine(**batch).loss; engine.backward(loss); engine.step()
    """
    deepspeed = _import_deepspeed()
    require_distributed("deepspeed")
    if zero_stage is not None and zero_stage not in (0, 1, 2, 3):
        raise TargetError(f'target "deepspeed": zero_stage= must be 0, 1, 2 or 3, got {zero_stage}')
    cfg = dict(config) if config is not None else {}
    cfg.setdefault("train_micro_batch_size_per_gpu", micro_batch_size)
    if zero_stage is not None:
        cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": zero_stage}
    model = sch.mod
    opt = make_optimizer(model, optimizer, optimizer_kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        engine, ds_opt, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, model_parameters=params, config=cfg, **initialize_kwargs
        )
    except (TypeError, ValueError, AssertionError) as exc:  # a bad config or option: name it
        raise TargetError(
            f'target "deepspeed": deepspeed.initialize rejected {cfg}: {exc}'
        ) from exc
    return engine, ds_opt if ds_opt is not None else opt


def deepspeed_available() -> bool:
    """Whether DeepSpeed can be imported (its tests skip otherwise).

    Example:
        >>> isinstance(deepspeed_available(), bool)
        True
    """
    try:
        _import_deepspeed()
    except TargetError:
        return False
    return True

"""Meta-device models: create without memory, materialize with the model's own initialization."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn

__all__ = ["init_empty_weights", "has_meta_tensors", "materialize_module"]

ParamInitFn = Callable[[nn.Module], None]


@contextlib.contextmanager
def init_empty_weights(enable: bool = True, include_buffers: bool = False) -> Iterator[None]:
    """Create models with every parameter on the meta device: no memory, no initialization cost.

    Useful when building the full model would not fit in RAM: schedule it first, shard it, then let
    ``slapo.build`` (or ``consolidate_model``) materialize only what this rank holds.

    Args:
        enable: whether the context manager does anything (handy for a command-line switch).
        include_buffers: also put buffers on the meta device. Buffers are small and some are
            computed at construction (rotary ``inv_freq``), so they stay real by default; meta
            buffers are zero-filled on materialization and then refilled by the model's init.

    Example:
        >>> with init_empty_weights():
        ...     layer = nn.Linear(4096, 4096)
        >>> layer.weight.device.type
        'meta'
    """
    if not enable:
        yield
        return
    original_param = nn.Module.register_parameter
    original_buffer = nn.Module.register_buffer

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original_param(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    def register_buffer(module: nn.Module, name: str, tensor: Any, persistent: bool = True) -> None:
        original_buffer(module, name, tensor, persistent=persistent)
        if tensor is not None:
            module._buffers[name] = module._buffers[name].to("meta")

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    if include_buffers:
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original_param  # type: ignore[method-assign]
        nn.Module.register_buffer = original_buffer  # type: ignore[method-assign]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.is_meta for t in tensors)


def materialize_module(
    model: nn.Module,
    init_fn: ParamInitFn | None = None,
    device: torch.device | str = "cpu",
) -> list[nn.Module]:
    """Give every meta parameter and buffer real storage on ``device`` and initialize it.

    Tied parameters stay tied (one new tensor per meta tensor), and attributes set on a parameter
    (``annotate`` tags) are kept. Initialization, for the modules that had meta tensors only:

    * ``init_fn(module)`` for each such module when given;
    * otherwise the Hugging Face model's own ``init_weights`` (which also recomputes rotary
      ``inv_freq`` buffers and re-ties weights), or ``reset_parameters()`` of plain modules.

    Returns the modules that were materialized.

    Example:
        >>> with init_empty_weights():
        ...     layer = nn.Linear(4, 4)
        >>> _ = materialize_module(layer)
        >>> layer.weight.device.type
        'cpu'
    """
    memo = _TensorMemo()
    had_meta: set[int] = set()  # ids of the modules (the model's or originals) given storage
    touched = [m for m in model.modules() if _materialize_own(m, memo, device)]
    if not touched:
        return touched
    had_meta.update(id(m) for m in touched)
    originals = _originals(model)
    for traced, original in originals:
        _mirror(traced, original, had_meta)
        for module in original.modules():  # what the graph lacks: storage anyway
            if _materialize_own(module, memo, device):
                had_meta.add(id(module))
    _rebind_retracers(model, memo)
    order = _init_order(model, dict(originals), had_meta)
    in_model = {id(m) for m in model.modules()}

    if init_fn is not None:
        with torch.no_grad():
            for module in order:
                init_fn(module)
        return touched
    _default_init(model, [m for m in order if id(m) in in_model])
    _init_originals(model, [m for m in order if id(m) not in in_model])
    return touched


class _TensorMemo(dict):
    """``id(meta tensor) -> its new tensor``, holding every meta tensor it has seen.

    Keys are ids, and an id is unique only among living objects: a meta tensor freed once its
    module points at the new one would let a tensor created later (a traced block's original,
    say) take its id and be handed another tensor's storage, of another shape or values. So the
    memo keeps them alive until materialization is done.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def put(self, meta: torch.Tensor, new: torch.Tensor) -> None:
        self.seen.append(meta)
        self[id(meta)] = new


def _materialize_own(module: nn.Module, memo: _TensorMemo, device: Any) -> bool:
    """Give ``module``'s own meta parameters and buffers storage (one new tensor per meta
    tensor, through ``memo``); returns whether it had any."""
    changed = False
    for name, param in list(module._parameters.items()):
        if param is None or not param.is_meta:
            continue
        if id(param) not in memo:
            new = type(param)(
                torch.empty_like(param, device=device), requires_grad=param.requires_grad
            )
            new.__dict__.update(param.__dict__)
            new.__dict__.pop("_is_hf_initialized", None)
            memo.put(param, new)
        module._parameters[name] = memo[id(param)]  # type: ignore[assignment]
        changed = True
    for name, buf in list(module._buffers.items()):
        if buf is None or not buf.is_meta:
            continue
        if id(buf) not in memo:
            new_buf = torch.zeros_like(buf, device=device)
            new_buf.__dict__.update(buf.__dict__)  # a sharded buffer keeps its spec
            memo.put(buf, new_buf)
        module._buffers[name] = memo[id(buf)]
        changed = True
    return changed


def _original_of(module: nn.Module) -> nn.Module | None:
    """The module a traced one was traced from, where materializing must initialize through
    it: torch.export's rebuilt submodules record it, a retracer keeps it for the traced root."""
    from .tracing.export import original_of  # deferred: tracing imports much of slapo
    from .tracing.retrace import _ATTR

    found = original_of(module)
    if found is None and isinstance(module, fx.GraphModule):
        retracer = module.__dict__.get(_ATTR)
        found = getattr(retracer, "mod", None)
    return found if found is not module else None


def _originals(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(traced module, its original)`` for each traced module in ``model``."""
    pairs = []
    for module in model.modules():
        original = _original_of(module)
        if original is not None:
            pairs.append((module, original))
    return pairs


def _mirror(traced: nn.Module, original: nn.Module, had_meta: set[int]) -> None:
    """Point the original's meta tensors at the traced module's tensors of the same name, so
    that initializing the original initializes the graph (and tracing it again shares them).
    A tensor the graph replaced by another shape (a shard) is taken too: the original's class
    initializes it as it would the untraced module's shard."""
    for name, tensor in [
        *traced.named_parameters(remove_duplicate=False),
        *traced.named_buffers(remove_duplicate=False),
    ]:
        owner_path, _, attr = name.rpartition(".")
        try:
            owner = original.get_submodule(owner_path)
        except AttributeError:
            continue  # added after tracing: initialized with its own module
        for store in (owner._parameters, owner._buffers):
            old = store.get(attr)
            if old is not None and old.is_meta and not tensor.is_meta and old is not tensor:
                store[attr] = tensor  # type: ignore[assignment]
                had_meta.add(id(owner))


def _rebind_retracers(model: nn.Module, memo: dict[int, torch.Tensor]) -> None:
    """Retracers of traced blocks take the new tensors as the traced ones (no edit)."""
    from .tracing.retrace import _ATTR

    for module in model.modules():
        retracer = module.__dict__.get(_ATTR)
        if retracer is not None:
            retracer.rebind(memo)


def _init_order(
    model: nn.Module, originals: dict[nn.Module, nn.Module], had_meta: set[int]
) -> list[nn.Module]:
    """The modules to initialize, in the order of the untraced model's ``modules()``: a traced
    module stands for its original's subtree (then its own children, for what it added)."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        original = originals.get(module)
        if original is not None:
            visit(original)
        elif id(module) in had_meta:
            order.append(module)
        for child in module.children():
            visit(child)

    visit(model)
    return order


def _init_originals(model: nn.Module, originals: list[nn.Module]) -> None:
    """Initialize originals of traced modules (outside the model) as ``_default_init`` does:
    with the enclosing Hugging Face model's ``_init_weights``, else ``reset_parameters``."""
    if not originals:
        return
    hf_roots = _outermost_hf_models(model)
    with torch.no_grad():
        for module in originals:
            if hf_roots:
                hf_roots[0]._init_weights(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()


def _default_init(model: nn.Module, touched: list[nn.Module]) -> None:
    touched_ids = {id(m) for m in touched}
    hf_roots = _outermost_hf_models(model)
    covered: set[int] = set()
    for hf_model in hf_roots:
        # transformers marks modules it initialized; clear the marks where storage is new so its
        # init_weights (which skips marked modules) initializes exactly those.
        for module in hf_model.modules():
            covered.add(id(module))
            if id(module) in touched_ids:
                module.__dict__.pop("_is_hf_initialized", None)
            else:
                module._is_hf_initialized = True
        hf_model.init_weights()
        for module in hf_model.modules():
            module.__dict__.pop("_is_hf_initialized", None)
    with torch.no_grad():
        for module in touched:
            if id(module) not in covered and hasattr(module, "reset_parameters"):
                module.reset_parameters()


def _outermost_hf_models(model: nn.Module) -> list[nn.Module]:
    try:  # deferred: transformers takes seconds to import and is optional
        from transformers import PreTrainedModel
    except ImportError:
        return []
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, PreTrainedModel):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found

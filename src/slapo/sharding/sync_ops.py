"""The ``sync`` ops: tensor ops that ``sch.sync(...)`` runs on a module's main input or output, on
the gradient of its main input, or on the gradients of its own replicated parameters.

Sharding owns them: importing this module registers the autograd collectives (``all_reduce``,
``all_gather``, ``reduce_scatter``, ``scatter``) and every two-letter reshard spec
(``"RS->SR"``, ...); :func:`register_sync_op` adds more. Slapo's sync functions that user code
calls directly (:func:`all_gather_forward_output`, :func:`scatter_forward_output`,
:func:`reduce_forward_output`, :func:`reduce_scatter_forward_output`,
:func:`reduce_backward_grad`) are these collectives under Slapo's names and argument order. The ``sync`` primitive
(``slapo.primitives.sync``) looks them up here, together with the helpers that find a module's
main input and output and apply an op to a gradient (:func:`on_grad`, :func:`on_param_grads`).

Example:
    >>> from slapo.sharding.sync_ops import SYNC_OPS
    >>> "all_reduce" in SYNC_OPS, "RS->SR" in SYNC_OPS
    (True, True)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from ..exceptions import PrimitiveError, SlapoError
from .collectives import all_gather, all_reduce, reduce_scatter, scatter
from .groups import resolve_group, same_group
from .reshard import SPECS, reshard
from .spec import get_shard_spec

__all__ = [
    "SYNC_OPS",
    "all_gather_forward_output",
    "reduce_backward_grad",
    "reduce_forward_output",
    "reduce_scatter_forward_output",
    "scatter_forward_output",
    "PARAM_GRAD_OPS",
    "on_named_param_grads",
    "SyncOp",
    "install_param_grad_hooks",
    "on_grad",
    "on_param_grads",
    "primary_input",
    "register_sync_op",
    "replace_primary_output",
    "sync_group",
]

SyncOp = Callable[..., torch.Tensor]  # op(tensor, group=..., **kwargs) -> tensor
# What a module's main input or output may be: a tensor, or an fx proxy of one while a trace
# goes through the module (its hooks then record their op in the graph).
_TENSOR = (torch.Tensor, fx.Proxy)
SYNC_OPS: dict[str, SyncOp] = {}
# The keywords that carry a module's main input when it is called with keywords only (as
# transformers 5 calls its layers with ``hidden_states=``), most likely first.
_INPUT_KEYWORDS = ("hidden_states", "input", "x", "inputs_embeds", "input_ids")
# The ops a replicated parameter's gradient passes through (``on_param_grads``), in order. An
# attribute of the parameter: ``shard`` and materialization copy a parameter's attributes to the
# tensor that replaces it, so the ops follow the parameter to whatever object holds it.
PARAM_GRAD_OPS = "slapo_grad_ops"
# A weak reference to the parameter object that carries the hook: a copy of the attributes
# (onto a replacement parameter) then points at another object, and the hook is installed again.
_HOOKED = "_slapo_grad_ops_hooked"
_PRE_HOOKED = "_slapo_grad_ops_pre_hook"  # a module attribute: its forward pre-hook is there
_MODULE_OPS = "_slapo_param_grad_ops"  # a module attribute: {parameter name: (op, ...)}


def register_sync_op(name: str, op: SyncOp, override: bool = False) -> None:
    """Register ``op(tensor, group=..., **kwargs) -> tensor`` as ``sync(sync_op_or_fn=name)``.

    Example:
        >>> register_sync_op("double", lambda t, group=None: t * 2, override=True)
    """
    if name in SYNC_OPS and not override:
        raise SlapoError(f"sync op '{name}' is already registered")
    SYNC_OPS[name] = op


def primary_input(
    args: tuple, kwargs: dict[str, Any]
) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], tuple[tuple, dict[str, Any]]]]:
    """The module's main input tensor and a function that puts a new one in its place.

    The main input is the first positional tensor, or else the first of the usual input keywords;
    an fx proxy counts as a tensor (a trace going through the module).

    Example:
        >>> x, put = primary_input((), {"hidden_states": torch.ones(2), "mask": None})
        >>> put(x * 2)[1]["hidden_states"]
        tensor([2., 2.])
    """
    if args and isinstance(args[0], _TENSOR):
        return args[0], lambda t: ((t, *args[1:]), kwargs)
    keys = [k for k in _INPUT_KEYWORDS if isinstance(kwargs.get(k), _TENSOR)]
    keys = keys or [k for k, v in kwargs.items() if isinstance(v, _TENSOR)]
    if not keys:
        return None, lambda t: (args, kwargs)
    key = keys[0]
    return kwargs[key], lambda t: (args, {**kwargs, key: t})


def replace_primary_output(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to the main tensor of a module output (a tensor, tuple, list or dict).

    Example:
        >>> replace_primary_output((torch.ones(2), "aux"), lambda t: t * 3)
        (tensor([3., 3.]), 'aux')
    """
    if isinstance(output, _TENSOR):
        return fn(output)
    if type(output) in (tuple, list) and output and isinstance(output[0], _TENSOR):
        return type(output)([fn(output[0]), *output[1:]])
    if isinstance(output, dict) and output:
        key = next(iter(output))
        if isinstance(output[key], _TENSOR):
            output[key] = fn(output[key])
            return output
    raise SlapoError(
        f"sync(mode='fwd_post') found no tensor in the module output of type {type(output).__name__}"
    )


class _GradOp(torch.autograd.Function):
    """Identity in forward; applies ``fn`` to the gradient in backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.fn(grad), None


def on_grad(tensor: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``tensor`` unchanged, except that its gradient passes through ``fn`` in backward.

    (``_GradOp`` is looked up when called: the pipeline target swaps it while tracing.)

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> on_grad(x, lambda g: g * 5).sum().backward()
        >>> x.grad
        tensor([5., 5.])
    """
    return _GradOp.apply(tensor, fn)


def on_param_grads(mod: nn.Module, op: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """Pass the gradient of each of ``mod``'s own replicated parameters through ``op`` as backward
    computes it; returns their names. Sharded parameters are left alone.

    This is how a replicated parameter that consumes sharded activations gets its whole gradient:
    a norm over each attention head between the column-parallel q/k projections and the
    row-parallel output sees only this rank's heads, so each rank's gradient is a partial sum and
    ``op`` is an ``all_reduce`` over the tensor-parallel group. The op runs on each gradient before
    it is accumulated into ``.grad`` (so gradient accumulation stays right), once per backward
    however often the parameter was used. The hook is a parameter hook, which ``torch.compile``
    keeps. The ops are kept on the module by parameter name, and a forward pre-hook hooks whatever
    parameter object the module holds when it runs: one that replaced the hooked one
    (materialization from the meta device), or FSDP2's unsharded parameter, which is what the
    forward and backward use while the module's own parameter is a sharded DTensor.

    Example:
        >>> norm = nn.LayerNorm(4)
        >>> on_param_grads(norm, lambda g: g * 2)
        ['weight', 'bias']
        >>> norm(torch.randn(3, 4)).sum().backward()
        >>> norm.bias.grad
        tensor([6., 6., 6., 6.])
    """
    names = [n for n, p in mod.named_parameters(recurse=False) if get_shard_spec(p) is None]
    return on_named_param_grads(mod, names, op)


def on_named_param_grads(
    mod: nn.Module, names: list[str], op: Callable[[torch.Tensor], torch.Tensor]
) -> list[str]:
    """:func:`on_param_grads` for the parameters ``names`` of ``mod`` (its own, not its
    children's); returns ``names``.

    Example:
        >>> norm = nn.LayerNorm(4)
        >>> on_named_param_grads(norm, ["bias"], lambda g: g * 2)
        ['bias']
    """
    table: dict[str, tuple] = mod.__dict__.setdefault(_MODULE_OPS, {})
    own = dict(mod.named_parameters(recurse=False))
    for name in names:
        table[name] = (*table.get(name, ()), op)
        setattr(own[name], PARAM_GRAD_OPS, table[name])  # what a reader of the parameter sees
    if names and not getattr(mod, _PRE_HOOKED, False):
        mod.register_forward_pre_hook(_install_before_forward)
        setattr(mod, _PRE_HOOKED, True)
    install_param_grad_hooks(mod)
    return list(names)


def install_param_grad_hooks(mod: nn.Module) -> int:
    """Hook the gradient of every parameter of ``mod`` (not its children) that has ops recorded
    by :func:`on_named_param_grads` and is not hooked yet; returns how many were hooked now."""
    if torch.compiler.is_exporting():  # the traced graph has no parameter hooks to keep
        return 0
    table = getattr(mod, _MODULE_OPS, None)
    if not table:
        return 0
    count = 0
    for name, param in mod.named_parameters(recurse=False):
        if name not in table or not param.requires_grad or get_shard_spec(param) is not None:
            continue  # a tensor-parallel slice's gradient is whole
        hooked = getattr(param, _HOOKED, None)
        if hooked is not None and hooked() is param:
            continue
        # weak: the hook must keep neither its module nor its parameter alive
        owner = weakref.ref(mod)
        param.register_hook(lambda grad, owner=owner, name=name: _apply_ops(owner(), name, grad))
        setattr(param, _HOOKED, weakref.ref(param))
        count += 1
    return count


def _install_before_forward(mod: nn.Module, args: tuple) -> None:
    install_param_grad_hooks(mod)  # returns None: the inputs stay as they are


def _apply_ops(mod: nn.Module | None, name: str, grad: torch.Tensor) -> torch.Tensor:
    for op in (getattr(mod, _MODULE_OPS, {}) or {}).get(name, ()):
        grad = op(grad)
    return grad


def sync_group(group: Any, mod: nn.Module, where: str) -> Any:
    """The group that ``group`` names, checked against the group ``mod``'s sharded parameters use.

    Example:
        >>> sync_group(None, nn.Linear(2, 2), "fc") is None
        True
    """
    resolved = resolve_group(group, where)
    for name, param in mod.named_parameters():
        spec = get_shard_spec(param)
        if spec is not None and not same_group(spec.group, resolved):
            raise PrimitiveError(
                f'sync on "{where}": the group does not match the one "{name}" was sharded over '
                f"(size {spec.world}); schedule both with the same group"
            )
    return resolved


# ----- Slapo's sync functions, called directly in user code (a module's forward or a hook) -----
def _check_dim(fn: str, dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise SlapoError(
            f"{fn}: dim must be an int (the axis to gather or split), got {type(dim).__name__}; "
            f"the arguments are {fn}(tensor, dim, group)"
        )
    return dim


def all_gather_forward_output(
    inp: torch.Tensor, dim: int, group: Any = None, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather ``inp`` along ``dim`` over ``group`` in forward.

    Backward: with ``tensor_parallel_output_grad`` (default) the consumers of the gathered value
    are tensor-parallel and each rank holds a partial gradient, so the gradient is
    reduce-scattered; with False the gradient is replicated and each rank keeps its own slice.

    Example (in a 2-rank job):
        >>> group = None  # the tensor-parallel group (None: the default group)
        >>> y = all_gather_forward_output(torch.ones(2, 3), 0, group)  # shape (4, 3)  # doctest: +SKIP
    """
    dim = _check_dim("all_gather_forward_output", dim)
    bwd = "reduce_scatter" if tensor_parallel_output_grad else "split"
    return all_gather(inp, group=group, dim=dim, bwd=bwd)


def scatter_forward_output(inp: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """Keep this rank's slice of a replicated ``inp`` along ``dim``; backward all-gathers.

    Example (in a 2-rank job):
        >>> group = None  # the tensor-parallel group (None: the default group)
        >>> y = scatter_forward_output(torch.arange(4.0), 0, group)  # rank 1: tensor([2., 3.])  # doctest: +SKIP
    """
    return scatter(inp, group=group, dim=_check_dim("scatter_forward_output", dim))


def reduce_forward_output(inp: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-reduce (sum) ``inp`` over ``group`` in forward; the gradient passes unchanged.

    Example (in a 2-rank job):
        >>> group = None  # the tensor-parallel group (None: the default group)
        >>> y = reduce_forward_output(torch.ones(2), group)  # tensor([2., 2.])  # doctest: +SKIP
    """
    return all_reduce(inp, group=group)


def reduce_scatter_forward_output(inp: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """Sum ``inp`` over ``group`` and keep this rank's slice along ``dim``; backward all-gathers.

    Example (in a 2-rank job):
        >>> group = None  # the tensor-parallel group (None: the default group)
        >>> y = reduce_scatter_forward_output(torch.ones(4, 3), 0, group)  # (2, 3), all 2.0  # doctest: +SKIP
    """
    return reduce_scatter(inp, group=group, dim=_check_dim("reduce_scatter_forward_output", dim))


def reduce_backward_grad(inp: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``inp`` unchanged in forward; its gradient is all-reduced (summed) over ``group``.

    Put it in front of tensor-parallel consumers of a replicated value: each rank's gradient
    is a partial sum.

    Example (in a 2-rank job):
        >>> group = None  # the tensor-parallel group (None: the default group)
        >>> hidden = torch.ones(2, 4, requires_grad=True)
        >>> x = reduce_backward_grad(hidden, group)  # then a column-parallel linear  # doctest: +SKIP
    """
    group = resolve_group(group, "reduce_backward_grad")
    return on_grad(inp, lambda grad: all_reduce(grad, group=group))


def _register_builtins() -> None:
    for op in (all_reduce, all_gather, reduce_scatter, scatter):
        register_sync_op(op.__name__, op, override=True)
    for spec in SPECS:

        def op(tensor: torch.Tensor, group: Any = None, _spec: str = spec) -> torch.Tensor:
            return reshard(tensor, _spec, group=group)

        register_sync_op(spec, op, override=True)


_register_builtins()

"""RoundPipe's implementation of CPU optimizers.

The behavior is consistent with that of PyTorch optimizers (same hyperparameters, same state dict
layout, same results to rounding), and optimized for fp32 stepping on CPU: a fused C++ kernel
(OpenMP, vectorized, GIL released) does the whole update in one pass over memory, built on first
use by :mod:`roundpipe.optim_builder`. When no compiler works, a pure-PyTorch path takes over.

Beyond torch, :meth:`Adam.register_shadow` fuses the mixed-precision bookkeeping into the same
pass: the optimizer steps the fp32 master weight and, in the same sweep, writes the bf16/fp16 model
copy that devices upload, reading a bf16/fp16 (or fp32) gradient. There is no separate cast pass.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from ..errors import RoundPipeRuntimeError, RoundPipeTypeError, RoundPipeValueError
from .builder import OptimBuildError, get_optim_function
from .owner import OptimCopyOwner
from .stream import on_optim_stream, synchronize_optim

__all__ = ["Adam", "RoundPipeOptimizer"]

# Dtype codes of the C++ kernel (csrc/adam.cpp, enum DType).
_DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_SHADOW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_Implementation = Literal["auto", "cpp", "torch"]


def _scalar(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


class _GroupScalars:
    """A group's hyperparameters as Python floats, rounded the way torch.optim.Adam rounds them.

    torch does this arithmetic in double for float hyperparameters and in fp32 tensor math for
    tensor ones; writing the same expressions on the original objects reproduces both.
    """

    def __init__(self, group: dict[str, Any]) -> None:
        self.lr, (self.beta1, self.beta2) = group["lr"], group["betas"]
        self.decay = _scalar(1 - self.lr * group["weight_decay"])
        self._per_step: dict[float, tuple[float, float]] = {}

    def for_step(self, step: float) -> tuple[float, float]:
        """Return ``(step_size, sqrt(bias_correction2))`` for a step count (memoized)."""
        cached = self._per_step.get(step)
        if cached is None:
            bias_correction1 = 1 - self.beta1**step
            bias_correction2 = 1 - self.beta2**step
            step_size = self.lr / bias_correction1
            cached = (_scalar(step_size), _scalar(bias_correction2**0.5))
            self._per_step[step] = cached
        return cached


class Adam(Optimizer):
    """Implements the Adam algorithm with fp32 stepping on CPU.

    A drop-in for :class:`torch.optim.Adam` (and, with ``decoupled_weight_decay=True``,
    :class:`torch.optim.AdamW`): same arguments, same param group and state layout, so state dicts
    move freely between the two and training continues identically.

    Parameters that are fp32 or complex64 CPU tensors with contiguous storage are stepped by the
    fused C++ kernel; anything else (other dtypes, other devices, strided tensors) by the PyTorch
    path, which performs torch's own single-tensor Adam arithmetic.

    Args:
        params: iterable of parameters or named_parameters to optimize or iterable of dicts
            defining parameter groups. When using named_parameters, all parameters in all groups
            should be named.
        lr: learning rate (a float or a 1-element tensor).
        betas: coefficients used for computing running averages of gradient and its square
            (both floats or both 1-element tensors).
        eps: term added to the denominator to improve numerical stability.
        weight_decay: weight decay coefficient.
        amsgrad: whether to use the AMSGrad variant of this algorithm from the paper
            "On the Convergence of Adam and Beyond".
        foreach: compatible placeholder for PyTorch's Adam optimizer (validated, then ignored).
        maximize: maximize the objective with respect to the params, instead of minimizing.
        capturable: compatible placeholder for PyTorch's Adam optimizer.
        differentiable: compatible placeholder; ``True`` is rejected since the C++ step is not
            differentiable.
        fused: compatible placeholder for PyTorch's Adam optimizer (the step is always fused).
        decoupled_weight_decay: if True, this optimizer is equivalent to AdamW and the algorithm
            will not accumulate weight decay in the momentum nor variance.
        implementation: ``"auto"`` (C++ kernel, PyTorch path if it cannot be built),
            ``"cpp"`` (C++ kernel or raise :class:`~roundpipe.optim_builder.OptimBuildError`) or
            ``"torch"`` (always the PyTorch path). Not part of the state dict.

    Raises:
        ValueError: For out-of-range hyperparameters, as torch does.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Adam(model.parameters(), lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
        >>> opt.zero_grad()
        >>> reference = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        >>> reference.load_state_dict(opt.state_dict())  # interchangeable state dicts
    """

    _warned: bool = False  # the PyTorch-path warning is printed once per process

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        implementation: _Implementation = "auto",
    ) -> None:
        # Same checks, same messages and exception types as torch.optim.Adam.
        if isinstance(lr, Tensor):
            if foreach and not capturable:
                raise RoundPipeValueError(
                    "lr as a Tensor is not supported for capturable=False and foreach=True"
                )
            if lr.numel() != 1:
                raise RoundPipeValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise RoundPipeValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise RoundPipeValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2:
            raise RoundPipeValueError(f"betas must be a pair, got {betas!r}")
        for i, beta in enumerate(betas):
            if isinstance(beta, Tensor):
                if not capturable and foreach:
                    raise RoundPipeValueError(
                        f"betas[{i}] as a Tensor is not supported for capturable=False and "
                        "foreach=True"
                    )
                if beta.numel() != 1:
                    raise RoundPipeValueError(f"Tensor betas[{i}] must be 1-element")
            if not 0.0 <= beta < 1.0:
                raise RoundPipeValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not 0.0 <= weight_decay:
            raise RoundPipeValueError(f"Invalid weight_decay value: {weight_decay}")
        if not (
            (isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor))
        ):
            raise RoundPipeValueError("betas must be either both floats or both Tensors")
        if fused and foreach:
            raise RoundPipeRuntimeError("`fused` and `foreach` cannot be `True` together.")
        if differentiable:
            raise NotImplementedError("roundpipe.optim.Adam does not support differentiable=True")
        if implementation not in ("auto", "cpp", "torch"):
            raise RoundPipeValueError(
                f"implementation must be 'auto', 'cpp' or 'torch', got {implementation!r}"
            )
        # torch squeezes 1-element tensor betas to 0-dim; keep the same group layout.
        betas = tuple(b.squeeze() if isinstance(b, Tensor) and b.dim() != 0 else b for b in betas)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        super().__init__(params, defaults)
        self.implementation: _Implementation = implementation
        # master param -> low-precision model copy, written in the same pass (register_shadow).
        self._shadows: dict[Tensor, Tensor] = {}
        if implementation == "cpp":
            get_optim_function("adam")  # fail here, not at the first step

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Sets the state of the optimizer, filling in keys that older state dicts lack.

        Used when loading a saved optimizer state (also one saved by ``torch.optim.Adam``): it
        ensures all group options are present and that ``step`` is a tensor, as torch stores it.

        Args:
            state: The state dictionary to set.
        """
        super().__setstate__(state)
        self.__dict__.setdefault("implementation", "auto")
        self.__dict__.setdefault("_shadows", {})
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", False)
            for p in group["params"]:
                p_state = self.state.get(p, {})
                if len(p_state) != 0 and not torch.is_tensor(p_state["step"]):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)

    # ----------------------------------------------------------------------------------------
    # Mixed precision: fp32 master weights with a low-precision model copy
    # ----------------------------------------------------------------------------------------

    def register_shadow(self, master: Tensor, shadow: Tensor) -> None:
        """Write ``shadow`` (the low-precision model copy of ``master``) in the step's own pass.

        After each :meth:`step`, ``shadow`` holds ``master`` cast to ``shadow.dtype`` (round to
        nearest even, as ``Tensor.copy_``), written by the same kernel sweep that updates
        ``master``: no separate cast pass over memory. The gradient is read from
        ``master.grad`` when set, otherwise from ``shadow.grad``; either may be fp32, bf16 or
        fp16 and a low-precision one is widened on the fly. (torch refuses a bf16 ``.grad`` on an
        fp32 tensor unless its ``grad_dtype`` is set to ``None``; the shadow's own ``.grad``
        needs no such setting.) :meth:`zero_grad` clears ``shadow.grad`` too.

        With RoundPipe's asynchronous step (``step(..., is_async=True)``) the runtime copies
        updated weights back only after the next backward has taken its copy of a layer; a
        shadow written during the optimizer step would bypass that ordering, so register shadows
        only for synchronous steps (or tensors no device reads during the step).

        Args:
            master: An fp32 (or complex64) parameter of this optimizer.
            shadow: A tensor of the same shape on the same device, fp32, bf16 or fp16 (or the
                matching complex dtype); typically the pinned model weight a device uploads.

        Raises:
            ValueError: If ``master`` is not a parameter of this optimizer, or the shapes,
                devices or dtypes do not fit.

        Example:
            >>> master = torch.nn.Parameter(torch.randn(8))
            >>> model_weight = master.detach().to(torch.bfloat16)  # what devices upload
            >>> opt = Adam([master], lr=1e-3)
            >>> opt.register_shadow(master, model_weight)
            >>> model_weight.grad = torch.randn(8, dtype=torch.bfloat16)  # from the backward pass
            >>> opt.step()  # one pass: master, exp_avg, exp_avg_sq and model_weight updated
            >>> bool((model_weight == master.detach().to(torch.bfloat16)).all())
            True
        """
        if not isinstance(master, Tensor) or not isinstance(shadow, Tensor):
            raise RoundPipeTypeError("register_shadow expects two tensors")
        if not any(master is p for g in self.param_groups for p in g["params"]):
            raise RoundPipeValueError(
                "register_shadow: master is not a parameter of this optimizer"
            )
        if shadow.shape != master.shape:
            raise RoundPipeValueError(
                f"register_shadow: shadow shape {tuple(shadow.shape)} != master shape "
                f"{tuple(master.shape)}"
            )
        if shadow.device != master.device:
            raise RoundPipeValueError(
                f"register_shadow: shadow on {shadow.device}, master on {master.device}"
            )
        if not (shadow.is_floating_point() or shadow.is_complex()) or (
            shadow.is_complex() != master.is_complex()
        ):
            raise RoundPipeValueError(
                f"register_shadow: cannot shadow a {master.dtype} master with {shadow.dtype}"
            )
        if shadow.data_ptr() == master.data_ptr() and shadow.numel() > 0:
            raise RoundPipeValueError("register_shadow: shadow must not alias the master weight")
        self._shadows[master] = shadow

    def unregister_shadow(self, master: Tensor) -> None:
        """Stop writing the shadow of ``master`` (no-op when there is none).

        Example:
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> opt = Adam([p])
            >>> opt.register_shadow(p, torch.zeros(2, dtype=torch.float16))
            >>> opt.unregister_shadow(p)
        """
        self._shadows.pop(master, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of all parameters and of their registered shadows.

        Example:
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> p.grad = torch.ones(2)
            >>> Adam([p]).zero_grad()
            >>> p.grad is None
            True
        """
        super().zero_grad(set_to_none=set_to_none)
        for shadow in self._shadows.values():
            if shadow.grad is None:
                continue
            if set_to_none:
                shadow.grad = None
            else:
                shadow.grad = shadow.grad.detach().zero_()

    # ----------------------------------------------------------------------------------------
    # The step
    # ----------------------------------------------------------------------------------------

    def _kernel(self) -> Callable | None:
        """The C++ step function, or None to use the PyTorch path."""
        if self.implementation == "torch":
            return None
        try:
            return get_optim_function("adam")
        except OptimBuildError as exc:
            if self.implementation == "cpp":
                raise
            if not Adam._warned:
                Adam._warned = True
                warnings.warn(
                    f"roundpipe.optim.Adam: using the slower PyTorch path ({exc})", stacklevel=3
                )
            return None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs a single optimization step.

        Args:
            closure: A closure that reevaluates the model and returns the loss.

        Returns:
            The loss value if a closure is provided, otherwise None.

        Example:
            >>> p = torch.nn.Parameter(torch.ones(3))
            >>> opt = Adam([p], lr=0.1)
            >>> p.grad = torch.ones(3)
            >>> opt.step()
            >>> [round(x, 4) for x in p.tolist()]
            [0.9, 0.9, 0.9]
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kernel = self._kernel()
        for group in self.param_groups:
            self._step_group(group, kernel)
        return loss

    def _grad_of(self, p: Tensor) -> Tensor | None:
        if p.grad is not None:
            return p.grad
        shadow = self._shadows.get(p)
        return None if shadow is None else shadow.grad

    def _step_group(self, group: dict[str, Any], kernel: Callable | None) -> None:
        scalars = _GroupScalars(group)
        amsgrad = group["amsgrad"]
        fast: list[tuple[Tensor, Tensor, dict[str, Tensor], Tensor | None]] = []
        for p in group["params"]:
            grad = self._grad_of(p)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RoundPipeRuntimeError(
                    "Adam does not support sparse gradients, please consider SparseAdam instead"
                )
            if grad.shape != p.shape:
                raise RoundPipeValueError(
                    f"gradient shape {tuple(grad.shape)} does not match parameter shape "
                    f"{tuple(p.shape)}"
                )
            state = self.state[p]
            if len(state) == 0:
                # Same layout as torch.optim.Adam (step is a CPU float32 scalar tensor).
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
            elif amsgrad and "max_exp_avg_sq" not in state:
                # amsgrad switched on mid-training (torch raises KeyError): start a fresh max.
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            if p.numel() == 0:
                # Nothing to update; torch counts the step all the same. (An empty tensor may
                # have no storage: the kernel accepts address 0 for it, but need not see it.)
                continue
            shadow = self._shadows.get(p)
            if kernel is not None and self._kernel_ok(p, grad, state, shadow, amsgrad):
                fast.append((p, grad, state, shadow))
            else:
                _torch_adam_(p, grad, state, shadow, group, scalars)
        if fast:
            _cpp_adam_(kernel, fast, group, scalars)

    @staticmethod
    def _kernel_ok(
        p: Tensor, grad: Tensor, state: dict[str, Tensor], shadow: Tensor | None, amsgrad: bool
    ) -> bool:
        """Whether the C++ kernel can step this parameter (dense CPU fp32 memory throughout)."""
        if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.complex64):
            return False
        if p.is_complex():
            if grad.dtype != torch.complex64:
                return False
        elif grad.dtype not in _DTYPE_CODES:
            return False
        moments = [state["exp_avg"], state["exp_avg_sq"]]
        if amsgrad:
            moments.append(state["max_exp_avg_sq"])
        if any(m.dtype != p.dtype for m in moments):
            return False
        tensors = [p, grad, *moments]
        if shadow is not None:
            if shadow.is_complex() or shadow.dtype not in _SHADOW_DTYPES:
                return False
            tensors.append(shadow)
        return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _real(t: Tensor) -> Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _cpp_adam_(
    kernel: Callable,
    items: list[tuple[Tensor, Tensor, dict[str, Tensor], Tensor | None]],
    group: dict[str, Any],
    scalars: _GroupScalars,
) -> None:
    """One call of the C++ kernel for all eligible parameters of a group."""
    n = len(items)
    # The kernel reads a table of addresses, one row per tensor (csrc/adam.cpp, enum Column):
    # param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, shadow, numel, grad dtype, shadow dtype.
    table = [[0] * 9 for _ in range(n)]
    steps = [(0.0, 0.0)] * n
    for i, (p, grad, state, shadow) in enumerate(items):
        row = table[i]
        row[0] = p.data_ptr()
        row[1] = grad.data_ptr()
        row[2] = state["exp_avg"].data_ptr()
        row[3] = state["exp_avg_sq"].data_ptr()
        if group["amsgrad"]:
            row[4] = state["max_exp_avg_sq"].data_ptr()
        if shadow is not None:
            row[5] = shadow.data_ptr()
            row[8] = _DTYPE_CODES[shadow.dtype]
        row[6] = _real(p).numel()
        row[7] = 1 if grad.is_complex() else _DTYPE_CODES[grad.dtype]
        steps[i] = scalars.for_step(float(state["step"].item()))
    table_t = torch.tensor(table, dtype=torch.int64)
    steps_t = torch.tensor(steps, dtype=torch.float64)
    kernel(
        table_t.data_ptr(),
        steps_t.data_ptr(),
        n,
        _scalar(scalars.beta1),
        _scalar(scalars.beta2),
        float(group["weight_decay"]),
        scalars.decay,
        float(group["eps"]),
        bool(group["amsgrad"]),
        bool(group["maximize"]),
        bool(group["decoupled_weight_decay"]),
        torch.get_num_threads(),
    )


def _torch_adam_(
    p: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    shadow: Tensor | None,
    group: dict[str, Any],
    scalars: _GroupScalars,
) -> None:
    """The PyTorch path: torch.optim.Adam's single-tensor arithmetic for one parameter."""
    weight_decay = group["weight_decay"]
    if grad.dtype != p.dtype:
        grad = grad.to(p.dtype)
    if group["maximize"]:
        grad = -grad
    if weight_decay != 0:
        if group["decoupled_weight_decay"]:
            p.mul_(scalars.decay)
        else:
            grad = grad.add(p, alpha=weight_decay)
    param, grad = _real(p), _real(grad)
    exp_avg, exp_avg_sq = _real(state["exp_avg"]), _real(state["exp_avg_sq"])
    beta1, beta2 = _scalar(scalars.beta1), _scalar(scalars.beta2)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size, bias_correction2_sqrt = scalars.for_step(float(state["step"].item()))
    second_moment = exp_avg_sq
    if group["amsgrad"]:
        second_moment = _real(state["max_exp_avg_sq"])
        torch.maximum(second_moment, exp_avg_sq, out=second_moment)
    denom = (second_moment.sqrt() / bias_correction2_sqrt).add_(group["eps"])
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if shadow is not None:
        shadow.copy_(p)


# --------------------------------------------------------------------------------------------
# The ordinary PyTorch loop over RoundPipe's step protocol
# --------------------------------------------------------------------------------------------


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A group's hyperparameters (everything but ``params``); tensors copied, so a later in-place
    change (``LRScheduler`` fills a tensor ``lr``) cannot reach a step already launched."""
    return {
        k: v.detach().clone() if isinstance(v, Tensor) else v
        for k, v in group.items()
        if k != "params"
    }


class RoundPipeOptimizer(Optimizer):
    """Makes the ordinary loop (``loss.backward(); opt.step(); opt.zero_grad()``) train a
    RoundPipe model.

    RoundPipe keeps a separate optimizer copy of every trainable parameter
    (``model.optim_parameters()``; frozen ones, e.g. a LoRA model's base weights, have none, so
    they get no optimizer state either) and updates it on its optimizer thread (:meth:`RoundPipeBase.step`): the gradients the
    backward left on the model parameters move into the copies, the inner optimizer steps, and
    the results are copied back. This wrapper owns an inner optimizer built over those copies
    and runs that protocol on :meth:`step`, so it behaves like the torch optimizer it wraps:
    ``param_groups`` (with its hyperparameters), ``state``, ``state_dict()`` /
    ``load_state_dict()``, step hooks and ``torch.optim.lr_scheduler`` all work on it.

    With ``is_async=False`` (the default) :meth:`step` returns once the model parameters hold
    the new values: exactly torch's semantics. With ``is_async=True`` it returns at once and the
    next forward + backward uses the previous values (one step stale) while the optimizer thread
    steps; RoundPipe's overlap mode. Either way, the hyperparameters in force when :meth:`step`
    is called are the ones used (a scheduler may change them right after).

    :meth:`zero_grad` clears only the model-side gradients a launched step has not claimed; the
    inner optimizer's gradients are cleared on the optimizer thread right after its step, so
    nothing here races with that thread.

    Args:
        model: the RoundPipe model (``RoundPipe``, ``AutoRoundPipe``).
        optimizer: a torch optimizer over ``model.optim_parameters()`` (or a subset).
        is_async: use RoundPipe's asynchronous, one-step-stale step.
        scaler: a :class:`roundpipe.GradScaler` whose scaled losses the backward passes used:
            each step runs ``scaler.step(optimizer)`` on the optimizer thread (unscale, skip on
            inf/NaN) and then ``scaler.update()``.

    Raises:
        TypeError: ``model`` is not a RoundPipe model or ``optimizer`` not an optimizer.
        ValueError: the optimizer holds tensors that are not the model's optimizer copies.

    Example:
        >>> from roundpipe import RoundPipe
        >>> model = RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 1)), pin_model="off")
        >>> opt = RoundPipeOptimizer(model, torch.optim.AdamW(model.optim_parameters(), lr=1e-2))
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
        >>> loss = model(torch.randn(8, 4)).pow(2).mean()
        >>> loss.backward()
        >>> opt.step()
        >>> opt.zero_grad()
        >>> sched.step()
    """

    def __init__(
        self,
        model: OptimCopyOwner,
        optimizer: Optimizer,
        *,
        is_async: bool = False,
        scaler: Any = None,
    ) -> None:
        if not isinstance(model, OptimCopyOwner):
            raise RoundPipeTypeError(
                f"RoundPipeOptimizer: model must be a RoundPipe model (RoundPipe, AutoRoundPipe), "
                f"got {type(model).__name__}"
            )
        if isinstance(optimizer, RoundPipeOptimizer) or not isinstance(optimizer, Optimizer):
            raise RoundPipeTypeError(
                "RoundPipeOptimizer: optimizer must be a torch.optim.Optimizer over "
                f"model.optim_parameters(), got {type(optimizer).__name__}"
            )
        if not isinstance(is_async, bool):
            raise RoundPipeTypeError(
                f"RoundPipeOptimizer: is_async must be a bool, got {is_async!r}"
            )
        copies = {id(p) for p in model.optim_parameters()}
        for i, group in enumerate(optimizer.param_groups):
            stray = sum(id(p) not in copies for p in group["params"])
            if stray:
                raise RoundPipeValueError(
                    f"RoundPipeOptimizer: param_groups[{i}] holds {stray} tensor(s) that are not "
                    f"optimizer copies of {model.name}; build the optimizer over "
                    "model.optim_parameters(), not model.parameters()"
                )
        # Optimizer.__init__ would build its own state; set up only what the base class reads.
        self.model = model
        self.optimizer = optimizer
        self.is_async = is_async
        self.scaler = scaler
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._patch_step_function()
        # The main thread's view of the groups (what schedulers and users edit); the inner
        # optimizer's groups are written only on the optimizer thread, from a snapshot taken
        # when step() is called.
        self.param_groups: list[dict[str, Any]] = []
        for group in optimizer.param_groups:
            self.param_groups.append({**_hyper(group), "params": list(group["params"])})

    def __repr__(self) -> str:
        return f"RoundPipeOptimizer({self.optimizer!r}, is_async={self.is_async})"

    def __getstate__(self) -> dict[str, Any]:
        raise RoundPipeTypeError(
            "RoundPipeOptimizer cannot be pickled; save optimizer.state_dict() instead"
        )

    def _wait(self) -> None:
        """Wait for launched steps, so the inner optimizer may be read or changed here."""
        synchronize_optim()

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's per-parameter state (after the launched steps finished)."""
        self._wait()
        return self.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply the gradients of the backward passes since the last step.

        Args:
            closure: re-evaluates the model and returns the loss (called once, here).

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: called on RoundPipe's optimizer thread (e.g. inside
                ``model.step(...)``): this method runs ``model.step`` itself.
        """
        if on_optim_stream():
            raise RoundPipeRuntimeError(
                "RoundPipeOptimizer.step() runs model.step() itself: call it from the training "
                "loop, not inside model.step(...) (use its .optimizer there)"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self.optimizer
        snapshot = [_hyper(g) for g in self.param_groups]

        scaler = self.scaler

        def kernel() -> None:
            for group, hyper in zip(inner.param_groups, snapshot):
                group.update(hyper)
            if scaler is None:
                inner.step()
            else:  # on this thread: unscale, check, step inline
                scaler.step(inner)
            # set_to_none: the next step hands the model's gradient tensors over without a copy
            inner.zero_grad(set_to_none=True)

        self.model.step(kernel, is_async=self.is_async)
        if scaler is not None:  # queued behind the step: the next scale follows its overflow
            scaler.update(is_async=self.is_async)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model-side gradients (see :meth:`RoundPipeBase.zero_grad`)."""
        self.model.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of optimizer copies (``model.optim_parameters()``) to the inner optimizer."""
        copies = {id(p) for p in self.model.optim_parameters()}
        params = param_group.get("params")
        params = [params] if isinstance(params, Tensor) else list(params or [])
        if any(id(p) not in copies for p in params):
            raise RoundPipeValueError(
                "RoundPipeOptimizer.add_param_group: the group must hold optimizer copies "
                "(model.optim_parameters()), not model parameters"
            )
        self._wait()
        self.optimizer.add_param_group(param_group)
        added = self.optimizer.param_groups[-1]
        self.param_groups.append({**_hyper(added), "params": list(added["params"])})

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, with the hyperparameters now in force.

        Loadable by the same torch optimizer class outside RoundPipe, and back.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._wait()  # the optimizer thread is idle: its groups may be written here
        for group, view in zip(self.optimizer.param_groups, self.param_groups):
            group.update(_hyper(view))
        state = self.optimizer.state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the inner optimizer (e.g. a ``torch.optim.AdamW`` state dict)."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._wait()
        self.optimizer.load_state_dict(state_dict)
        for view, group in zip(self.param_groups, self.optimizer.param_groups):
            params = view["params"]
            view.clear()
            view.update(_hyper(group))
            view["params"] = params
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

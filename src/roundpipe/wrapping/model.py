"""The RoundPipe model wrappers."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..devices.attribute import LayerAttribute, ParamAttribute, make_layer_attribute, unique_params
from ..devices.device import get_devices
from ..devices.pinning import pin_module
from ..errors import RoundPipeRuntimeError, RoundPipeTypeError, RoundPipeValueError
from ..optim.grad_scaler import snapshot_scalers
from ..optim.owner import OptimCopyOwner
from ..optim.stream import (
    launch_optim_kernel,
    on_optim_stream,
    raise_pending_error,
    synchronize_optim,
)
from ..runtime.batch import Batch
from ..runtime.context import doing_optimizer
from ..runtime.plan import ModelExecutePlan
from ..runtime.run import RoundPipeBatchedBackward, RoundPipeRun
from ..runtime.run_config import FullRoundPipeRunConfig, RoundPipeRunConfig
from ..runtime.timer import ModelTimer
from .sizes import get_call_location, get_model_active_size, get_model_size

__all__ = ["AutoRoundPipe", "RoundPipe", "RoundPipeBase"]

_OWN_ATTRS = {"model", "original_model", "name", "layer_attrs", "optim_dtype", "training"}


def _activations_landed() -> None:
    """The run's last activation copies to the host (outputs, input gradients) have landed."""
    for d in get_devices():
        d.wait_activation_copies()


def _clear_grad(p: torch.Tensor, set_to_none: bool) -> None:
    """``torch.optim.Optimizer.zero_grad``'s reset of one gradient."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
    else:
        if p.grad.grad_fn is not None:
            p.grad.detach_()
        else:
            p.grad.requires_grad_(False)
        p.grad.zero_()


class RoundPipeBase(OptimCopyOwner):
    """Optimizer-copy management, asynchronous ``step`` and attribute shim shared by
    :class:`RoundPipe` and :class:`AutoRoundPipe`."""

    def __init__(
        self, model: nn.Module, name: str | None = None, optim_dtype: torch.dtype | None = None
    ) -> None:
        if not isinstance(model, nn.Module):
            raise RoundPipeTypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if optim_dtype is not None and not isinstance(optim_dtype, torch.dtype):
            raise RoundPipeTypeError(f"optim_dtype must be a torch.dtype, got {optim_dtype!r}")
        super().__init__()
        self.model = model
        self.name = name or get_call_location(2)
        self.original_model: nn.Module | None = None
        self.layer_attrs: list[LayerAttribute] = []
        self.optim_dtype = optim_dtype
        self._warned_params = False
        self._rp_ready = False  # subclasses set it last: their own attributes are not mirrored
        # load_state_dict writes the model parameters: the optimizer copies must follow
        self.register_load_state_dict_post_hook(RoundPipeBase._refresh_optim_copies)

    def _refresh_optim_copies(self, incompatible_keys: Any = None) -> None:
        """Make the optimizer copies equal the model parameters (after ``load_state_dict``).

        Without this, the next step would copy the old optimizer values back over the loaded
        weights. Pending steps are finished first.
        """
        self.synchronize()
        with torch.no_grad():
            for attr in self._all_layer_attrs():
                with attr.param_lock:
                    for p in attr.params:
                        optim = ParamAttribute.get(p).optim
                        if optim is not None:
                            optim.copy_(p)

    # -- attribute shim ------------------------------------------------------------------
    def set_original_model(self, original_model: nn.Module) -> None:
        """Mirror attribute reads / writes to ``original_model`` (the pre-wrap module)."""
        object.__setattr__(self, "original_model", original_model)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        modules = self.__dict__.get("_modules", {})
        for target in (modules.get("model"), self.__dict__.get("original_model")):
            if target is not None and hasattr(target, name):
                return getattr(target, name)
        raise AttributeError(
            f"{type(self).__name__} (and the wrapped model) has no attribute {name!r}"
        )

    def _shim_targets(self) -> list[nn.Module]:
        """The wrapped model and the original model (each once) that attribute writes reach."""
        targets: list[nn.Module] = []
        for target in (
            self.__dict__.get("_modules", {}).get("model"),
            self.__dict__.get("original_model"),
        ):
            if target is not None and all(target is not t for t in targets):
                targets.append(target)
        return targets

    def _is_mirrored(self, name: str) -> bool:
        """Whether ``name`` is a user attribute (mirrored to the models), not the wrapper's own."""
        return (
            bool(self.__dict__.get("_rp_ready"))
            and name not in _OWN_ATTRS
            and not name.startswith("_")
            and name not in self.__dict__
            and not hasattr(type(self), name)
        )

    def __setattr__(self, name: str, value: Any) -> None:
        """Mirror attribute writes to the wrapped and original models after initialization.

        ``wrapped.x = 1`` sets ``x`` on the wrapped model and on the original model (it is read
        back through them); the wrapper's own attributes and submodule / tensor values stay on
        the wrapper.

        Example:
            >>> net = nn.Sequential(nn.Linear(2, 2))
            >>> rp = RoundPipe(net, pin_model="off")
            >>> rp.flag = 1
            >>> net.flag, rp.flag
            (1, 1)
        """
        if self._is_mirrored(name) and not isinstance(value, (nn.Module, torch.Tensor)):
            targets = self._shim_targets()
            if targets:
                for target in targets:
                    setattr(target, name, value)
                return
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        """Delete an attribute: the wrapper's own, or a mirrored one from every model holding it.

        Example:
            >>> net = nn.Sequential(nn.Linear(2, 2))
            >>> rp = RoundPipe(net, pin_model="off")
            >>> rp.flag = 1
            >>> del rp.flag
            >>> hasattr(net, "flag") or hasattr(rp, "flag")
            False
        """
        own = (
            name in self.__dict__
            or name in self._modules
            or name in self._parameters
            or name in self._buffers
        )
        if own or not self._is_mirrored(name):
            super().__delattr__(name)
            return
        holders = [t for t in self._shim_targets() if hasattr(t, name)]
        if not holders:
            raise AttributeError(
                f"{type(self).__name__} (and the wrapped model) has no attribute {name!r}"
            )
        for target in holders:
            delattr(target, name)

    # -- parameters ----------------------------------------------------------------------
    def _all_layer_attrs(self) -> list[LayerAttribute]:
        return list(self.layer_attrs)

    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Named optimizer copies of the trainable parameters (what optimizers should update).

        Parameters frozen (``requires_grad=False``) when the model was wrapped have no copy and
        are left out, e.g. all but the adapters of a LoRA model.

        Example:
            >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
            >>> _ = net[0].requires_grad_(False)  # frozen before wrapping: no optimizer copy
            >>> rp = RoundPipe(net, pin_model="off")
            >>> [n for n, _ in rp.optim_named_parameters()]
            ['1.weight', '1.bias']
        """
        for name, p in nn.Module.named_parameters(
            self.model, prefix=prefix, remove_duplicate=remove_duplicate
        ):
            if ParamAttribute.has(p):
                optim = ParamAttribute.get(p).optim
                if optim is not None:
                    yield name, optim

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """Optimizer copies of the trainable parameters.

        Example:
            >>> rp = RoundPipe(nn.Sequential(nn.Linear(2, 2)), pin_model="off")
            >>> opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
        """
        for _, p in self.optim_named_parameters():
            yield p

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        """Model parameters; the optimizer copies inside :class:`~roundpipe.OptimizerCtx`."""
        if doing_optimizer():
            yield from self.optim_named_parameters(prefix, remove_duplicate)
            return
        # only while an asynchronous step is still pending are the values actually stale
        if not self._warned_params and any(a.copied < a.launched for a in self._all_layer_attrs()):
            self._warned_params = True
            warnings.warn(
                "RoundPipe model parameters may be one step stale after an asynchronous "
                "step(); build optimizers from optim_parameters()",
                stacklevel=2,
            )
        yield from super().named_parameters(
            prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate
        )

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        """Model parameters; the optimizer copies inside :class:`~roundpipe.OptimizerCtx`."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the model-side gradients, leaving those a launched step has not taken yet.

        After an asynchronous :meth:`step`, the gradients of the finished backward still sit on
        the model parameters until the optimizer thread moves them into the optimizer copies;
        they belong to that step, which clears them itself, so they are skipped here (no race
        with the optimizer thread). Inside :class:`~roundpipe.OptimizerCtx` this resets the
        optimizer copies' gradients instead, like ``parameters()``.

        Example:
            >>> rp = RoundPipe(nn.Sequential(nn.Linear(2, 1)), pin_model="off")
            >>> rp(torch.ones(2, 2)).sum().backward()
            >>> rp.zero_grad()
            >>> all(p.grad is None for p in rp.parameters())
            True
        """
        if doing_optimizer():
            for p in self.optim_parameters():
                _clear_grad(p, set_to_none)
            return
        seen: set[int] = set()
        for attr in self._all_layer_attrs():
            with attr.cond:
                pending = attr.grads_taken < attr.launched
            for p in attr.params:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if pending:  # the launched step takes these gradients (and clears them)
                    continue
                with ParamAttribute.get(p).grad_lock:
                    _clear_grad(p, set_to_none)
        for _, p in nn.Module.named_parameters(self):  # any parameter RoundPipe does not manage
            if id(p) not in seen and not ParamAttribute.has(p):
                _clear_grad(p, set_to_none)

    # -- optimizer step --------------------------------------------------------------------
    def step(
        self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any
    ) -> None:
        """Run ``step_fn`` (e.g. ``opt.step(); opt.zero_grad()``) on the optimizer thread.

        Gradients accumulated since the last step are added to the optimizer copies' ``.grad``
        first. With ``is_async=True`` this returns at once and the next forward + backward
        uses the previous parameters (one step stale); the updated values are copied back
        layer by layer after that backward. ``is_async=False`` waits: exact synchronous SGD.

        Example:
            >>> rp = RoundPipe(nn.Sequential(nn.Linear(2, 1)), pin_model="off")
            >>> opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
            >>> rp(torch.ones(4, 2)).sum().backward()
            >>> rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        """
        if not callable(step_fn):
            raise RoundPipeTypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
        raise_pending_error()
        launches = [(a, *a.launch_step(flush_now=not is_async)) for a in self._all_layer_attrs()]
        restore_scalers = snapshot_scalers()

        def kernel() -> None:
            try:
                for attr, k, _ in launches:
                    attr.take_grads(k)
                restore_scalers()
                step_fn(*args, **kwargs)
            finally:
                for attr, k, bwd in launches:
                    attr.finish_step(k, bwd)

        launch_optim_kernel(kernel)
        if not is_async:
            self.synchronize()

    def sync_optim_param(self) -> None:
        """Copy every pending optimizer update into the model parameters now."""
        for a in self._all_layer_attrs():
            a.flush()
        if not on_optim_stream():
            synchronize_optim()
            for a in self._all_layer_attrs():
                a.wait_copied()

    def synchronize(self) -> None:
        """Wait for the optimizer thread and make model parameters equal the optimizer copies."""
        self.sync_optim_param()


class RoundPipe(RoundPipeBase):
    """Wraps a model whose computation is a sequence of layers with RoundPipe's runtime.

    Parameters, gradients and optimizer copies stay in host memory; each pipeline stage
    (a group of consecutive layers) is uploaded to the next device round-robin, runs all
    microbatches, and is freed.

    Args:
        model: an ``nn.Sequential`` (split into its children) or any module (one layer,
            unless ``layers`` is given).
        optim_dtype: dtype of the optimizer copies (default: each parameter's dtype).
        name: label for logs and errors (default: ``file:line`` of the call).
        model_run_config: defaults for every call.
        pin_model: ``"alloc"`` (pinned copies), ``"register"`` (``cudaHostRegister`` in place)
            or ``"off"``. Pinning happens only on devices that benefit (CUDA).
        layers: explicit layer modules in execution order; layer ``i + 1`` receives the
            output of layer ``i`` (a plain tuple is unpacked as positional arguments) and the
            first layer receives the call's arguments.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from roundpipe import RoundPipe, RoundPipeRunConfig
        >>> net = RoundPipe(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)),
        ...                 model_run_config=RoundPipeRunConfig(num_microbatch=2), pin_model="off")
        >>> net(torch.randn(6, 4)).shape
        torch.Size([6, 1])
    """

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: torch.dtype | None = None,
        name: str | None = None,
        model_run_config: RoundPipeRunConfig | None = None,
        pin_model: Literal["alloc", "register", "off"] = "alloc",
        layers: Sequence[nn.Module] | None = None,
    ) -> None:
        super().__init__(model, name=name, optim_dtype=optim_dtype)
        model_run_config = RoundPipeRunConfig() if model_run_config is None else model_run_config
        if not isinstance(model_run_config, RoundPipeRunConfig):
            raise RoundPipeTypeError(
                "model_run_config must be a RoundPipeRunConfig, got "
                f"{type(model_run_config).__name__}"
            )
        if pin_model not in ("alloc", "register", "off"):
            raise RoundPipeValueError(
                f"pin_model must be 'alloc', 'register' or 'off', got {pin_model!r}"
            )
        if layers is None:
            layer_list = list(model) if isinstance(model, nn.Sequential) else [model]
        else:
            layer_list = list(layers)
            bad = [type(x).__name__ for x in layer_list if not isinstance(x, nn.Module)]
            if bad:
                raise RoundPipeTypeError(f"layers must all be nn.Module, got {bad}")
        if not layer_list:
            raise RoundPipeValueError("layers must not be empty")
        self.model_run_config = model_run_config
        object.__setattr__(
            self, "layers", layer_list
        )  # plain list: not re-registered as submodules
        self.num_layers = len(layer_list)
        pin_module(model, pin_model, get_devices()[0].supports_pinning)
        in_model = set(model.modules())
        for layer in layer_list:
            if layer not in in_model:
                pin_module(layer, pin_model, get_devices()[0].supports_pinning)
        self.layer_attrs = [
            make_layer_attribute(f"{self.name}[{i}]", layer, i, optim_dtype)
            for i, layer in enumerate(layer_list)
        ]
        self._extra_attr = self._leftover_attr(model, layer_list)
        self.layer_bytes = [get_model_size(layer) for layer in layer_list]
        self.layer_grad_bytes = [get_model_active_size(layer) for layer in layer_list]
        self.layer_size = [b / 1024**3 for b in self.layer_bytes]
        self.model_timer = ModelTimer(self.num_layers, self.layer_bytes)
        self._rp_ready = True

    def _leftover_attr(
        self, model: nn.Module, layer_list: list[nn.Module]
    ) -> LayerAttribute | None:
        """Parameters of ``model`` in no layer: they never run, but still get optimizer copies."""
        covered = {id(p) for layer in layer_list for p in layer.parameters()}
        rest = [p for p in unique_params(model) if id(p) not in covered]
        for p in rest:
            ParamAttribute.set(p, None, self.optim_dtype)
        return LayerAttribute(f"{self.name}[unused]", rest) if rest else None

    def _all_layer_attrs(self) -> list[LayerAttribute]:
        return self.layer_attrs + ([self._extra_attr] if self._extra_attr is not None else [])

    def _plan(
        self, cfg: FullRoundPipeRunConfig, run_type: Literal["infer", "train", "fused"]
    ) -> ModelExecutePlan:
        plan = (
            cfg.execute_plan
            if cfg.execute_plan is not None
            else ModelExecutePlan.auto(run_type, self)
        )
        plan.check_valid(self.num_layers, run_type)
        return plan

    def forward(
        self, *args: Any, roundpipe_run_config: RoundPipeRunConfig | None = None, **kwargs: Any
    ) -> Any:
        """Run the model pipelined over microbatches; autograd-compatible.

        With gradients enabled, the result is attached to the autograd graph and
        ``loss.backward()`` runs the pipelined recompute + backward.
        """
        raise_pending_error()
        cfg = FullRoundPipeRunConfig(
            roundpipe_run_config or RoundPipeRunConfig(), self.model_run_config
        )
        batch = Batch(args, kwargs, cfg)
        if not cfg.requires_grad:
            run = RoundPipeRun(self, cfg, batch, self._plan(cfg, "infer"), False, "inference")
            run.launch_forward(fused=False)
            run.join()
            _activations_landed()
            return batch.dump(cfg, [pytree.tree_unflatten(s[0], s[1]) for s in run.states])
        if not torch.is_grad_enabled():
            raise RoundPipeRuntimeError(
                "requires_grad=True in the run config but gradients are disabled "
                "(torch.no_grad); enable grad or set requires_grad=False"
            )
        run = RoundPipeRun(self, cfg, batch, self._plan(cfg, "train"), True, "forward")
        inputs = [
            t
            for leaves in batch.flatten_states
            for t in leaves
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        tag = torch.zeros((), requires_grad=True)
        outs = iter(RoundPipeBatchedBackward.apply(run, tag, *inputs))
        per_mb = []
        for leaves, spec, _ in run.states:
            new = [next(outs) if isinstance(t, torch.Tensor) else t for t in leaves]
            per_mb.append(pytree.tree_unflatten(new, spec))
        return batch.dump(cfg, per_mb)

    def forward_backward(
        self,
        input_args: tuple[Any, ...] = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[
            [Any, Any], torch.Tensor | Sequence[torch.Tensor]
        ] = lambda outputs, labels: outputs,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
    ) -> Any:
        """Forward, loss and backward in one pipelined pass; the last stage is fused.

        ``loss_fn(outputs, labels)`` runs per microbatch and each result is back-propagated
        as is, so divide by the number of microbatches for a mean over the batch.
        Returns the SUM of the microbatch losses (and the merged outputs when
        ``return_outputs``).

        Raises:
            ValueError: the inputs cannot be split into ``num_microbatch`` microbatches (e.g.
                a batch with fewer rows): ``loss_fn`` could not scale its loss correctly.

        Example:
            >>> net = RoundPipe(nn.Sequential(nn.Linear(4, 1)), pin_model="off",
            ...                 model_run_config=RoundPipeRunConfig(num_microbatch=2))
            >>> x, y = torch.randn(4, 4), torch.randn(4, 1)
            >>> loss = net.forward_backward((x,), label=y,
            ...     loss_fn=lambda out, lab: nn.functional.mse_loss(out, lab) / 2)
        """
        if not isinstance(input_args, tuple):
            raise RoundPipeTypeError(f"input_args must be a tuple, got {type(input_args).__name__}")
        if input_kwargs is not None and not isinstance(input_kwargs, dict):
            raise RoundPipeTypeError(
                f"input_kwargs must be a dict, got {type(input_kwargs).__name__}"
            )
        if not callable(loss_fn):
            raise RoundPipeTypeError("loss_fn must be callable")
        if not torch.is_grad_enabled():
            raise RoundPipeRuntimeError(
                "forward_backward needs gradients enabled (called under torch.no_grad)"
            )
        raise_pending_error()
        cfg = FullRoundPipeRunConfig(run_config or RoundPipeRunConfig(), self.model_run_config)
        cfg.requires_grad = True
        batch = Batch(input_args, input_kwargs or {}, cfg, label)
        if batch.num_microbatch != cfg.num_microbatch:
            # loss_fn sees one microbatch and cannot know the real count: a loss divided by the
            # configured num_microbatch would silently scale the gradients. Refuse instead.
            raise RoundPipeValueError(
                f"{self.name}: forward_backward with num_microbatch={cfg.num_microbatch}, but "
                f"{batch.count_mismatch}, so only {batch.num_microbatch} microbatches can be "
                f"made; loss_fn runs once per microbatch and the losses are summed, so a loss "
                f"divided by num_microbatch would be off by {batch.num_microbatch}/"
                f"{cfg.num_microbatch}. Pass a batch of at least {cfg.num_microbatch} rows, or "
                f"run_config=RoundPipeRunConfig(num_microbatch={batch.num_microbatch})"
            )
        run = RoundPipeRun(self, cfg, batch, self._plan(cfg, "fused"), True, "forward_backward")
        run.loss_fn = loss_fn
        run.return_outputs = return_outputs
        run.launch_forward(fused=True)
        run.join()
        _activations_landed()
        # gradients for caller tensors (e.g. outputs of an upstream RoundPipe model)
        ins, grads = [], []
        for m, g in enumerate(run.input_grads()):
            for t, gi, need in zip(batch.flatten_states[m], g, run.input_grad_mask[m]):
                if need and gi is not None:
                    ins.append(t)
                    grads.append(gi)
        if ins:
            torch.autograd.backward(ins, grads)
        losses = batch.loss_list
        if isinstance(losses[0], torch.Tensor):
            total: Any = torch.stack(losses).sum(0)
        else:
            total = [torch.stack([mb[i] for mb in losses]).sum(0) for i in range(len(losses[0]))]
        if not return_outputs:
            return total
        outs = [pytree.tree_unflatten(*c.outputs[:2]) for c in run.contexts]  # type: ignore[index]
        return total, batch.dump(cfg, outs)


class AutoRoundPipe(RoundPipeBase):
    """Optimizer copies and asynchronous ``step`` over an arbitrary model whose heavy
    submodules were replaced by :class:`RoundPipe` instances (see ``wrap_model_to_roundpipe``).

    Parameters outside any RoundPipe submodule run on the host in the caller's thread;
    their pending optimizer update is applied before the next forward.

    Example:
        >>> body = RoundPipe(nn.Sequential(nn.Linear(4, 4)), pin_model="off")
        >>> auto = AutoRoundPipe(nn.Sequential(body, nn.Linear(4, 1)))
        >>> auto(torch.randn(3, 4)).shape
        torch.Size([3, 1])
    """

    def __init__(
        self,
        model: nn.Module,
        name: str | None = None,
        optim_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, name=name, optim_dtype=optim_dtype)
        self.sub_roundpipes = [m for m in model.modules() if isinstance(m, RoundPipe)]
        covered = {id(p) for rp in self.sub_roundpipes for p in nn.Module.parameters(rp)}
        rest = [p for p in unique_params(model) if id(p) not in covered]
        for p in rest:
            ParamAttribute.set(p, None, optim_dtype)
        self.local_attr = LayerAttribute(f"{self.name}[local]", rest)
        self.layer_attrs = [self.local_attr]
        self._rp_ready = True

    def _all_layer_attrs(self) -> list[LayerAttribute]:
        attrs = [self.local_attr]
        for rp in self.sub_roundpipes:
            attrs.extend(rp._all_layer_attrs())
        return attrs

    @property
    def module_param_uploaded_events(self) -> list[LayerAttribute]:
        """Layer attributes of every RoundPipe submodule (their upload state)."""
        return [a for rp in self.sub_roundpipes for a in rp.layer_attrs]

    @property
    def module_gradient_ready_events(self) -> list[LayerAttribute]:
        """Layer attributes of every RoundPipe submodule (their gradient state)."""
        return self.module_param_uploaded_events

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Apply pending updates of host-run parameters, then call the model."""
        raise_pending_error()
        if self.local_attr.params and self.local_attr.copied < self.local_attr.launched:
            self.local_attr.flush()
            self.local_attr.wait_copied()
        return self.model(*args, **kwargs)

    def sync_optim_param(self) -> None:
        """Copy every pending optimizer update into the model parameters now."""
        super().sync_optim_param()

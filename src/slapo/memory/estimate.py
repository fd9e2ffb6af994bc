"""``slapo.estimate_memory``: the peak memory of one training step, from a fake run.

The schedule's module runs one training step (forward, backward, optimizer step) with fake
parameters (``torch._subclasses.FakeTensorMode``): every parameter, buffer, activation, gradient
and optimizer state has its real shape, dtype and device, and no data, so a model of any size is
estimated in a second without allocating it. The step is the schedule's own, primitives included:
a checkpointed block keeps only its inputs, a selective-checkpoint policy keeps what it saves, a
``replace``d module saves what its forward saves, and a tensor-parallel rank holds its shards
(with a real process group, each rank estimates its own share; the collectives run fake too).

============  ===================================================================================
params        every parameter's storage (one per tied group; a tensor-parallel rank: its shards)
buffers       every buffer's storage
grads         the gradients the backward leaves
optimizer     the state the optimizer given creates in a step (AdamW: ``exp_avg`` and
_state        ``exp_avg_sq`` per trainable parameter, and a step count; SGD with momentum: one
              buffer; without: none). The optimizer itself runs its step on the fake tensors.
activations   the bytes kept from the forward for the backward: every tensor autograd saves
              (``saved_tensors_hooks``, one count per storage, parameters excluded) and every
              other tensor the forward created that is still alive when it returns (e.g. a
              selective checkpoint's cache), the outputs excepted
peak          ``params + buffers + grads + optimizer_state + activations``: all of it at once, as
              at the end of a backward with ``zero_grad(set_to_none=False)``; the figure the
              tests check against measurement (bytes saved for backward of a real step, plus
              parameter, gradient and optimizer bytes)
live_peak     the most bytes alive at once in a steady-state step (the optimizer state already
              there), temporaries, blocks recomputed in backward and the output held through it
              (as ``slapo.train_step`` holds it) included: what a device allocator's peak
              approaches (it also rounds and caches blocks). A checkpointed model's exceeds its
              ``peak``: ``required`` is the larger of the two, what a memory budget must hold
============  ===================================================================================

The batch stays real (it is small): control flow that reads it (a model skipping its attention
mask when nothing is padded) is then exactly the real run's. Compiled code (``torch.compile``, the
``compile`` primitive, the fused kernels) runs uncompiled in the fake run (compiled kernels cannot
run on fake tensors), so its estimate is the eager code's: the compiler's own choice of what to
save for backward may keep somewhat less (a compiled, selectively checkpointed llama block: 8%
fewer activation bytes, its measured peak 4% below the estimate).

Example:
    >>> sch = slapo.create_schedule(model)
    >>> sch["model.layers.0"].checkpoint()
    >>> est = slapo.estimate_memory(sch, {"input_ids": ids, "labels": ids})
    >>> print(est)                      # a table: parameters, gradients, ..., peak, by module
    >>> est.fits("8GiB")                # the larger of peak and live_peak fits 8 GiB
    True
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..exceptions import SlapoError
from .units import format_bytes, parse_bytes

__all__ = ["EstimateError", "MemoryEstimate", "estimate_memory", "fake_process_group"]


class EstimateError(SlapoError, RuntimeError):
    """The memory estimate cannot be made: bad arguments, or the fake training step failed."""


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted memory of one training step, in bytes (see :mod:`slapo.memory.estimate`).

    Attributes:
        params, buffers, grads, optimizer_state, activations: the parts; :attr:`peak` is their sum.
        live_peak: the most bytes alive at once in a steady-state step, temporaries included.
        by_module: activation bytes by the innermost module running when they were saved or
            created (``""`` is the root), in forward order.
        model, optimizer: class names, for the report.
        device: the device type the model's parameters train on ("cpu", "cuda", ...).
        rank, world_size: this process in its process group (None, 1 without one).
        engine: bytes a parallel engine holds besides the parts (DDP's gradient buckets,
            FSDP's gathered parameters, DeepSpeed's fp32 partition), by name in ``engine_parts``
            (:func:`slapo.estimate_layout`).
        device_resident: RoundPipe only: the most bytes one device holds at once.
        target, layout, stage: the build target, ``{"dp", "pp", "tp"}`` sizes and the pipeline
            stage (None without one) this rank's estimate is of.

    Example:
        >>> est = slapo.estimate_memory(sch, batch)
        >>> est.peak == est.params + est.buffers + est.grads + est.optimizer_state + est.activations
        True
        >>> est.fits("8GiB")
        True
    """

    params: int
    buffers: int
    grads: int
    optimizer_state: int
    activations: int
    live_peak: int
    by_module: dict[str, int] = field(default_factory=dict)
    model: str = ""
    optimizer: str = ""
    device: str = "cpu"
    rank: int | None = None
    world_size: int = 1
    engine: int = 0
    engine_parts: dict[str, int] = field(default_factory=dict)
    device_resident: int | None = None
    target: str = "eager"
    layout: dict[str, int] = field(default_factory=lambda: {"dp": 1, "pp": 1, "tp": 1})
    stage: int | None = None

    @property
    def peak(self) -> int:
        """Every part at once: parameters, buffers, gradients, optimizer state, activations and
        the engine's buffers."""
        return (
            self.params + self.buffers + self.grads + self.optimizer_state + self.activations
            + self.engine
        )  # fmt: skip

    @property
    def required(self) -> int:
        """What a memory budget must hold: the larger of :attr:`peak` and :attr:`live_peak`."""
        return max(self.peak, self.live_peak)

    def fits(self, budget: int | float | str) -> bool:
        """Whether :attr:`required` fits ``budget`` (bytes, or text such as ``"8GiB"``)."""
        return self.required <= parse_bytes(budget)

    def as_dict(self) -> dict[str, Any]:
        """Every field, ``peak`` and ``required`` included, as JSON-ready values."""
        return {**asdict(self), "peak": self.peak, "required": self.required}

    def by_block(self) -> dict[str, int]:
        """:attr:`by_module` summed per block: a path is cut after its first index
        (``model.layers.3.mlp.up_proj`` -> ``model.layers.3``), other paths after two names.

        Example:
            >>> list(est.by_block())[:3]
            ['model.embed_tokens', 'model.layers.0', 'model.layers.1']
        """
        out: dict[str, int] = {}
        for path, nbytes in self.by_module.items():
            parts = path.split(".") if path else []
            cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), min(len(parts), 2))
            key = ".".join(parts[:cut]) or "(root)"
            out[key] = out.get(key, 0) + nbytes
        return out

    def table(self, top: int = 12) -> str:
        """A readable report: the parts, the peaks, and the ``top`` blocks by activations."""
        where = "" if self.rank is None else f", rank {self.rank} of {self.world_size}"
        if self.target != "eager" or self.layout.get("pp", 1) > 1:
            sizes = " x ".join(f"{k}{v}" for k, v in self.layout.items())
            where += f", target {self.target} {sizes}"
            where += "" if self.stage is None else f" (stage {self.stage})"
        rows = [
            ("parameters", self.params), ("buffers", self.buffers), ("gradients", self.grads),
            ("optimizer state", self.optimizer_state), ("activations", self.activations),
            *self.engine_parts.items(),
        ]  # fmt: skip
        width = 28
        lines = [
            f"memory estimate: {self.model} on {self.device}, optimizer {self.optimizer}{where}"
        ]
        lines += [f"  {name:<{width}}{format_bytes(n):>12}" for name, n in rows]
        lines.append("  " + "-" * (width + 12))
        lines.append(f"  {'peak (all of the above)':<{width}}{format_bytes(self.peak):>12}")
        lines.append(
            f"  {'live peak (with temporaries)':<{width}}{format_bytes(self.live_peak):>12}"
        )
        lines.append(
            f"  {'required (larger of the two)':<{width}}{format_bytes(self.required):>12}"
        )
        if self.device_resident is not None:
            resident = format_bytes(self.device_resident)
            lines.append(f"  {'resident on one device':<{width}}{resident:>12}")
        blocks = self.by_block()
        if blocks:
            lines.append("  activations by block:")
            ranked = sorted(blocks.items(), key=lambda kv: -kv[1])[:top]
            keep = {name for name, _ in ranked}
            for name, nbytes in blocks.items():  # forward order
                if name in keep:
                    lines.append(f"    {name:<{width - 2}}{format_bytes(nbytes):>12}")
            if len(blocks) > len(keep):
                rest = sum(n for name, n in blocks.items() if name not in keep)
                others = f"({len(blocks) - len(keep)} more)"
                lines.append(f"    {others:<{width - 2}}{format_bytes(rest):>12}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[Any]:
    """Stand in for ``world_size`` ranks in this one process, as rank ``rank``: a process group
    whose collectives communicate nothing (torch's "fake" backend). A tensor-parallel schedule
    built over it shards as on a real rank, so :func:`estimate_memory` gives that rank's share.

    Example:
        >>> with fake_process_group(4) as group:
        ...     sch = slapo.model_schedule.apply_schedule(model, group=group)
        ...     est = slapo.estimate_memory(sch, batch)     # one rank of 4
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers "fake")

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise EstimateError(f"world_size must be a positive int, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise EstimateError(f"rank must lie in [0, {world_size}), got {rank!r}")
    if dist.is_initialized():
        raise EstimateError(
            "fake_process_group: a process group is already initialized in this process; "
            "estimate on its ranks instead (every rank calls estimate_memory)"
        )
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# ----- the fake training step --------------------------------------------------------------------
def _optimizer_classes() -> dict[str, type]:
    return {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
    }  # fmt: skip


def _module_of(sch: Any) -> nn.Module:
    from ..schedule import Schedule

    if isinstance(sch, Schedule):
        return sch.mod
    if isinstance(sch, nn.Module):
        wrapped = getattr(sch, "module", None)
        if isinstance(wrapped, nn.Module) and type(sch).__name__ in (
            "DistributedDataParallel", "FullyShardedDataParallel", "DataParallel",
        ):  # fmt: skip
            raise EstimateError(
                f"estimate_memory got a {type(sch).__name__} wrapper, whose hooks would run "
                "real collectives on fake gradients: pass the schedule (sch) or sch.mod instead"
            )
        return sch
    raise EstimateError(
        f"estimate_memory needs a Schedule (slapo.create_schedule(model)) or an nn.Module, got "
        f"{type(sch).__name__}"
    )


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in a model output (tensors, mappings, lists and tuples of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 6 and isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value, depth + 1)
    elif depth < 6 and isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, depth + 1)


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested: no plain storage
        return None


def _make_counter() -> Any:
    # deferred: TorchDispatchMode is not needed by `import slapo`
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Counter(TorchDispatchMode):
        """Every storage the step's ops create: bytes alive now, the most alive at once, and the
        module that was running when each was created. Storages that existed before the step
        (parameters, buffers, the batch) and views of them are not counted."""

        def __init__(self, known: set[int], where: Callable[[], str]) -> None:
            super().__init__()
            self.known, self.where = known, where
            self.alive: dict[int, tuple[Any, int]] = {}  # id(storage) -> (weak ref, bytes)
            self.origin: dict[int, str] = {}
            self.now = self.peak = 0

        def _gone(self, key: int, _ref: Any) -> None:
            _, nbytes = self.alive.pop(key, (None, 0))
            self.now -= nbytes

        def add(self, t: torch.Tensor) -> None:
            st = _storage(t)
            key = id(st)
            if st is None or key in self.alive or key in self.known:
                return
            nbytes = st.nbytes()
            self.alive[key] = (weakref.ref(st, functools.partial(self._gone, key)), nbytes)
            self.origin[key] = self.where()
            self.now += nbytes
            self.peak = max(self.peak, self.now)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.add(t)
            return out

    return Counter


@contextlib.contextmanager
def _uncompiled() -> Iterator[None]:
    """Run ``torch.compile``d code eagerly: compiled kernels on fake tensors can crash."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:
        with set_stance("force_eager"):
            yield
        return
    from torch import _dynamo  # torch < 2.6

    with _dynamo.config.patch(disable=True):
        yield


@contextlib.contextmanager
def _restore_tensor_attributes(model: nn.Module) -> Iterator[None]:
    """Undo tensors a forward caches on its modules (``self._cache = ...``): after the fake
    step, a real step must never meet a fake tensor."""
    before = {
        (id(m), k): v for m in model.modules() for k, v in vars(m).items()
        if isinstance(v, torch.Tensor)
    }  # fmt: skip
    try:
        yield
    finally:
        for m in model.modules():
            for k, v in list(vars(m).items()):
                if not isinstance(v, torch.Tensor) or before.get((id(m), k)) is v:
                    continue
                if (id(m), k) in before:
                    vars(m)[k] = before[(id(m), k)]
                else:
                    del vars(m)[k]


def _module_stack(model: nn.Module) -> tuple[list[str], list[Any]]:
    """Hooks keeping the path of every module whose forward is running; returns (stack, handles)."""
    stack: list[str] = []
    handles = []
    for path, mod in model.named_modules():

        def pre(_m: nn.Module, _args: Any, path: str = path) -> None:
            stack.append(path)

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            if stack:
                stack.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    return stack, handles


def _fake_optimizer(
    optimizer: Any, kwargs: dict[str, Any], fake_of: dict[int, torch.Tensor], trainable: list
) -> tuple[Any, str]:
    """The optimizer given, over the fake parameters; returns it and its name."""
    if optimizer is None:
        return None, "none"
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = []
        for group in optimizer.param_groups:
            foreign = [p for p in group["params"] if id(p) not in fake_of]
            if foreign:
                raise EstimateError(
                    f"the {type(optimizer).__name__} given holds {len(foreign)} tensor(s) that are "
                    "not parameters of the model: pass the optimizer built for this model, or its "
                    "class (optimizer=torch.optim.AdamW, optimizer_kwargs={...})"
                )
            options = {k: v for k, v in group.items() if k != "params"}
            groups.append({**options, "params": [fake_of[id(p)] for p in group["params"]]})
        try:
            return type(optimizer)(groups, **optimizer.defaults), type(optimizer).__name__
        except TypeError:  # an optimizer whose defaults are not all constructor arguments
            return type(optimizer)(groups), type(optimizer).__name__
    if isinstance(optimizer, str):
        classes = _optimizer_classes()
        if optimizer.lower() == "none":
            return None, "none"
        if optimizer.lower() not in classes:
            raise EstimateError(
                f"unknown optimizer={optimizer!r}; name one of torch.optim's "
                f"({', '.join(sorted(classes))}), pass its class, or None"
            )
        optimizer = classes[optimizer.lower()]
    if not callable(optimizer):
        raise EstimateError(
            f"optimizer must be a torch.optim class or name, an optimizer, a factory "
            f"params -> optimizer, or None; got {optimizer!r}"
        )
    name = getattr(optimizer, "__name__", type(optimizer).__name__)
    try:
        return optimizer(trainable, **kwargs), name
    except TypeError as exc:
        raise EstimateError(f"cannot create optimizer {name} with {kwargs}: {exc}") from exc


def _fake_state(
    model: nn.Module, mode: Any, device: torch.device | None
) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor], list[torch.Tensor]]:
    """Fake twins of the model's parameters and buffers: (by name, param id -> fake, buffers)."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            if t.device.type == "meta" or (device is not None and t.device != device):
                with mode:
                    f = torch.empty_strided(
                        t.size(), t.stride(), dtype=t.dtype, device=device or "cpu"
                    )
                made[id(t)] = f.requires_grad_(t.requires_grad)
            else:
                made[id(t)] = mode.from_tensor(t)
        return made[id(t)]

    by_name = {n: fake(p) for n, p in model.named_parameters(remove_duplicate=False)}
    fake_of = {id(p): made[id(p)] for p in model.parameters()}
    buffers = [fake(b) for b in model.buffers()]
    by_name.update({n: fake(b) for n, b in model.named_buffers(remove_duplicate=False)})
    return by_name, fake_of, buffers


def _default_device(model: nn.Module) -> torch.device | None:
    """Where a model whose weights are on the meta device would train: None keeps each tensor's."""
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if devices and all(d.type == "meta" for d in devices):
        return torch.device("cpu")
    return None


def _nbytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = _storage(t)
        if st is not None:
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


def estimate_memory(
    sch: Any,
    batch: Any,
    *,
    optimizer: Any = "adamw",
    optimizer_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    device: str | torch.device | None = None,
) -> MemoryEstimate:
    """Predict the memory of one training step of ``sch`` on ``batch``, without allocating it.

    Args:
        sch: a schedule (its module, as scheduled, is estimated) or an ``nn.Module``.
        batch: what :func:`slapo.train_step` takes: a mapping of keyword arguments (the loss is
            the output's ``loss``), a tuple of positional ones, or a tensor. Real tensors (they
            stay real: they are small), or tensors on the meta device for a batch of any size.
        optimizer: the optimizer whose state counts: a ``torch.optim`` name (``"adamw"``,
            ``"sgd"``, ...), class or factory (with ``optimizer_kwargs``), an optimizer built
            for this model (its class and hyperparameters are used), or None for no state.
        loss_fn: ``loss_fn(output, target)`` as for :func:`slapo.train_step`.
        device: the device the model trains on, for a model on the meta device (default
            "cpu"); its tensors' own devices otherwise.

    Returns:
        A :class:`MemoryEstimate` (bytes; ``print`` it for a table). With a process group
        (tensor parallelism), every rank calls it and gets its own share.

    Raises:
        EstimateError: bad arguments, or the fake step failed (e.g. an op that reads tensor
            values, which fake tensors do not have); the message names the cause.

    Example:
        >>> model = transformers.LlamaForCausalLM(config)
        >>> sch = slapo.model_schedule.apply_schedule(model, ckpt_ratio=0.5)
        >>> ids = torch.randint(0, config.vocab_size, (8, 512))
        >>> est = slapo.estimate_memory(sch, {"input_ids": ids, "labels": ids},
        ...                             optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
        >>> print(est)
    """
    # deferred: fake tensors and the contract pull in modules `import slapo` does not need
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    from ..targets.contract import output_loss, split_batch

    model = _module_of(sch)
    args, kwargs, target = split_batch(batch, with_target=loss_fn is not None)
    dev = torch.device(device) if device is not None else _default_device(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    by_name, fake_of, buffers = _fake_state(model, mode, dev)
    params = list(fake_of.values())
    trainable = list({id(p): p for p in params if p.requires_grad}.values())
    if not trainable:
        raise EstimateError(
            f"no parameter of {type(model).__name__} requires grad: there is no training step "
            "to estimate (unfreeze some with requires_grad_(True))"
        )

    def place(x: Any) -> Any:  # meta (or off-device) inputs become fake ones where the model is
        if isinstance(x, torch.Tensor) and (
            x.device.type == "meta" or (dev is not None and x.device != dev)
        ):
            with mode:
                return torch.empty_strided(
                    x.size(), x.stride(), dtype=x.dtype, device=dev or "cpu"
                ).requires_grad_(x.requires_grad)
        return x

    args = tuple(place(a) for a in args)
    kwargs = {k: place(v) for k, v in kwargs.items()}
    target = place(target)
    inputs = [*args, *kwargs.values(), target]
    opt, opt_name = _fake_optimizer(optimizer, dict(optimizer_kwargs or {}), fake_of, trainable)
    param_storages = {id(_storage(p)) for p in params}
    known = param_storages | {id(_storage(b)) for b in buffers}
    known |= {id(_storage(t)) for t in inputs if isinstance(t, torch.Tensor)}

    stack, handles = _module_stack(model)
    counter = _make_counter()(known, lambda: stack[-1] if stack else "")
    saved: dict[int, int] = {}
    saved_at: dict[int, str] = {}
    keep: list[Any] = []  # every storage counted in the forward: no id is reused meanwhile

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = _storage(t)
        key = id(st)
        if st is not None and key not in param_storages and key not in saved:
            saved[key] = st.nbytes()
            saved_at[key] = stack[-1] if stack else ""  # the module that keeps it
            keep.append(st)
        return t

    def step() -> dict[str, Any]:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*args, **kwargs)
            loss = output_loss(out) if loss_fn is None else loss_fn(out, target)
        if not loss.requires_grad:
            raise EstimateError(
                "the loss does not require grad: no trainable parameter of the model takes part "
                "in it; there is no training step to estimate"
            )
        outputs = {id(_storage(t)) for t in [*_tensors(out), loss]}
        extra = {k: n for k, (_, n) in counter.alive.items() if k not in saved and k not in outputs}
        by_module: dict[str, int] = {}
        for k, n in [*saved.items(), *extra.items()]:
            where = saved_at.get(k, counter.origin.get(k, ""))
            by_module[where] = by_module.get(where, 0) + n
        facts: dict[str, Any] = {
            "activations": sum(saved.values()) + sum(extra.values()), "by_module": by_module,
        }  # fmt: skip
        keep.clear()  # counted: the backward frees them as it goes
        loss.backward()  # the output stays alive through backward, as in slapo.train_step
        del out, loss
        facts["grads"] = _nbytes(p.grad for p in params if p.grad is not None)
        # In later steps the optimizer state is there from the start: it adds to this peak.
        facts["forward_backward_peak"], counter.peak = counter.peak, counter.now
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            facts["optimizer_state"] = _nbytes(
                v for state in opt.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)
            )  # fmt: skip
        facts["optimizer_step_peak"] = counter.peak
        return facts

    try:
        with contextlib.ExitStack() as ctx:
            ctx.enter_context(torch.random.fork_rng(devices=[]))
            ctx.enter_context(_uncompiled())
            ctx.enter_context(_restore_tensor_attributes(model))
            ctx.enter_context(_reparametrize_module(model, by_name, tie_weights=True, strict=False))
            ctx.enter_context(counter)
            facts = step()
    except SlapoError:
        raise
    except Exception as exc:
        raise EstimateError(
            f"estimate_memory: the fake training step of {type(model).__name__} failed: "
            f"{type(exc).__name__}: {exc}. Fake tensors have shapes but no values: an op that "
            "reads a value of the model's tensors (.item(), a data-dependent shape) cannot run "
            "on them; a value of the batch can (keep the batch real, not on the meta device)"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    rank = world = None
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    state = facts.get("optimizer_state", 0)
    created = max(facts["forward_backward_peak"] + state, facts["optimizer_step_peak"])
    return MemoryEstimate(
        params=_nbytes(params),
        buffers=_nbytes(buffers),
        grads=facts["grads"],
        optimizer_state=state,
        activations=facts["activations"],
        live_peak=_nbytes(params) + _nbytes(buffers) + created,
        by_module=facts["by_module"],
        model=type(model).__name__,
        optimizer=opt_name,
        device=params[0].device.type if params else "cpu",
        rank=rank,
        world_size=world or 1,
    )

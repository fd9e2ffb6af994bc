"""``Verify``: check that the primitives applied in a block keep the model's numerics.

On exit the scheduled model and a copy of the model taken on entry run the same inputs under the
same RNG state; outputs, input gradients and every parameter gradient must match (a sharded
parameter's gradient against the matching slice of the full one). When they differ, the recorded
primitives are replayed one by one on a fresh copy to name the first one that breaks equivalence.

A model created under ``init_empty_weights`` (parameters on the meta device) is checked too: the
entry copy is materialized with the model's own initialization (as ``build`` does), and the
scheduled model runs with the same values, found by parameter name (a sharded parameter gets its
slice), swapped in for the check only: the user's model stays on the meta device.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .exceptions import SlapoError
from .initialization import _outermost_hf_models, has_meta_tensors, materialize_module
from .logger import get_logger
from .random import get_cuda_rng_tracker
from .schedule import PrimitiveRecord, Schedule, create_schedule
from .sharding.spec import get_shard_spec
from .surgery import label
from .tracing.retrace import _ATTR as _RETRACE_ATTR
from .tracing.retrace import fingerprint

__all__ = ["Verify", "VerificationError", "MetaVerifyError"]

# (rtol, atol) per dtype: float32 allows for reordered reductions; half types for their precision.
_TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (1e-2, 1e-3),
}


class VerificationError(SlapoError, AssertionError):
    """The scheduled model's outputs or gradients differ from the original model's."""


class MetaVerifyError(SlapoError, ValueError):
    """A schedule on the meta device that Verify cannot give real values to.

    Raised when a meta parameter or buffer of the scheduled model has no counterpart (by name, or
    as a shard of one) in the model as it was on entering the block, e.g. a module replaced by one
    with new parameters created under ``init_empty_weights``.
    """


@dataclass
class _Mismatch:
    what: str
    max_diff: float

    def __str__(self) -> str:
        return f"{self.what} differs (max abs difference {self.max_diff:.3g})"


@dataclass
class _Raised:
    """Running the scheduled model (forward, loss or backward) raised ``error``."""

    error: BaseException

    def __str__(self) -> str:
        return f"running it raises {_one_line(self.error)}"


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


@dataclass
class _StepResult:
    outputs: list[torch.Tensor]
    input_grads: list[torch.Tensor | None]
    param_grads: dict[str, torch.Tensor]
    params: dict[str, nn.Parameter]


class Verify(contextlib.ContextDecorator):
    """Verify, on exit, that the primitives applied inside the block keep outputs and gradients.

    Args:
        sch: the root schedule; primitives are applied to it inside the block.
        example_inputs: positional inputs (a tensor, tuple or list) or keyword inputs (a dict).
        device: where both models run for the check; ``"cuda"`` (the default, as in Slapo's
            reference API) falls back to the CPU, with one logged note, where no GPU is present.
        eval_mode: run both in eval mode (no dropout); ``False`` checks train mode, with the same
            RNG state for both runs.
        enable: ``False`` turns the check off (e.g. in production runs).
        loss_fn: ``loss_fn(output) -> scalar`` for the backward; by default a fixed random
            projection of every floating output (a plain sum could hide errors, e.g. softmax rows
            always sum to one).
        rtol, atol: override the tolerances chosen from the output dtype.

    A model on the meta device (``init_empty_weights``) is checked on a materialized copy and
    stays on meta; a meta parameter with no counterpart by name raises :class:`MetaVerifyError`.

    Example:
        >>> import slapo
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
        >>> sch = slapo.create_schedule(model)
        >>> with slapo.Verify(sch, torch.randn(3, 4)):
        ...     sch["1"].replace(nn.GELU())
        ...     sch["0"].checkpoint()
    """

    def __init__(
        self,
        sch: Schedule,
        example_inputs: Any,
        device: str | torch.device = "cuda",
        eval_mode: bool = True,
        enable: bool = True,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        rtol: float | None = None,
        atol: float | None = None,
    ) -> None:
        if not isinstance(sch, Schedule) or sch.parent is not None:
            raise SlapoError("Verify needs the root schedule returned by slapo.create_schedule")
        self.sch = sch
        self.example_inputs = example_inputs
        self.device = _usable_device(device) if enable else torch.device("cpu")
        self.eval_mode = eval_mode
        self.enable = enable
        self.loss_fn = loss_fn
        self.rtol, self.atol = rtol, atol
        self._original: nn.Module | None = None
        # The entry copy with real values: the original itself, or its materialized copy.
        self._source: nn.Module | None = None
        # Entry name of each tensor of the user's model (strong references keep the ids unique).
        self._entry_names: dict[int, str] = {}
        self._entry_tensors: list[torch.Tensor] = []
        self._first_record = 0

    def __enter__(self) -> Verify:
        if self.enable:
            self._original = copy.deepcopy(self.sch.mod)
            self._first_record = len(self.sch.metadata.primitives)
            named = [
                *self.sch.mod.named_parameters(remove_duplicate=False),
                *self.sch.mod.named_buffers(remove_duplicate=False),
            ]
            for name, tensor in named:
                self._entry_names.setdefault(id(tensor), name)
                self._entry_tensors.append(tensor)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if not self.enable or exc_type is not None:
            return False  # never hide the error raised inside the block
        assert self._original is not None
        try:
            return self._check()
        finally:
            self._source = None
            self._entry_names, self._entry_tensors = {}, []

    def _check(self) -> bool:
        assert self._original is not None
        on_meta = has_meta_tensors(self._original) or has_meta_tensors(self.sch.mod)
        self._source = _materialized(self._original) if on_meta else self._original
        swaps: list[_Swap] = []
        if on_meta:
            problem: MetaVerifyError | None = None
            try:
                swaps = _real_values(self.sch.mod, self._source, self._entry_names)
            except MetaVerifyError as err:
                problem = err
            if _on_any_rank(problem is not None):  # every rank stops (the runs hold collectives)
                raise problem or MetaVerifyError(
                    "Verify: another rank cannot give the meta schedule real values (see its error)"
                )
        try:
            reference = self._run(copy.deepcopy(self._source))
        except Exception as err:  # noqa: BLE001  (bad example inputs, not a bad schedule)
            raise SlapoError(
                "Verify: the original model (as it was on entering the block) raises "
                f"{_one_line(err)} on example_inputs; pass inputs the unscheduled model accepts"
            ) from err
        error: Exception | None = None
        mismatch: _Mismatch | _Raised | None
        try:
            with _swapped(self.sch.mod, swaps):  # the user's model is back on meta afterwards
                mismatch = self._compare(reference, self._run(self.sch.mod))
        except Exception as err:  # noqa: BLE001  (a primitive broke the model: bisect to it)
            mismatch, error = _Raised(err), err
        if _on_any_rank(mismatch is not None):  # every rank takes the same path (collectives)
            mismatch = mismatch or _Mismatch("a tensor on another rank", float("nan"))
            raise VerificationError(self._explain(mismatch, reference)) from error
        return False

    # ----- running ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _fixed_rng(self) -> Iterator[None]:
        tracker = get_cuda_rng_tracker()
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        tracked = tracker.get_states()
        try:
            yield
        finally:  # the next run starts from the very same state
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            tracker.set_states(tracked)

    def _inputs(self) -> tuple[tuple, dict[str, Any]]:
        def prepare(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            x = x.detach().to(self.device).clone()
            return x.requires_grad_() if x.is_floating_point() else x

        inputs = tree_map(prepare, self.example_inputs)
        if isinstance(inputs, dict):
            return (), inputs
        if isinstance(inputs, (tuple, list)):
            return tuple(inputs), {}
        return (inputs,), {}

    def _run(self, model: nn.Module) -> _StepResult:
        """One forward and backward; the model is left as found (device, mode, no gradients)."""
        home = next(model.parameters(), torch.empty(0)).device
        was_training = model.training
        model.to(self.device).train(not self.eval_mode)
        args, kwargs = self._inputs()
        try:
            with self._fixed_rng():
                output = model(*args, **kwargs)
                outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
                loss = self.loss_fn(output) if self.loss_fn else _projection_loss(outputs)
                model.zero_grad(set_to_none=True)
                loss.backward()
            leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            params = dict(model.named_parameters())
            return _StepResult(
                outputs=[o.detach() for o in outputs],
                input_grads=[t.grad if t.requires_grad else None for t in leaves],
                param_grads={
                    n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None
                },
                params=params,
            )
        finally:
            model.zero_grad(set_to_none=True)
            model.to(home).train(was_training)

    # ----- comparing ----------------------------------------------------------------------------
    def _tol(self, t: torch.Tensor) -> tuple[float, float]:
        rtol, atol = _TOLERANCES.get(t.dtype, (1e-4, 1e-5))
        return (
            self.rtol if self.rtol is not None else rtol,
            self.atol if self.atol is not None else atol,
        )

    def _differs(self, ref: torch.Tensor, got: torch.Tensor) -> float | None:
        if ref.shape != got.shape:
            return float("inf")
        rtol, atol = self._tol(ref)
        ref64, got64 = ref.double(), got.double()
        if torch.allclose(got64, ref64, rtol=rtol, atol=atol, equal_nan=True):
            return None
        return (got64 - ref64).abs().max().item()

    def _compare(self, ref: _StepResult, got: _StepResult) -> _Mismatch | None:
        if len(ref.outputs) != len(got.outputs):
            return _Mismatch(
                f"the number of outputs ({len(ref.outputs)} vs {len(got.outputs)})", float("inf")
            )
        for i, (r, g) in enumerate(zip(ref.outputs, got.outputs)):
            if (d := self._differs(r, g)) is not None:
                return _Mismatch(f"output {i}", d)
        for i, (r, g) in enumerate(zip(ref.input_grads, got.input_grads)):
            if r is not None and g is not None and (d := self._differs(r, g)) is not None:
                return _Mismatch(f"the gradient of input {i}", d)
        for name, grad in got.param_grads.items():
            ref_grad = ref.param_grads.get(name)
            if ref_grad is None:
                continue  # a parameter the schedule introduced (e.g. by replace): nothing to match
            ref_grad = _matching_slice(ref_grad, got.params[name])
            if (d := self._differs(ref_grad, grad)) is not None:
                return _Mismatch(f'the gradient of parameter "{name}"', d)
        missing = [n for n in ref.param_grads if n in got.params and n not in got.param_grads]
        if missing:
            return _Mismatch(f'the gradient of parameter "{missing[0]}" (now None)', float("inf"))
        return None

    # ----- explaining ---------------------------------------------------------------------------
    def _explain(self, mismatch: _Mismatch | _Raised, reference: _StepResult) -> str:
        records = self.sch.metadata.primitives[self._first_record :]
        head = f"Verify: the scheduled model is not equivalent to the original: {mismatch}."
        try:
            culprit, detail = self._bisect(records, reference)
        except Exception as err:  # noqa: BLE001  (replay is best effort; the mismatch stands)
            return f"{head} Could not replay the primitives to find the culprit: {err}"
        if culprit is None:
            return f"{head} Replaying the {len(records)} primitive(s) did not reproduce it."
        return (
            f"{head} The first primitive that breaks equivalence is {culprit} on "
            f'"{label(culprit.path)}" ({detail}); no primitive after it restores equivalence.'
        )

    def _bisect(
        self, records: list[PrimitiveRecord], reference: _StepResult
    ) -> tuple[PrimitiveRecord | None, str]:
        """The record right after the longest prefix of records that still verifies.

        Intermediate states need not run (a tensor-parallel schedule is only consistent once
        all its shards and syncs are applied), so a prefix that raises counts as failing and the
        search walks back from the full schedule to the last equivalent prefix.
        """
        assert self._source is not None
        details: list[str] = []
        for count in range(len(records), -1, -1):
            replica = copy.deepcopy(self._source)
            sch = create_schedule(replica, group=self.sch.group)
            try:
                for record in records[:count]:
                    args, kwargs = copy.deepcopy((record.args, record.kwargs))
                    getattr(sch[record.path], record.name)(*args, **kwargs)
                # A replacement created on the meta device gets its values as in the full check.
                with _swapped(sch.mod, _real_values(sch.mod, self._source, {})):
                    mismatch = self._compare(reference, self._run(sch.mod))
                detail = str(mismatch) if mismatch else ""
            except Exception as err:  # noqa: BLE001  (an inconsistent intermediate schedule)
                detail = str(_Raised(err))
            failed = _on_any_rank(bool(detail))
            if not failed:
                if count == len(records):
                    return None, ""
                return records[count], details[-1] if details else ""
            details.append(detail or "a tensor on another rank differs")
        return None, ""


def _usable_device(device: str | torch.device) -> torch.device:
    """``device``, or the CPU when it names CUDA and no GPU is present (noted in the log)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise SlapoError(
            f'Verify: device={device!r} is not a device; pass e.g. "cuda", "cuda:1" or "cpu"'
        ) from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        get_logger().info(
            "Verify: device=%r but no CUDA GPU is available; comparing on the CPU", str(device)
        )
        return torch.device("cpu")
    return resolved


def _on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (just ``flag`` outside torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _projection_loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    total: torch.Tensor | None = None
    for out in outputs:
        if not (out.is_floating_point() and out.requires_grad):
            continue
        weight = torch.randn(out.shape, generator=generator, dtype=torch.float32).to(out.device)
        term = (out.float() * weight).sum()
        total = term if total is None else total + term
    if total is None:
        raise SlapoError("Verify: the model produced no floating-point output that requires grad")
    return total


# ----- meta-device schedules --------------------------------------------------------------------
# (a meta tensor of the scheduled model, the real tensor that stands in for it during the check)
_Swap = tuple[torch.Tensor, torch.Tensor]


def _materialized(original: nn.Module) -> nn.Module:
    """A copy of ``original`` with its meta tensors materialized by the model's own init.

    The same seed on every rank gives every rank the same full values, so their shards agree.
    Modules that neither transformers nor ``reset_parameters`` initialize would keep
    ``torch.empty`` garbage (NaN compares equal to NaN): they get small random values instead.
    """
    model = copy.deepcopy(original)
    was_meta = {
        (id(mod), name)
        for mod in model.modules()
        for name, p in mod._parameters.items()
        if p is not None and p.is_meta
    }
    with torch.random.fork_rng(devices=[]):  # leave the user's random stream alone
        torch.manual_seed(0)
        touched = materialize_module(model)
        covered = {id(m) for hf in _outermost_hf_models(model) for m in hf.modules()}
        with torch.no_grad():
            for mod in touched:
                if id(mod) in covered or hasattr(mod, "reset_parameters"):
                    continue
                for name, p in mod._parameters.items():
                    if (id(mod), name) in was_meta:
                        p.normal_(0.0, 0.02)
    return model


def _real_values(model: nn.Module, source: nn.Module, aliases: dict[int, str]) -> list[_Swap]:
    """Real stand-ins for ``model``'s meta tensors, with the values of ``source``'s by name.

    ``aliases`` maps a tensor (by id) to its name on entering the block, for tensors a primitive
    moved (e.g. flattened into a traced graph). A tied tensor gets one stand-in for all holders.
    """
    full = dict(source.named_parameters(remove_duplicate=False))
    full.update(source.named_buffers(remove_duplicate=False))
    swaps: dict[int, _Swap] = {}
    for mod_path, mod in model.named_modules(remove_duplicate=False):
        for store in (mod._parameters, mod._buffers):
            for attr, tensor in store.items():
                if tensor is None or not tensor.is_meta or id(tensor) in swaps:
                    continue
                name = f"{mod_path}.{attr}" if mod_path else attr
                value = _counterpart(tensor, aliases.get(id(tensor), name), full, mod_path, mod)
                swaps[id(tensor)] = (tensor, _real_like(tensor, value))
    return list(swaps.values())


def _counterpart(
    tensor: torch.Tensor, name: str, full: dict[str, torch.Tensor], mod_path: str, mod: nn.Module
) -> torch.Tensor:
    """The entry tensor named ``name``, or this rank's shard of it for a sharded ``tensor``."""
    kind = "parameter" if isinstance(tensor, nn.Parameter) else "buffer"
    where = f'{kind} "{name.rsplit(".", 1)[-1]}" of "{label(mod_path)}" ({type(mod).__name__})'
    value = full.get(name)
    if value is None:
        why = f'the model as it was on entering the block has no tensor named "{name}"'
    elif value.shape == tensor.shape:
        return value
    elif (spec := get_shard_spec(tensor)) is not None and tuple(value.shape) == spec.full_shape:
        return spec.local_slice(value)
    else:
        why = (
            f'"{name}" had shape {tuple(value.shape)} on entering the block, now '
            f"{tuple(tensor.shape)} (and it is not a shard of it)"
        )
    raise MetaVerifyError(
        f"Verify: the {where} is on the meta device and has no values to check with: {why}. "
        "Verify gives a meta schedule the values of the materialized original by parameter "
        "name; materialize the model before Verify (create it outside init_empty_weights), give "
        "the replacement the same parameter names and shapes, or create the replacement with "
        "real weights"
    )


def _real_like(meta: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A real copy of ``value`` that stands in for ``meta`` (type, dtype and attributes kept)."""
    data = value.detach().to(dtype=meta.dtype).clone()
    if isinstance(meta, nn.Parameter):
        real: torch.Tensor = type(meta)(data, requires_grad=meta.requires_grad)
    else:
        real = data
    real.__dict__.update(meta.__dict__)  # shard specs and annotate tags
    return real


@contextlib.contextmanager
def _swapped(model: nn.Module, swaps: list[_Swap]) -> Iterator[None]:
    """Hold the real stand-ins in place of ``model``'s meta tensors for the block, then put the
    meta ones back.

    ``torch.utils.swap_tensors`` would keep the Python objects, but refuses tensors that
    torch.export's fake-tensor caches hold weak references to (every traced parameter), so the
    holders' entries are replaced instead. A traced graph that may trace itself again for a new
    input signature keeps its original module and a fingerprint of its parameters: the module
    gets the stand-ins too, the fingerprint is taken again for the block (so this is not taken
    for an edit), and graphs traced during the block (on the stand-ins) are dropped after it.
    """
    real = {id(meta): stand_in for meta, stand_in in swaps}
    retracers = [r for m in model.modules() if (r := m.__dict__.get(_RETRACE_ATTR)) is not None]
    holders = [*model.modules(), *(m for r in retracers for m in r.mod.modules())]
    previous: list[tuple[dict[str, Any], str, Any]] = []
    saved = [(r, r.before, list(r.exported), dict(r.by_absent)) for r in retracers]
    seen: set[int] = set()
    try:
        for mod in holders:
            for store in (mod._parameters, mod._buffers):
                if id(store) in seen:
                    continue
                seen.add(id(store))
                for attr, tensor in store.items():
                    if tensor is not None and id(tensor) in real:
                        previous.append((store, attr, tensor))
                        store[attr] = real[id(tensor)]
        for r in retracers:
            r.before = fingerprint(r.gm)
        yield
    finally:
        for store, attr, tensor in reversed(previous):
            store[attr] = tensor
        for r, before, exported, by_absent in saved:
            r.before, r.exported[:] = before, exported
            r.by_absent.clear()
            r.by_absent.update(by_absent)


def _matching_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of a full gradient that a (possibly tensor-parallel sharded) parameter holds."""
    if full.shape == param.shape:
        return full
    spec = get_shard_spec(param)
    return spec.local_slice(full) if spec is not None else full

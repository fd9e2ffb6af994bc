"""Checks that Slapo schedules every transformers causal-LM architecture, tiny and random,
without changing what it computes.

Each check builds a tiny model of one ``model_type`` (2 layers, hidden 64, vocabulary 128, every
dropout off), trains one step of it unscheduled and one step of it scheduled, from the same
weights on the same batch, and compares the loss and the gradient of every parameter (by name).
The verdict is a :class:`CheckResult`:

* ``"equal"``: loss and every gradient close (``rtol`` 1e-4, ``atol`` 1e-5; ``max_diff`` is the
  largest absolute difference seen);
* ``"different"``: a number is wrong; ``detail`` names the worst parameter (the worst outcome: a
  schedule that trains a different model without saying so);
* ``"refused"``: Slapo declined with a typed error (:class:`~slapo.exceptions.SlapoError`), e.g.
  no ready schedule for the type, or a module its tracer cannot capture;
* ``"error"``: anything else raised (``detail``: the exception type and its first line);
* ``"n/a"``: the check does not apply, e.g. the unscheduled model itself does not train.

The same functions serve a user's own model type (any key of transformers' causal-LM mapping,
including ones registered with ``AutoModelForCausalLM.register``):

Example:
    >>> from slapo.testing import zoo_checks
    >>> zoo_checks.check_eager("phi3").status
    'equal'
    >>> zoo_checks.check_schedule("llama", ckpt_ratio=1.0)
    CheckResult(status='equal', detail='loss and 21 gradients', max_diff=0.0)
    >>> zoo_checks.check_trace("qwen3").status      # first block traced, two input shapes
    'equal'

``benchmarks/model_coverage.py`` runs every architecture through these checks and writes the table
``docs/model_coverage.md``.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..exceptions import SlapoError
from .zoo_models import (
    ZooError,
    _clean_name,
    _config_class,
    _first_line,
    sample_batch,
    tiny_model,
    train_step,
)

__all__ = [
    "STATUSES",
    "CheckResult",
    "check_eager",
    "check_schedule",
    "check_tp",
    "check_trace",
    "compare_grads",
    "has_hf_tp_plan",
    "worst",
]

#: Every verdict a check gives, best first (``worst`` orders them by :data:`SEVERITY`).
STATUSES = ("equal", "refused", "n/a", "error", "different")
#: How bad a verdict is; the worse of two ranks' verdicts is the job's.
SEVERITY = {"equal": 0, "n/a": 1, "refused": 2, "error": 3, "different": 4}
#: Tolerances of "equal" (float32, one training step of a tiny model).
RTOL, ATOL = 1e-4, 1e-5
#: Float32 sums taken in another order (the ranks' partial gradients, another kernel) differ by
#: a few units of the largest term: each element may also be off by this share of the tensor's
#: largest magnitude (Gemma's scaled, tied embedding: 3e-5 of it under TP; 4e-9 in float64).
SCALE_TOL = 1e-4


@dataclass(frozen=True)
class CheckResult:
    """The verdict of one check.

    Attributes:
        status: one of :data:`STATUSES`: ``"equal"``, ``"different"``, ``"refused"``,
            ``"error"`` or ``"n/a"``.
        detail: what was compared, or why it is not equal (the worst parameter, the exception).
        max_diff: the largest absolute difference of the loss or a gradient; None when nothing
            was compared.

    Example:
        >>> CheckResult("refused", "SlapoError: no ready schedule for model type 'phi3'")
        CheckResult(status='refused', detail="SlapoError: ...", max_diff=None)
    """

    status: str
    detail: str = ""
    max_diff: float | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"CheckResult status must be one of {STATUSES}, got {self.status!r}")

    def as_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict.

        Example:
            >>> CheckResult("equal", "loss", 0.0).as_dict()
            {'status': 'equal', 'detail': 'loss', 'max_diff': 0.0}
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> CheckResult:
        """The inverse of :meth:`as_dict`."""
        return cls(doc["status"], doc.get("detail", ""), doc.get("max_diff"))


def worst(results: list[CheckResult]) -> CheckResult:
    """The most severe of ``results`` (:data:`SEVERITY`); the first of equally severe ones.

    Example:
        >>> worst([CheckResult("equal"), CheckResult("error", "boom")]).status
        'error'
    """
    return max(results, key=lambda r: SEVERITY[r.status])


# --- comparison ----------------------------------------------------------------------------------


def _excess(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The largest absolute difference, and how far the worst element is beyond the
    tolerance (> 0: not close; inf where a value is not finite in one of them only)."""
    got, want = got.detach().double(), want.detach().double()
    if got.numel() == 0:
        return 0.0, -1.0
    same_nonfinite = (~torch.isfinite(got)) & (got == want)
    diff = torch.where(same_nonfinite, torch.zeros_like(got), (got - want).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)
    magnitude = want.abs().nan_to_num(nan=0.0, posinf=0.0)
    excess = diff - (ATOL + RTOL * magnitude + SCALE_TOL * magnitude.max())
    return float(diff.max()), float(excess.max())


def compare_grads(
    ref_loss: torch.Tensor,
    loss: torch.Tensor,
    want: Mapping[str, torch.Tensor | None],
    grads: Mapping[str, torch.Tensor | None],
) -> CheckResult:
    """Compare a loss and its gradients with the expected ones (rtol 1e-4, atol 1e-5):
    ``"equal"``, or ``"different"`` naming the worst parameter (or the loss).

    Example:
        >>> compare_grads(torch.tensor(1.0), torch.tensor(1.0), {"w": torch.ones(2)},
        ...               {"w": torch.ones(2)})
        CheckResult(status='equal', detail='loss and 1 gradients', max_diff=0.0)
    """
    if set(want) != set(grads):
        missing, extra = sorted(set(want) - set(grads)), sorted(set(grads) - set(want))
        return CheckResult(
            "different", f"parameter names differ: missing {missing[:3]}, extra {extra[:3]}"
        )
    max_diff, excess = _excess(loss.reshape(()), ref_loss.reshape(()))
    if excess > 0:
        return CheckResult(
            "different", f"loss {float(loss):.6g} vs {float(ref_loss):.6g}", max_diff
        )
    bad: list[tuple[float, str, str]] = []
    for name, expected in want.items():
        got = grads[name]
        if expected is None or got is None:
            if (expected is None) != (got is None):
                which = "no gradient" if got is None else "a gradient where the reference has none"
                bad.append((math.inf, name, which))
            continue
        if got.shape != expected.shape:
            bad.append((math.inf, name, f"shape {tuple(got.shape)} vs {tuple(expected.shape)}"))
            continue
        diff, over = _excess(got, expected)
        max_diff = max(max_diff, diff)
        if over > 0:
            bad.append((diff, name, f"off by {diff:.3g}"))
    if bad:
        diff, name, why = max(bad)
        return CheckResult(
            "different",
            f"gradient of {name}: {why} ({len(bad)} of {len(want)} outside rtol {RTOL:g}, "
            f"atol {ATOL:g}, {SCALE_TOL:g} of the largest)",
            max_diff,
        )
    return CheckResult("equal", f"loss and {len(want)} gradients", max_diff)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _failure(exc: BaseException, where: str = "") -> CheckResult:
    """A raised exception as a result: a Slapo refusal, or an error."""
    status = "refused" if isinstance(exc, SlapoError) else "error"
    return CheckResult(status, f"{where}{_describe(exc)}")


def _reference(
    model_type: str, shapes: tuple[tuple[int, int], ...] = ((2, 16),)
) -> tuple[nn.Module, list[dict[str, torch.Tensor]], list[tuple[Any, Any]]] | CheckResult:
    """The tiny model, a batch per ``(batch, seq)`` shape, and the unscheduled loss and
    gradients on each; an ``"n/a"`` result when the unscheduled model does not train."""
    try:
        model = tiny_model(model_type)
        batches = [sample_batch(model, b, s) for b, s in shapes]
        ref = copy.deepcopy(model)
        outs = [train_step(ref, batch) for batch in batches]
    except Exception as exc:  # noqa: BLE001  (reported)
        return CheckResult("n/a", f"does not train unscheduled: {_describe(exc)}")
    if not all(torch.isfinite(loss) for loss, _ in outs):
        return CheckResult("n/a", "does not train unscheduled: loss is not finite")
    return model, batches, outs


def _compare_runs(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    outs: list[tuple[Any, Any]],
    shapes: tuple[tuple[int, int], ...],
    expected: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> CheckResult:
    """Train ``model`` one step per batch and compare with the reference ``outs``."""
    results = []
    for (b, s), batch, (ref_loss, ref_grads) in zip(shapes, batches, outs):
        where = f"batch {b} x seq {s}: " if len(shapes) > 1 else ""
        try:
            loss, grads = train_step(model, batch)
        except Exception as exc:  # noqa: BLE001  (reported)
            return _failure(exc, where)
        want = ref_grads
        if expected is not None:
            want = {n: None if g is None else expected(n, g) for n, g in ref_grads.items()}
        result = compare_grads(ref_loss, loss, want, grads)
        if result.status != "equal":
            return CheckResult(result.status, where + result.detail, result.max_diff)
        results.append(result)
    diffs = [r.max_diff for r in results if r.max_diff is not None]
    shown = ", ".join(f"{b}x{s}" for b, s in shapes)
    detail = results[0].detail + (f" at {shown}" if len(shapes) > 1 else "")
    return CheckResult("equal", detail, max(diffs) if diffs else None)


# --- the checks ----------------------------------------------------------------------------------


def check_eager(model_type: str) -> CheckResult:
    """The unscheduled tiny model trains one step (finite loss, backward reaches the
    parameters) and a second run from a copy gives the same loss and gradients: ``"equal"``.
    A model whose two runs differ (so no schedule can be compared with it) is
    ``"different"``; one that fails is ``"error"``; ``"n/a"`` when transformers cannot make a
    tiny model of it (:class:`ZooError`).

    Example:
        >>> check_eager("llama").status
        'equal'
    """
    try:
        model = tiny_model(model_type)
    except ZooError as exc:
        return CheckResult("n/a", _describe(exc))
    try:
        batch = sample_batch(model)
        twin = copy.deepcopy(model)
        loss, grads = train_step(model, batch)
    except Exception as exc:  # noqa: BLE001  (reported)
        return _failure(exc)
    if not torch.isfinite(loss):
        return CheckResult("error", f"loss is not finite ({float(loss)})")
    if not any(g is not None for g in grads.values()):
        return CheckResult("error", "backward reached no parameter")
    try:
        loss2, grads2 = train_step(twin, batch)
    except Exception as exc:  # noqa: BLE001  (reported)
        return _failure(exc, "second run: ")
    result = compare_grads(loss, loss2, grads, grads2)
    if result.status != "equal":
        return CheckResult(result.status, "not deterministic: " + result.detail, result.max_diff)
    return CheckResult("equal", f"loss {float(loss):.4f}; {result.detail}", result.max_diff)


def check_schedule(model_type: str, **knobs: Any) -> CheckResult:
    """``slapo.model_schedule.apply_schedule(model, **knobs)`` (no knobs: the recommended
    schedule), built with ``slapo.build(sch, init_weights=False)``, trains one step like the
    unscheduled model: the loss and every gradient compared.

    Example:
        >>> check_schedule("llama", ckpt_ratio=1.0).status
        'equal'
        >>> check_schedule("gemma4_assistant").status     # a drafter: no token-id batch
        'n/a'
    """
    from .. import build
    from ..model_schedule import apply_schedule

    ref = _reference(model_type)
    if isinstance(ref, CheckResult):
        return ref
    model, batches, outs = ref
    try:
        sch = apply_schedule(copy.deepcopy(model), **knobs)
        scheduled, _ = build(sch, init_weights=False)
    except Exception as exc:  # noqa: BLE001  (reported)
        return _failure(exc)
    return _compare_runs(scheduled, batches, outs, ((2, 16),))


#: The input shapes ``check_trace`` compares at: the one traced with and another.
TRACE_SHAPES = ((2, 16), (3, 9))


def check_trace(model_type: str) -> CheckResult:
    """The first decoder block (``slapo.model_schedule.find_blocks``) traced with no example inputs
    (``sch[block].trace()``), built, trains one step like the unscheduled model at batch 2 x
    seq 16 and at batch 3 x seq 9: a traced graph must not be specialised to one shape.

    Example:
        >>> check_trace("llama")
        CheckResult(status='equal', detail='loss and 21 gradients at 2x16, 3x9', max_diff=0.0)
    """
    from .. import build
    from ..model_schedule import find_blocks
    from ..schedule import create_schedule

    ref = _reference(model_type, TRACE_SHAPES)
    if isinstance(ref, CheckResult):
        return ref
    model, batches, outs = ref
    blocks, _ = find_blocks(model)
    if not blocks:
        return CheckResult("n/a", "no repeated blocks found")
    block = _first_decoder_block(model, blocks, batches[0]["input_ids"])
    try:
        sch = create_schedule(copy.deepcopy(model))
        sch[block].trace()
        traced, _ = build(sch, init_weights=False)
    except Exception as exc:  # noqa: BLE001  (reported)
        return _failure(exc, f"trace {block}: ")
    return _compare_runs(traced, batches, outs, TRACE_SHAPES)


def _first_decoder_block(model: nn.Module, blocks: list[str], input_ids: torch.Tensor) -> str:
    """The first of ``blocks`` a run on token ids alone calls (a multimodal model's vision
    blocks come first in the module tree but never see token ids), else the first such member of
    a list of like composite modules (GIT keeps only its vision layers whole); else the first
    block."""
    lists = [
        f"{path}.{name}"
        for path, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len({type(c) for c in mod.children()}) == 1
        for name, child in mod._modules.items()
        if child is not None and any(True for _ in child.children())
    ]
    for candidates in (blocks, [p for p in lists if p not in blocks]):
        called = _called_first(model, candidates, input_ids)
        if called is not None:
            return called
    return blocks[0]


def _called_first(model: nn.Module, paths: list[str], input_ids: torch.Tensor) -> str | None:
    """The first of ``paths`` a run of ``model`` on ``input_ids`` calls, or None."""
    called: list[str] = []
    handles = [
        model.get_submodule(p).register_forward_pre_hook(lambda *_, p=p: called.append(p))
        for p in paths
    ]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    except Exception:  # noqa: BLE001  (the model needs more than token ids)
        pass
    finally:
        for handle in handles:
            handle.remove()
    return called[0] if called else None


def has_hf_tp_plan(model_type: str) -> bool:
    """Whether transformers ships a tensor-parallel plan (a non-empty ``base_model_tp_plan``)
    for ``model_type`` (on its config or its text sub-config).

    Example:
        >>> has_hf_tp_plan("llama"), has_hf_tp_plan("gpt2")
        (True, False)
    """
    try:
        config_class = _config_class(model_type)
    except ZooError:
        return False
    if getattr(config_class, "base_model_tp_plan", None):
        return True
    for sub_class in (getattr(config_class, "sub_configs", None) or {}).values():
        if inspect.isclass(sub_class) and getattr(sub_class, "base_model_tp_plan", None):
            return True
    return False


def check_tp(model_type: str, group: Any, **knobs: Any) -> CheckResult:
    """Tensor parallelism over ``group`` (run it on every rank of an initialised process
    group): ``apply_schedule(model, group=group, ckpt_ratio=0.0, **knobs)``, built, against the
    same model in this process without a group. A sharded parameter's gradient is compared
    with its slice of the full one (``get_shard_spec(p).local_slice``), a replicated
    parameter's with the whole one. The ranks exchange their verdicts: every rank returns the
    worst. ``detail`` says "nothing sharded" when the plan sharded no parameter.

    Example (in each of 2 ranks, after ``slapo.env.setup(rank, 2, "gloo")``):
        >>> check_tp("llama", torch.distributed.group.WORLD).status  # doctest: +SKIP
        'equal'
    """
    local = _check_tp_local(model_type, group, knobs)
    return _agree(local, group)


def _check_tp_local(model_type: str, group: Any, knobs: dict[str, Any]) -> CheckResult:
    from .. import build
    from ..model_schedule import apply_schedule
    from ..sharding import get_shard_spec

    ref = _reference(model_type)
    if isinstance(ref, CheckResult):
        return ref
    model, batches, outs = ref
    try:
        sch = apply_schedule(copy.deepcopy(model), group=group, **{"ckpt_ratio": 0.0, **knobs})
        sharded, _ = build(sch, init_weights=False)
    except Exception as exc:  # noqa: BLE001  (reported)
        return _failure(exc)
    specs = {_clean_name(n): get_shard_spec(p) for n, p in sharded.named_parameters()}

    def expected(name: str, full: torch.Tensor) -> torch.Tensor:
        spec = specs.get(name)
        return full if spec is None else spec.local_slice(full)

    result = _compare_runs(sharded, batches, outs, ((2, 16),), expected)
    count = sum(spec is not None for spec in specs.values())
    note = f"; {count} sharded" if count else "; nothing sharded"
    return CheckResult(result.status, result.detail + note, result.max_diff)


def _agree(local: CheckResult, group: Any) -> CheckResult:
    """Every rank's verdict gathered: the worst, naming the rank when they differ."""
    import torch.distributed as dist

    try:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local.as_dict(), group=group)
    except Exception as exc:  # noqa: BLE001  (reported)
        return CheckResult(
            "error", f"ranks could not exchange verdicts ({_describe(exc)}); {local.detail}"
        )
    results = [CheckResult.from_dict(doc) for doc in gathered]
    bad = worst(results)
    if all(r.status == results[0].status for r in results):
        diffs = [r.max_diff for r in results if r.max_diff is not None]
        return CheckResult(bad.status, bad.detail, max(diffs) if diffs else None)
    rank = results.index(bad)
    return CheckResult(bad.status, f"rank {rank}: {bad.detail}", bad.max_diff)

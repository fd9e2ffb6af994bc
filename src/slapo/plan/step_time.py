"""``predict_step``: the seconds of one training step of one rank of a layout, on a cluster.

The counts come from the fake training step the memory planner runs
(:func:`slapo.memory.estimate_layout`): while it runs, a dispatch mode (:class:`StepCounter`)
sees every aten op of the forward, the backward (recompute of checkpointed blocks included, as
it runs there) and the optimizer step, on fake tensors, and counts

* ``matmul``: the FLOPs of ``mm``/``addmm``/``bmm``/convolutions, by the formulas
  ``torch.utils.flop_counter`` (``FlopCounterMode``) uses (``flop_registry``);
* ``attention``: fused attention kernels: ``4 b h s_q s_k d`` forward, halved when causal (the
  kernels skip the masked half), and 2.5x that backward (FlashAttention's backward recomputes
  the scores: five matmuls to the forward's two);
* ``memory``: every other op that makes new data (views are free): the bytes it reads and
  writes, at the device's memory bandwidth;
* ``collective``: functional collectives the step runs (tensor or context parallel groups):
  bytes per rank of a ring (all-reduce ``2 (n-1)/n``, all-gather ``(n-1)`` x the input,
  reduce-scatter and all-to-all ``(n-1)/n``).

The data-parallel engine's collectives do not run in the fake step; they follow from the
parameters (what FSDP2 and DDP move): FSDP2 all-gathers every unit's parameters in the compute
dtype in forward and again in backward (``reshard_after_forward=True``) and reduce-scatters the
gradients in ``reduce_dtype`` (float32 by default, torchtitan's too); DDP all-reduces them. A
pipeline sends one boundary activation per microbatch each way.

Seconds: each kind at the :class:`~slapo.plan.hardware.DeviceSpec`'s achievable rate; a
collective on the link its group crosses (:meth:`ClusterSpec.link_for`; dp spans ``pp*cp*tp``
consecutive ranks per member). Overlap as the engines overlap: FSDP2 prefetches the next unit's
all-gather during the current one's compute and runs reduce-scatters beside the backward, so
only the first unit's all-gather, the last unit's reduce-scatter and what exceeds the compute of
its phase are exposed; DDP's bucketed all-reduce overlaps the backward but its last bucket (25
MiB); tensor/context-parallel collectives and pipeline sends are exposed (no async TP). A
pipeline of ``pp`` stages and ``m`` microbatches (GPipe, 1F1B) runs ``m + pp - 1`` microbatch
slots of one stage (stages taken as balanced: the model's compute / ``pp``): the bubble is
``(pp-1)/(m+pp-1)`` of the step.

Where the host computes (a CPU), the device's measured host terms add (each calibrated by
:mod:`slapo.plan.calibrate`, absent for GPU presets): each op's dispatch
(``op_overhead_us``); each op a selective checkpoint's Python dispatch mode passes on,
uncompiled (``selective_ops``, counted from the Python frames above the counter: that mode is
off the mode stack while it calls the op); FSDP2's work per unit and a pipeline's per slot
(``engine_overhead_us``); a collective call of a measured size at its measured time
(``collective_us``). Ranks whose threads outnumber the host's cores take turns on them
(:attr:`ClusterSpec.time_shared`): a rank's path is predicted as if its threads had cores of
their own, and the step is at least the node's ranks' busy time (all but the bubble) over the
cores.

``compile=True`` models ``torch.compile`` of the blocks: memory-bound traffic of forward and
backward is cut by :data:`COMPILE_MEMORY_TRAFFIC` (fusion) and activations by
:data:`COMPILE_ACTIVATIONS` (the compiler saves less for backward).

Example:
    >>> import torch
    >>> import transformers
    >>> import slapo
    >>> config = transformers.LlamaConfig(  # a tiny llama, random weights
    ...     hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
    ... )
    >>> model = transformers.LlamaForCausalLM(config)
    >>> ids = torch.randint(0, 256, (2, 16))
    >>> sch, batch = slapo.create_schedule(model), {"input_ids": ids, "labels": ids}
    >>> from slapo.plan import PRESETS
    >>> cluster = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, inter_node_gbps=50.0)
    >>> pred = predict_step(sch, batch, cluster, target="fsdp", dp=8, precision="bf16")
    >>> print(pred)          # seconds, tokens/s per GPU, MFU, memory and their top terms
    step ... tokens/s/GPU, MFU ...
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..exceptions import SlapoError
from ..memory import LayoutSpec, MemoryEstimate, apply_layout, format_bytes, layout_step
from ..memory.units import reserved_bytes
from ..throughput import model_flops_per_token
from .hardware import ClusterSpec

__all__ = [
    "COMPILE_ACTIVATIONS",
    "COMPILE_MEMORY_TRAFFIC",
    "PlanError",
    "StepCounter",
    "StepCounts",
    "StepPrediction",
    "collective_key",
    "predict_step",
    "shape_key",
    "time_step",
]

#: Fraction of the eager memory-bound bytes a compiled forward/backward moves. An assumption
#: (no measurement here): Inductor fuses a block's elementwise chains (norms, rotary, SiLU-mul,
#: casts) so each fused region reads its inputs and writes its outputs once, about half the
#: traffic of the eager op-by-op chain.
COMPILE_MEMORY_TRAFFIC = 0.5
#: Fraction of the eager activation bytes a compiled block saves for backward: measured here on
#: a selectively checkpointed llama block (``slapo.memory.estimate``'s module doc: 8% fewer).
COMPILE_ACTIVATIONS = 0.92
#: DDP's default bucket (``bucket_cap_mb=25``): the last one's all-reduce is exposed.
DDP_BUCKET_BYTES = 25 * 2**20

_MATMUL_PACKETS = {
    torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
    torch.ops.aten._scaled_mm, torch.ops.aten.convolution, torch.ops.aten._convolution,
    torch.ops.aten.convolution_backward,
}  # fmt: skip
_ATTENTION_FORWARD = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
}
_ATTENTION_BACKWARD = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
    torch.ops.aten._scaled_dot_product_flash_attention_backward,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward,
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward,
}
#: Ops that make no new data (metadata, scalars, profiler marks).
_FREE = {
    "prim", "profiler",
}  # fmt: skip
_FREE_OPS = {
    torch.ops.aten._local_scalar_dense, torch.ops.aten.lift_fresh, torch.ops.aten.empty_strided,
    torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.detach,
}  # fmt: skip
PHASES = ("forward", "backward", "optimizer")


def _selective_checkpoint_codes() -> frozenset[Any]:
    """The code of the dispatch modes a selective checkpoint runs its region under (torch's
    ``create_selective_checkpoint_contexts``: one caches in forward, one replays in the
    recompute); empty where this torch has none."""
    import torch.utils.checkpoint as ckpt

    codes = set()
    for name in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode"):
        mode = getattr(ckpt, name, None)
        if mode is not None:  # its __torch_dispatch__ is wrapped (dynamo disabled): unwrap
            codes.add(inspect.unwrap(mode.__torch_dispatch__).__code__)
    return frozenset(codes)


_SELECTIVE_CHECKPOINT_CODES = _selective_checkpoint_codes()
#: Where the walk up the Python stack stops: a module's call (the op came from its code, not
#: from a mode between it and the counter), or this many frames.
_MODULE_CALL_CODE = inspect.unwrap(nn.Module._call_impl).__code__
_MAX_CALLER_FRAMES = 64


def _under_selective_checkpoint() -> bool:
    """Whether the op being counted was dispatched by a selective checkpoint's mode: that mode
    is popped off the mode stack while it calls the op, so the stack cannot say; the Python
    frames above the counter can (other modes, the memory estimator's, may sit between)."""
    frame = sys._getframe(2)  # the counter's caller
    for _ in range(_MAX_CALLER_FRAMES):
        if frame is None or frame.f_code is _MODULE_CALL_CODE:
            return False
        if frame.f_code in _SELECTIVE_CHECKPOINT_CODES:
            return True
        frame = frame.f_back
    return False


class PlanError(SlapoError, ValueError):
    """A step-time prediction cannot be made (bad arguments; the message says which)."""


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _arg(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return default


def _attention_flops(func: Any, args: tuple, kwargs: dict, backward: bool) -> int:
    q, k = _arg(func, args, kwargs, "query"), _arg(func, args, kwargs, "key")
    *batch, s_q, d = q.shape
    heads = 1
    for n in batch:
        heads *= n
    flops = 4 * heads * s_q * k.shape[-2] * d
    if _arg(func, args, kwargs, "is_causal", False):
        flops //= 2
    return int(flops * 2.5) if backward else flops


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_GEMMS = {torch.ops.aten.mm: 0, torch.ops.aten.bmm: 0, torch.ops.aten.addmm: 1,
          torch.ops.aten.baddbmm: 1}  # fmt: skip


def shape_key(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The shape an op's rate depends on, as a readable key (``None`` where no rate is measured
    per shape): ``"matmul fp32 1024x384x128 nt"`` (m x n x k, a batched one ``b x m x n x k``;
    each operand ``n`` or ``t``, a transposed view),
    ``"attention fwd fp32 32x128x128x32 causal"`` (batch x heads, query and key length, head
    dim; ``bwd`` for the backward kernel). :attr:`DeviceSpec.op_tflops` holds rates by these
    keys; :func:`slapo.plan.calibrate.calibrate_shapes` measures them.

    Example:
        >>> a, b = torch.ones(64, 32), torch.ones(32, 16)
        >>> shape_key(torch.ops.aten.mm.default, (a, b), {})
        'matmul fp32 64x16x32 nn'
        >>> shape_key(torch.ops.aten.mm.default, (a, b.t().contiguous().t()), {})
        'matmul fp32 64x16x32 nt'
    """
    packet = func._overloadpacket
    if packet in _GEMMS:
        first = _GEMMS[packet]
        a, b = args[first], args[first + 1]
        dtype = _DTYPE_NAMES.get(a.dtype)
        if dtype is None:
            return None
        dims = [*a.shape[:-1], b.shape[-1], a.shape[-1]]  # (b,) m, n, k
        # each operand's layout: "t" where it is a transposed view (a linear's weight forward,
        # its inputs in the weight's gradient): a GEMM's speed depends on it
        layout = "".join("t" if x.dim() >= 2 and x.stride(-1) != 1 else "n" for x in (a, b))
        return f"matmul {dtype} " + "x".join(str(int(d)) for d in dims) + f" {layout}"
    if packet in _ATTENTION_FORWARD or packet in _ATTENTION_BACKWARD:
        q, k = _arg(func, args, kwargs, "query"), _arg(func, args, kwargs, "key")
        dtype = _DTYPE_NAMES.get(q.dtype)
        if dtype is None or q.dim() != 4:
            return None
        b, h, s_q, d = (int(n) for n in q.shape)
        causal = " causal" if _arg(func, args, kwargs, "is_causal", False) else ""
        way = "bwd" if packet in _ATTENTION_BACKWARD else "fwd"
        return f"attention {way} {dtype} {b * h}x{s_q}x{int(k.shape[-2])}x{d}{causal}"
    return None


def _collective_bytes(func: Any, args: tuple, kwargs: dict) -> tuple[str, int, int, int]:
    """(name, group size, bytes one rank sends, bytes it contributes) of a collective."""
    import torch.distributed as dist

    name = func._overloadpacket.__name__
    group = _arg(func, args, kwargs, "group_name") or _arg(func, args, kwargs, "tag")
    size = _arg(func, args, kwargs, "group_size")
    process_group = _arg(func, args, kwargs, "process_group")
    if not isinstance(size, int) and process_group is not None:
        try:  # c10d's ops take the group itself, boxed as a script object
            size = dist.ProcessGroup.unbox(process_group).size()
        except Exception:  # noqa: S110 - fall back to resolving by name
            pass
    if not isinstance(size, int):
        try:
            size = dist.distributed_c10d._resolve_process_group(group).size()
        except Exception:  # an unknown group: count it as a pair
            size = 2
    data = args[0]
    for arg_name in ("input_tensors", "input_tensor", "input", "tensors", "tensor"):
        value = _arg(func, args, kwargs, arg_name)
        if value is not None:  # what this rank contributes (c10d's all-gather lists outputs first)
            data = value
            break
    nbytes = _nbytes(data)
    return name, size, _ring_sent(name, size, nbytes), nbytes


def _ring_sent(name: str, size: int, nbytes: int) -> int:
    """Bytes one rank of a ring of ``size`` sends in collective ``name`` of ``nbytes`` each."""
    plain = name.replace("_", "")  # c10d's allreduce_, functional all_reduce, ...
    if "allreduce" in plain:
        return 2 * (size - 1) * nbytes // size
    if "allgather" in plain:
        return (size - 1) * nbytes
    return (size - 1) * nbytes // size  # reduce_scatter, all_to_all, broadcast


_COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def collective_key(name: str, group_size: int, nbytes: int) -> str | None:
    """A collective call as a readable key, what its seconds depend on (``None`` for kinds
    not measured per call): ``"all_reduce 262144B x2"`` (the kind, the bytes a rank
    contributes, the group size). :attr:`DeviceSpec.collective_us` holds measured times by
    these keys; :func:`slapo.plan.calibrate.calibrate_collectives` measures them.

    Example:
        >>> collective_key("allreduce_", 2, 262144), collective_key("all_gather_into_tensor", 4, 64)
        ('all_reduce 262144B x2', 'all_gather 64B x4')
    """
    plain = name.replace("_", "")
    for kind in _COLLECTIVE_KINDS:
        if kind.replace("_", "") in plain:
            return f"{kind} {int(nbytes)}B x{int(group_size)}"
    return None


class StepCounter(TorchDispatchMode):
    """Counts a step's work by phase (:data:`PHASES`) and kind while it runs (module doc).

    Attributes:
        flops: ``{(phase, kind): FLOPs}`` for ``matmul`` and ``attention``.
        memory_bytes: ``{phase: bytes}`` read and written by memory-bound ops.
        collectives: ``{(phase, op name, group size): bytes sent per rank}``.
        shaped_flops: ``{(phase, shape key): FLOPs}`` of the matmuls and attention kernels
            (:func:`shape_key`): what a rate measured per shape applies to.
        ops: ``{phase: ops}`` that make new data (each costs the host its dispatch).
        collective_shapes: ``{(phase, op name, group size, collective key): calls}``
            (:func:`collective_key`): what a time measured per call applies to.
        selective_ops: ``{phase: ops}`` a selective checkpoint's dispatch mode passed on (views
            too, not detaches), in forward and in the recompute: each also costs that Python
            mode's work where the region runs uncompiled (``engine_overhead_us["sac_op"]``).

    Example:
        >>> import torch
        >>> import transformers
        >>> import slapo
        >>> config = transformers.LlamaConfig(  # a tiny llama, random weights
        ...     hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        ... )
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, 256, (2, 16))
        >>> with StepCounter() as c:
        ...     _ = slapo.estimate_memory(model, {"input_ids": ids, "labels": ids})
        >>> c.flops[("forward", "matmul")] > 0
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[tuple[str, str], int] = {}
        self.memory_bytes: dict[str, int] = {}
        self.collectives: dict[tuple[str, str, int], int] = {}
        self.collective_calls: dict[tuple[str, str, int], int] = {}
        self.ops: dict[str, int] = {}
        self.shaped_flops: dict[tuple[str, str], int] = {}
        self.selective_ops: dict[str, int] = {}
        self.collective_shapes: dict[tuple[str, str, int, str], int] = {}
        self._seen_backward = False

    def _phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            self._seen_backward = True
            return "backward"
        return "optimizer" if self._seen_backward else "forward"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        phase = self._phase()
        # not prim ops (fake tensors query their device through them; a real step does not)
        # nor detaches (memory accounting's hooks take one of each kept output in the fake step)
        if (
            _SELECTIVE_CHECKPOINT_CODES
            and not (func.namespace in _FREE or packet in _FREE_OPS)
            and _under_selective_checkpoint()
        ):
            self.selective_ops[phase] = self.selective_ops.get(phase, 0) + 1
        if not (func.is_view or func.namespace in _FREE or packet in _FREE_OPS):
            self.ops[phase] = self.ops.get(phase, 0) + 1
        if packet in _MATMUL_PACKETS and packet in flop_registry:
            n = int(flop_registry[packet](*args, **kwargs, out_val=out))
            self.flops[(phase, "matmul")] = self.flops.get((phase, "matmul"), 0) + n
            self._shaped(phase, func, args, kwargs, n)
        elif packet in _ATTENTION_FORWARD or packet in _ATTENTION_BACKWARD:
            n = _attention_flops(func, args, kwargs, packet in _ATTENTION_BACKWARD)
            self.flops[(phase, "attention")] = self.flops.get((phase, "attention"), 0) + n
            self._shaped(phase, func, args, kwargs, n)
        elif func.namespace in ("_c10d_functional", "c10d_functional", "c10d"):
            name, size, sent, nbytes = _collective_bytes(func, args, kwargs)
            key = (phase, name, size)
            self.collectives[key] = self.collectives.get(key, 0) + sent
            self.collective_calls[key] = self.collective_calls.get(key, 0) + 1
            call = collective_key(name, size, nbytes)
            if call is not None:
                shaped = (phase, name, size, call)
                self.collective_shapes[shaped] = self.collective_shapes.get(shaped, 0) + 1
        elif not (func.is_view or func.namespace in _FREE or packet in _FREE_OPS):
            n = _nbytes(args) + _nbytes(kwargs) + _nbytes(out)
            self.memory_bytes[phase] = self.memory_bytes.get(phase, 0) + n
        return out

    def _shaped(self, phase: str, func: Any, args: tuple, kwargs: dict, flops: int) -> None:
        key = shape_key(func, args, kwargs)
        if key is not None:
            self.shaped_flops[(phase, key)] = self.shaped_flops.get((phase, key), 0) + flops


@dataclass(frozen=True)
class StepCounts:
    """What a fake step did (:class:`StepCounter`'s counts), as a value: FLOPs by (phase, kind),
    memory-bound bytes by phase, collective bytes by (phase, op name, group size).

    Counts combine linearly (:meth:`combine`): a stack of identical blocks costs its depth times
    one block, which is how the planner reaches 80 layers from fake steps of two and three.

    Example:
        >>> import torch
        >>> import transformers
        >>> import slapo
        >>> def fake_step(layers):  # the counts of a tiny llama of `layers` layers
        ...     config = transformers.LlamaConfig(
        ...         hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        ...         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        ...     )
        ...     ids = torch.randint(0, 256, (2, 16))
        ...     with StepCounter() as counter:
        ...         _ = slapo.estimate_memory(
        ...             transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}
        ...         )
        ...     return StepCounts.of(counter)
        >>> at_2, at_3 = fake_step(2), fake_step(3)
        >>> eighty = StepCounts.combine((at_2, -77), (at_3, 78))   # at_2 + 78 x (at_3 - at_2)
        >>> key = ("forward", "matmul")
        >>> eighty.flops[key] == at_2.flops[key] + 78 * (at_3.flops[key] - at_2.flops[key])
        True
    """

    flops: dict[tuple[str, str], int] = field(default_factory=dict)
    memory_bytes: dict[str, int] = field(default_factory=dict)
    collectives: dict[tuple[str, str, int], int] = field(default_factory=dict)
    collective_calls: dict[tuple[str, str, int], int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)
    shaped_flops: dict[tuple[str, str], int] = field(default_factory=dict)
    selective_ops: dict[str, int] = field(default_factory=dict)
    collective_shapes: dict[tuple[str, str, int, str], int] = field(default_factory=dict)

    @classmethod
    def of(cls, counter: StepCounter) -> StepCounts:
        return cls(
            dict(counter.flops), dict(counter.memory_bytes), dict(counter.collectives),
            dict(counter.collective_calls), dict(counter.ops), dict(counter.shaped_flops),
            dict(counter.selective_ops), dict(counter.collective_shapes),
        )  # fmt: skip

    def shapes(self) -> list[str]:
        """The distinct shape keys of the matmuls and attention kernels (what
        :func:`slapo.plan.calibrate.calibrate_shapes` measures), sorted."""
        return sorted({key for _, key in self.shaped_flops})

    def collective_keys(self) -> list[str]:
        """The distinct collective calls (:func:`collective_key`; what
        :func:`slapo.plan.calibrate.calibrate_collectives` measures), sorted."""
        return sorted({key for *_, key in self.collective_shapes})

    @staticmethod
    def combine(*weighted: tuple[StepCounts, float]) -> StepCounts:
        """The sum of ``weight x counts`` (negative terms clamp at 0, per entry)."""

        def mix(name: str) -> dict[Any, int]:
            keys = {k for counts, _ in weighted for k in getattr(counts, name)}
            return {
                k: max(0, round(sum(w * getattr(c, name).get(k, 0) for c, w in weighted)))
                for k in keys
            }

        return StepCounts(
            mix("flops"), mix("memory_bytes"), mix("collectives"), mix("collective_calls"),
            mix("ops"), mix("shaped_flops"), mix("selective_ops"), mix("collective_shapes"),
        )  # fmt: skip


@dataclass(frozen=True)
class StepPrediction:
    """One rank's predicted training step (:func:`predict_step`).

    Attributes:
        seconds: the step.
        tokens_per_s_per_gpu: the layout's tokens per second over its GPUs.
        mfu: model FLOPs (:func:`slapo.throughput.model_flops_per_token`) per second over the
            device's bf16 (or the precision's) peak.
        memory: the rank's memory estimate; :attr:`memory_bytes` the figure compared with a
            run's ``torch.cuda.max_memory_reserved``.
        time_terms: seconds by term (compute by kind, exposed collectives, bubble), largest
            first; ``hidden`` terms say what overlapped.
        counts: the raw counts (FLOPs and bytes by phase and kind).
    """

    seconds: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory_bytes: int
    memory: MemoryEstimate
    time_terms: dict[str, float] = field(default_factory=dict)
    memory_terms: dict[str, int] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)

    def top_terms(self, n: int = 5) -> list[tuple[str, float]]:
        return sorted(self.time_terms.items(), key=lambda kv: -kv[1])[:n]

    def __str__(self) -> str:
        lines = [
            f"step {self.seconds:.3f} s, {self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
            f"MFU {self.mfu:.1%}, memory {format_bytes(self.memory_bytes)} reserved "
            f"(parts {format_bytes(self.memory.peak)}, live peak "
            f"{format_bytes(self.memory.live_peak)})",
            "  time: " + ", ".join(f"{k} {v:.3f}s" for k, v in self.top_terms()),
            "  memory: " + ", ".join(
                f"{k} {format_bytes(v)}"
                for k, v in sorted(self.memory_terms.items(), key=lambda kv: -kv[1])[:5]
            ),
        ]  # fmt: skip
        return "\n".join(lines)


def _tokens(batch: Any) -> int:
    """Tokens in a batch: its ``input_ids`` (or first tensor) elements."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    first = next(_tensors(batch), None)
    if first is None:
        raise PlanError("predict_step: the batch holds no tensor to count tokens in")
    return first.numel()


def _module(sch: Any) -> nn.Module:
    return sch if isinstance(sch, nn.Module) else sch.mod


def _units(model: nn.Module) -> int:
    """FSDP2 units: one per decoder layer (as torchtitan and slapo wrap them) plus the root."""
    config = getattr(model, "config", None)
    return (getattr(config, "num_hidden_layers", 0) or 0) + 1


def _compute_dtype(precision: str) -> str:
    """The peak a precision computes at: 16-bit at its own; float32 at TF32's (``allow_tf32``)."""
    return {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}.get(
        str(precision), "tf32"
    )


def _check_cluster(cluster: Any) -> None:
    if not isinstance(cluster, ClusterSpec):
        raise PlanError(
            f"predict_step: cluster must be a slapo.plan.ClusterSpec, got {type(cluster).__name__}"
            " (e.g. ClusterSpec(PRESETS['h100-sxm'], gpus_per_node=8, inter_node_gbps=50.0))"
        )


#: Bytes of host memory RoundPipe's CPU Adam step streams per parameter: the float32 master
#: weight and both moments read and written (24), the 16-bit gradient read and the 16-bit copy
#: for the devices written (4).
ROUNDPIPE_OPTIMIZER_BYTES = 28


def _roundpipe_seconds(
    compute: float, model: nn.Module, spec: LayoutSpec, cluster: ClusterSpec, dtype: str,
    terms: dict[str, float],
) -> tuple[float, int]:  # fmt: skip
    """RoundPipe's step on ``spec.devices`` devices of one node (its one process): the stages'
    compute round-robin over the devices; each stage's parameters uploaded for the forward and
    again for the backward and its gradients downloaded, over each device's host link, hidden
    behind the compute (uploads prefetched) but for what exceeds it; then the optimizer step on
    the host (synchronous, as ``slapo train`` runs it). Returns (seconds, devices)."""
    dev, devices = cluster.device, max(1, spec.devices)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    width = 2 if dtype in ("bf16", "fp16") else 4
    link = dev.host_link
    transfer = link.seconds(
        3 * n_params * width / devices, efficiency=dev.efficiency["collective"]
    )  # fmt: skip
    on_devices = compute / devices
    exposed = max(0.0, transfer - on_devices)
    optimizer = n_params * ROUNDPIPE_OPTIMIZER_BYTES / (cluster.host_gbps * 1e9)
    for key in list(terms):
        if "optimizer" in key:
            del terms[key]  # the device's optimizer terms: RoundPipe steps on the host
        else:
            terms[key] /= devices  # each device's share of the compute
    terms["roundpipe host link (exposed)"] = exposed
    terms["roundpipe host optimizer step"] = optimizer
    terms["roundpipe compute per device"] = on_devices
    return on_devices + exposed + optimizer, devices


def _measured_seconds(
    counts: StepCounts, cluster: ClusterSpec, ranks: int, generic: dict[tuple[str, str], int]
) -> dict[tuple[str, str], float]:
    """Seconds by (phase, kind) of the matmuls and attention kernels whose shape the device has
    a measured rate for (:attr:`DeviceSpec.op_tflops`; a CPU's at the rank's thread count,
    scaled by its :meth:`~ClusterSpec.thread_share`); their FLOPs leave ``generic``."""
    table = cluster.device.op_tflops
    if not table:
        return {}
    suffix = f" @{cluster.threads(ranks)}t" if cluster.shared_cores else ""
    scale = cluster.thread_share(ranks)
    seconds: dict[tuple[str, str], float] = {}
    for (phase, key), flops in counts.shaped_flops.items():
        rate = table.get(key + suffix)
        kind = key.split(" ", 1)[0]
        if rate is None or (phase, kind) not in generic:
            continue
        seconds[(phase, kind)] = seconds.get((phase, kind), 0.0) + flops / (rate * 1e12 * scale)
        generic[(phase, kind)] = max(0, generic[(phase, kind)] - flops)
    return seconds


def predict_step(
    sch: Any,
    batch: Any,
    cluster: ClusterSpec,
    *,
    target: str = "fsdp",
    dp: int = 1,
    pp: int = 1,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    num_microbatches: int = 1,
    pipeline_schedule: str = "1F1B",
    precision: str = "bf16",
    compile: bool = False,
    reduce_dtype: torch.dtype = torch.float32,
    seq_len: int | None = None,
    **estimate_kwargs: Any,
) -> StepPrediction:
    """Predict one training step of one rank of a ``dp x pp x cp x tp`` layout on ``cluster``.

    Args:
        sch, batch: as for :func:`slapo.memory.estimate_layout` (the schedule built for the
            layout's tp/cp/ep groups; one data-parallel rank's batch, all its microbatches).
        cluster: the devices and links.
        target, dp, pp, tp, cp, ep, num_microbatches, pipeline_schedule, precision: the layout
            (:class:`slapo.memory.LayoutSpec`).
        compile: the blocks run under ``torch.compile`` (module doc).
        precision: ``"bf16"``/``"fp16"`` count at that peak; ``"fp32"`` at the TF32 peak
            (float32 matmuls on the tensor cores, as ``allow_tf32`` runs them).
        reduce_dtype: the dtype FSDP2 reduce-scatters gradients in.
        seq_len: for MFU's attention term (default: the batch's last dimension x cp).
        **estimate_kwargs: ``optimizer``, ``device`` ... of :func:`slapo.estimate_memory`
            (``device`` defaults to ``"cuda"``).

    Returns:
        A :class:`StepPrediction`.

    Example:
        >>> import torch
        >>> import transformers
        >>> import slapo
        >>> config = transformers.LlamaConfig(  # a tiny llama, random weights
        ...     hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        ... )
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, 256, (2, 16))
        >>> sch = slapo.create_schedule(model)
        >>> from slapo.plan import PRESETS
        >>> c = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, inter_node_gbps=50.0)
        >>> pred = predict_step(sch, {"input_ids": ids, "labels": ids}, c, target="fsdp", dp=8)
        >>> pred.seconds > 0, 0 < pred.mfu < 1
        (True, True)
    """
    _check_cluster(cluster)
    spec = LayoutSpec(
        target, dp, pp, tp, 0, num_microbatches, pipeline_schedule, precision=precision, cp=cp,
        ep=ep,
    )  # fmt: skip
    estimate_kwargs.setdefault("device", "cuda")
    counter = StepCounter()
    with counter:
        base = layout_step(sch, batch, spec, **estimate_kwargs)
    est = apply_layout(base, sch, spec)
    seq = seq_len or next(_tensors(batch)).shape[-1] * cp
    return time_step(
        StepCounts.of(counter), est, _module(sch), _tokens(batch), seq, spec, cluster,
        compile=compile, reduce_dtype=reduce_dtype,
    )  # fmt: skip


def _compute_seconds(
    counts: StepCounts, spec: LayoutSpec, cluster: ClusterSpec, dtype: str,
    terms: dict[str, float], *, compile: bool, float8: bool,
) -> dict[str, float]:  # fmt: skip
    """Seconds by phase of one stage's compute for one microbatch (the fake step ran the whole
    model: a stage's share is 1/pp of it): FLOPs at their rates, memory-bound bytes at the
    memory bandwidth, each op's host overhead; each term added to ``terms``."""
    dev = cluster.device
    per_stage = 1.0 / spec.pp
    # ranks sharing one host's cores (a CPU, ClusterSpec.shared_cores) compute at a share of
    # the device's rates; 1.0 with a GPU per rank
    ranks = min(spec.dp * spec.pp * spec.tp * spec.cp, cluster.gpus_per_node)
    share = cluster.rank_share(ranks)
    compute: dict[str, float] = {}

    def add(phase: str, term: str, seconds: float) -> None:
        compute[phase] = compute.get(phase, 0.0) + seconds
        terms[term] = terms.get(term, 0.0) + seconds

    generic = dict(counts.flops)
    if not float8:  # a measured shape's rate, where the device has one (DeviceSpec.op_tflops)
        for (phase, kind), s in _measured_seconds(counts, cluster, ranks, generic).items():
            add(phase, f"{kind} ({phase})", s * per_stage)
    for (phase, kind), flops in generic.items():
        rate = dev.achievable_tflops(kind, "fp8" if float8 and kind == "matmul" else dtype)
        add(phase, f"{kind} ({phase})", flops / (rate * 1e12) * per_stage / share)
    shards = spec.dp * spec.cp if spec.target in ("fsdp", "deepspeed") else 1
    for phase, nbytes in counts.memory_bytes.items():
        scale = per_stage
        if phase == "optimizer":
            scale /= shards  # the optimizer steps this rank's shard only
        elif compile:
            scale *= COMPILE_MEMORY_TRAFFIC
        bandwidth = dev.hbm_gbps * 1e9 * dev.efficiency["memory"]
        add(phase, f"memory-bound ({phase})", nbytes * scale / bandwidth / share)
    if dev.op_overhead_us > 0:  # each op's dispatch, on the host that computes (a CPU)
        host = cluster.host_slowdown(ranks)  # a rank's one-thread host work, cores short
        for phase, ops in counts.ops.items():
            scale = per_stage * (COMPILE_MEMORY_TRAFFIC if compile and phase != "optimizer" else 1)
            add(phase, f"op overhead ({phase})", ops * scale * dev.op_overhead_us * 1e-6 * host)
    sac_us = dev.engine_overhead_us.get("sac_op", 0.0)
    if sac_us and not compile:  # compiled, the partitioner applies the policy: no Python mode
        host = cluster.host_slowdown(ranks)
        for phase, ops in counts.selective_ops.items():
            seconds = ops * per_stage * sac_us * 1e-6 * host
            add(phase, f"selective checkpoint dispatch ({phase})", seconds)
    return compute


def _step_collective_seconds(
    counts: StepCounts, spec: LayoutSpec, cluster: ClusterSpec, terms: dict[str, float]
) -> float:
    """Seconds of the collectives the fake step ran (tensor and context parallel), all exposed:
    one stage's share of the model's, per microbatch; each added to ``terms``."""
    eff = cluster.device.efficiency["collective"]
    per_stage = 1.0 / spec.pp
    microbatches = spec.num_microbatches if spec.pp > 1 else 1
    exposed = 0.0
    measured = cluster.device.collective_us
    for (phase, name, size), sent in counts.collectives.items():
        span = size if size == spec.tp else size * spec.tp  # a cp group strides over tp ranks
        link = cluster.link_for(span)
        calls = counts.collective_calls.get((phase, name, size), 1) * per_stage
        # calls of a measured size at their time (DeviceSpec.collective_us), the rest on the link
        s = 0.0
        for (ph, nm, sz, key), n in counts.collective_shapes.items():
            if (ph, nm, sz) == (phase, name, size) and key in measured:
                s += n * per_stage * measured[key] * 1e-6
                sent -= n * _ring_sent(name, size, int(key.split()[1][:-1]))
                calls -= n * per_stage
        sent, calls = max(0, sent), max(0.0, calls)
        s += link.seconds(sent * per_stage, efficiency=eff, messages=calls * (size - 1))
        exposed += s * microbatches
        key = f"{name} x{size} ({phase})"
        terms[key] = terms.get(key, 0.0) + s * microbatches
    return exposed


def _data_parallel_seconds(
    model: nn.Module, spec: LayoutSpec, cluster: ClusterSpec, dtype: str,
    reduce_dtype: torch.dtype, fwd: float, bwd: float, terms: dict[str, float],
    hidden: dict[str, float],
) -> float:  # fmt: skip
    """Exposed seconds of the data-parallel engine's collectives (they do not run in the fake
    step: they follow from the parameters), overlapped with the forward (``fwd``) and backward
    (``bwd``) as the engine overlaps them; the compute beside them slowed by the device's
    ``overlap_slowdown``. What ran hidden goes to ``hidden``."""
    dp_group = spec.dp * spec.cp
    if dp_group <= 1 or spec.target not in ("fsdp", "ddp", "deepspeed"):
        return 0.0
    dev = cluster.device
    local = {id(p): p for p in model.parameters()}.values()
    n_params = sum(p.numel() for p in local) / spec.pp
    link = cluster.link_for(dp_group * spec.pp * spec.tp)
    if spec.target == "fsdp":
        exposed, overlapped = _fsdp_seconds(
            model, spec, cluster, link, n_params, dtype, reduce_dtype, fwd, bwd, terms, hidden
        )  # fmt: skip
    else:
        ring = (dp_group - 1) / dp_group
        eff = dev.efficiency["collective"]
        ar = link.seconds(2 * n_params * 4 * ring, efficiency=eff, messages=2 * (dp_group - 1))
        last = ar * min(1.0, DDP_BUCKET_BYTES / max(1.0, n_params * 4))
        exposed = last + max(0.0, ar - last - bwd)
        terms["ddp all-reduce (exposed)"] = exposed
        hidden["ddp all-reduce"] = ar
        overlapped = min(ar - last, bwd)
    if overlapped > 0 and dev.overlap_slowdown > 0:
        terms["compute slowed by overlapped collectives"] = overlapped * dev.overlap_slowdown
        exposed += terms["compute slowed by overlapped collectives"]
    return exposed


def _fsdp_seconds(
    model: nn.Module, spec: LayoutSpec, cluster: ClusterSpec, link: Any, n_params: float,
    dtype: str, reduce_dtype: torch.dtype, fwd: float, bwd: float, terms: dict[str, float],
    hidden: dict[str, float],
) -> tuple[float, float]:  # fmt: skip
    """(exposed, overlapped) seconds of FSDP2's all-gathers (forward and again in backward) and
    reduce-scatters: it prefetches the next unit's gather during the current one's compute, so
    only the first unit's gather, the last unit's reduce-scatter and what exceeds the compute
    of its phase are exposed."""
    dev = cluster.device
    dp_group = spec.dp * spec.cp
    ring = (dp_group - 1) / dp_group
    eff = dev.efficiency["collective"]
    units = max(1, _units(model) // spec.pp)
    gather_bytes = n_params * (2 if dtype in ("bf16", "fp16") else 4) * ring
    grad_bytes = n_params * torch.empty((), dtype=reduce_dtype).element_size() * ring
    # a calibrated unit (DeviceSpec.engine_overhead_us) holds its collectives' latency
    unit_us = dev.engine_overhead_us.get("fsdp_unit", 0.0)
    messages = 0 if unit_us else units * (dp_group - 1)
    ag = link.seconds(gather_bytes, efficiency=eff, messages=messages)
    rs = link.seconds(grad_bytes, efficiency=eff, messages=messages)
    first, last = ag / units, rs / units  # they run alone
    gather = first + max(0.0, (ag - first) - fwd)
    scatter = last + max(0.0, (ag - first) + (rs - last) - bwd)
    terms["fsdp all-gather (exposed)"] = gather
    terms["fsdp reduce-scatter (exposed)"] = scatter
    exposed = gather + scatter
    if unit_us:  # FSDP2's own host work per unit: serial with the compute (a CPU)
        ranks = min(spec.dp * spec.pp * spec.tp * spec.cp, cluster.gpus_per_node)
        terms["fsdp hooks, copies, latency"] = units * unit_us * 1e-6 * cluster.host_slowdown(ranks)
        exposed += terms["fsdp hooks, copies, latency"]
    hidden["fsdp all-gather x2"] = 2 * ag
    hidden["fsdp reduce-scatter"] = rs
    return exposed, min(ag - first, fwd) + min((ag - first) + (rs - last), bwd)


def time_step(
    counts: StepCounts,
    est: MemoryEstimate,
    model: nn.Module,
    tokens: int,
    seq_len: int,
    spec: LayoutSpec,
    cluster: ClusterSpec,
    *,
    compile: bool = False,
    reduce_dtype: torch.dtype = torch.float32,
    float8: bool = False,
) -> StepPrediction:
    """Seconds, tokens/s, MFU and memory of one rank's step from its counts (module doc).

    Args:
        counts: the fake step's work (one microbatch of the whole model when ``spec.pp`` > 1).
        est: the rank's memory estimate (:func:`slapo.memory.apply_layout` of the fake step).
        model: the whole model (its parameters, layers and config, on any device).
        tokens: the tokens one data-parallel rank trains on in a step (a cp rank's share).
        seq_len: the full sequence length (for MFU's attention FLOPs).
        spec: the layout (:class:`slapo.memory.LayoutSpec`).
        cluster, compile, reduce_dtype: as for :func:`predict_step`.
        float8: the matmuls run at the device's fp8 peak (float8 linear layers, torchao-style:
            the attention and every other op keep the 16-bit rates); MFU stays over the bf16
            peak, as torchtitan reports it.

    Example:
        >>> import torch
        >>> import transformers
        >>> import slapo
        >>> config = transformers.LlamaConfig(  # a tiny llama, random weights
        ...     hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        ... )
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, 256, (2, 16))
        >>> sch, spec = slapo.create_schedule(model), LayoutSpec("fsdp", dp=8)
        >>> with StepCounter() as counter:  # the fake step predict_step runs
        ...     base = layout_step(sch, {"input_ids": ids, "labels": ids}, spec, device="cuda")
        >>> counts, est = StepCounts.of(counter), apply_layout(base, sch, spec)
        >>> from slapo.plan import PRESETS
        >>> cluster = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8)
        >>> pred = time_step(counts, est, model, 32, 16, spec, cluster)  # 2 x 16 tokens
        >>> pred.seconds > 0
        True
    """
    _check_cluster(cluster)
    args = (counts, est, model, tokens, seq_len, spec)
    options: dict[str, Any] = {"compile": compile, "reduce_dtype": reduce_dtype, "float8": float8}
    ranks = min(spec.dp * spec.pp * spec.tp * spec.cp, cluster.gpus_per_node)
    turns = cluster.oversubscription(ranks) if cluster.time_shared else 1.0
    if turns <= 1.0:
        return _time_rank(*args, cluster, **options)
    # more threads than cores: each rank's path as if it had its cores alone, and the step at
    # least all the node's ranks' work over the cores (they take turns: one rank's idle time,
    # its pipeline bubble, is another's turn)
    alone = _time_rank(*args, dataclasses.replace(cluster, time_shared=False), **options)
    busy = alone.seconds - alone.time_terms.get("pipeline bubble", 0.0)
    shared = busy * turns
    if shared <= alone.seconds:
        return alone
    scale = alone.seconds / shared
    terms = {**alone.time_terms, f"{ranks} ranks taking turns on the cores": shared - alone.seconds}
    return dataclasses.replace(
        alone, seconds=shared, tokens_per_s_per_gpu=alone.tokens_per_s_per_gpu * scale,
        mfu=alone.mfu * scale, time_terms=terms,
    )  # fmt: skip


def _time_rank(
    counts: StepCounts,
    est: MemoryEstimate,
    model: nn.Module,
    tokens: int,
    seq_len: int,
    spec: LayoutSpec,
    cluster: ClusterSpec,
    *,
    compile: bool,
    reduce_dtype: torch.dtype,
    float8: bool,
) -> StepPrediction:
    """:func:`time_step` of one rank on ``cluster`` as it is (its cores shared as
    :meth:`ClusterSpec.rank_share` says)."""
    _check_cluster(cluster)
    dev = cluster.device
    dtype = _compute_dtype(spec.precision)
    if dtype == "tf32" and "tf32" not in dev.peak_tflops:  # a CPU: float32 at its fp32 rate
        dtype = "fp32"
    pp, m = spec.pp, spec.num_microbatches
    terms: dict[str, float] = {}
    compute = _compute_seconds(counts, spec, cluster, dtype, terms, compile=compile, float8=float8)
    # a pipeline runs m + pp - 1 microbatch slots of one stage (its bubble: pp - 1 of them)
    slots = m + pp - 1 if pp > 1 else 1
    fwd, bwd = compute.get("forward", 0.0) * slots, compute.get("backward", 0.0) * slots
    opt = compute.get("optimizer", 0.0)
    if pp > 1:
        for key in list(terms):
            if "optimizer" not in key:
                terms[key] *= m
        terms["pipeline bubble"] = (fwd + bwd) * (pp - 1) / slots
    exposed = _step_collective_seconds(counts, spec, cluster, terms)
    hidden: dict[str, float] = {}
    exposed += _data_parallel_seconds(
        model, spec, cluster, dtype, reduce_dtype, fwd, bwd, terms, hidden
    )  # fmt: skip
    if pp > 1:  # one boundary activation each way per microbatch (the batch's tokens x hidden)
        width = getattr(getattr(model, "config", None), "hidden_size", 0) or 0
        act = tokens / m * width * (2 if dtype in ("bf16", "fp16") else 4)
        link = cluster.link_for(pp * spec.cp * spec.tp)
        # a calibrated slot (DeviceSpec.engine_overhead_us) holds the sends' latency
        slot_us = dev.engine_overhead_us.get("pipeline_microbatch", 0.0)
        send = link.seconds(
            act, efficiency=dev.efficiency["collective"], messages=0 if slot_us else 1
        )
        terms["pipeline sends"] = 2 * slots * send
        exposed += terms["pipeline sends"]
        if slot_us:  # the runtime's own host work per slot: serial with the compute (a CPU)
            ranks = min(spec.dp * pp * spec.tp * spec.cp, cluster.gpus_per_node)
            terms["pipeline actions, sends' latency"] = (
                slots * slot_us * 1e-6 * cluster.host_slowdown(ranks)
            )
            exposed += terms["pipeline actions, sends' latency"]

    seconds = fwd + bwd + opt + exposed
    world = spec.dp * pp * spec.tp * spec.cp
    if spec.target == "roundpipe":
        seconds, world = _roundpipe_seconds(fwd + bwd, model, spec, cluster, dtype, terms)
    tokens_per_gpu = tokens * spec.dp * spec.cp / world / seconds
    # the whole model's FLOPs (a tensor-parallel rank's module holds shards: its config does not)
    flops_per_token = model_flops_per_token(getattr(model, "config", None) or model, seq_len)
    mfu = tokens_per_gpu * flops_per_token / (dev.peak_tflops[dtype] * 1e12)

    reserved = est.reserved
    if spec.target == "roundpipe":  # the host holds the model; a device its streamed stages
        reserved = reserved_bytes(est.device_resident or 0, 0)
    memory_terms = {
        "params": est.params, "grads": est.grads, "optimizer_state": est.optimizer_state,
        "activations": est.activations, "engine": est.engine,
    }  # fmt: skip
    if compile:  # the compiler saves fewer activations for backward
        cut = int(est.activations * (1 - COMPILE_ACTIVATIONS))
        memory_terms["activations"] -= cut
        reserved -= cut
    counts_dict = {
        "flops": dict(counts.flops), "memory_bytes": dict(counts.memory_bytes),
        "collectives": dict(counts.collectives), "hidden_collective_seconds": hidden,
        "shapes": counts.shapes(), "ops": dict(counts.ops),
        "selective_ops": dict(counts.selective_ops),
        "collective_keys": counts.collective_keys(),
    }  # fmt: skip
    return StepPrediction(
        seconds=seconds, tokens_per_s_per_gpu=tokens_per_gpu, mfu=mfu, memory_bytes=reserved,
        memory=est, time_terms=terms, memory_terms=memory_terms, counts=counts_dict,
    )  # fmt: skip

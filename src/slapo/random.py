"""Random-number state for reproducible, parallel training.

Tensor-parallel ranks hold different slices of a layer, so dropout inside the parallel region must
draw *different* numbers on each rank, while dropout outside it must draw the *same* numbers. The
tracker keeps named generator states; ``fork()`` swaps one of them into the default generator for
the duration of a block. Activation checkpointing restores these states on recompute so a
recomputed dropout mask equals the original one.

The tracker is device-generic: it drives the CUDA generator when CUDA is available and the CPU one
otherwise, so the same code runs in CPU tests.
"""

from __future__ import annotations

import contextlib
import functools
import random as _pyrandom
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as _torch_ckpt

try:
    import numpy as np
except ImportError:  # numpy is optional: without it there is no numpy generator to seed
    np = None

from .exceptions import SlapoError

__all__ = [
    "RNGStatesTracker",
    "get_cuda_rng_tracker",
    "set_random_seed",
    "is_random_seed_set",
    "checkpoint",
    "checkpoint_policy",
    "recompute_dropout",
    "CHECKPOINT_POLICIES",
    "MODEL_PARALLEL_RNG",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offset between the data-parallel seed and the tensor-parallel seeds (any constant works; it only
# has to keep the two streams apart).
_TP_SEED_OFFSET = 2718


def _device_types() -> tuple[str, ...]:
    # On a CUDA machine CPU tensors still draw from the CPU generator: a forked region must
    # fork both, or a CPU dropout in it would draw the same mask on every tensor-parallel rank.
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _get_states(device_types: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.cuda.get_rng_state() if kind == "cuda" else torch.get_rng_state()
        for kind in device_types
    )


def _set_states(device_types: tuple[str, ...], states: tuple[torch.Tensor, ...]) -> None:
    for kind, state in zip(device_types, states, strict=True):
        if kind == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)


def _seed(device_types: tuple[str, ...], seed: int) -> None:
    for kind in device_types:
        if kind == "cuda":
            torch.cuda.manual_seed(seed)  # the current device's generator, as it is saved
        else:
            torch.default_generator.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states that can be swapped into the default generators.

    A state covers the CPU generator and, on a CUDA machine, the current CUDA device's
    generator too (``device_type="cpu"`` tracks the CPU one alone).

    Example:
        >>> tracker = RNGStatesTracker()
        >>> tracker.add("tp", seed=1234)
        >>> with tracker.fork("tp"):
        ...     x = torch.rand(2)
    """

    def __init__(self, device_type: str | None = None) -> None:
        self.device_types = ("cpu",) if device_type == "cpu" else _device_types()
        self.states: dict[str, tuple[torch.Tensor, ...]] = {}
        self.seeds: set[int] = set()

    @property
    def device_type(self) -> str:
        """The accelerator whose generator is tracked beside the CPU's (``"cpu"`` if none)."""
        return self.device_types[-1]

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict[str, tuple[torch.Tensor, ...]]:
        return {name: tuple(s.clone() for s in state) for name, state in self.states.items()}

    def set_states(self, states: dict[str, tuple[torch.Tensor, ...]]) -> None:
        self.states = {name: tuple(s.clone() for s in state) for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create the state ``name`` from ``seed`` without disturbing the default generators."""
        if seed in self.seeds:
            raise SlapoError(f"RNG seed {seed} is already used by another tracked state")
        if name in self.states:
            raise SlapoError(f"RNG state '{name}' already exists; call reset() first")
        self.seeds.add(seed)
        saved = _get_states(self.device_types)
        try:
            _seed(self.device_types, seed)
            self.states[name] = _get_states(self.device_types)
        finally:
            _set_states(self.device_types, saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the tracked state ``name`` as the default generators' state."""
        if name not in self.states:
            raise SlapoError(
                f"RNG state '{name}' is not set: call slapo.set_random_seed(seed, tp_rank=...) "
                "before running a module scheduled with fork_rng()"
            )
        saved = _get_states(self.device_types)
        _set_states(self.device_types, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_states(self.device_types)
            _set_states(self.device_types, saved)


_TRACKER = RNGStatesTracker()
_SEED_SET = False


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide RNG tracker (named for compatibility; it works on CPU too).

    Example:
        >>> tracker = get_cuda_rng_tracker()
        >>> isinstance(tracker, RNGStatesTracker)
        True
    """
    return _TRACKER


def is_random_seed_set() -> bool:
    """Whether :func:`set_random_seed` has been called in this process."""
    return _SEED_SET


def set_random_seed(
    seed: int = 2013,
    dp_rank: int | None = None,
    pp_rank: int | None = None,
    tp_rank: int | None = None,
    always_enable_tp_seed: bool = False,
) -> int:
    """Seed Python, NumPy (when present) and torch for this rank; returns the seed used.

    The default generator gets ``seed + 100 * pp_rank + 10 * dp_rank``: pipeline stages and data
    replicas draw different numbers, tensor-parallel peers the same ones. With ``tp_rank`` set, the
    tracker's model-parallel state gets ``that + 2718 + tp_rank`` for ``fork()`` blocks (dropout
    inside a tensor-parallel region). ``always_enable_tp_seed`` also seeds the default generator
    with the tensor-parallel seed, for sequence parallelism where every dropout sees a different
    slice of the sequence.

    Example:
        >>> set_random_seed(42, tp_rank=0)
        42
    """
    global _SEED_SET
    seed = int(seed) + 100 * (pp_rank or 0) + 10 * (dp_rank or 0)
    _pyrandom.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    _TRACKER.reset()
    if tp_rank is not None:
        tp_seed = seed + _TP_SEED_OFFSET + tp_rank
        _TRACKER.add(MODEL_PARALLEL_RNG, tp_seed)
        if always_enable_tp_seed:
            torch.manual_seed(tp_seed)
    _SEED_SET = True
    return seed


def _tracker_context_fn() -> tuple[contextlib.AbstractContextManager, Any]:
    """Checkpoint contexts that give the recompute the tracker states the forward had."""
    forward_states = _TRACKER.get_states()

    @contextlib.contextmanager
    def recompute_ctx() -> Iterator[None]:
        current = _TRACKER.get_states()
        _TRACKER.set_states(forward_states)
        try:
            yield
        finally:
            _TRACKER.set_states(current)

    return contextlib.nullcontext(), recompute_ctx()


def _reentrant_with_tracker(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run by torch's reentrant checkpoint with the tracker states of the forward.

    The reentrant implementation has no ``context_fn``; its first call is the forward and any
    later call the recompute in backward, which gets the states the forward started from.
    """
    forward_states = _TRACKER.get_states()
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*args)
        current = _TRACKER.get_states()
        _TRACKER.set_states(forward_states)
        try:
            return function(*args)
        finally:
            _TRACKER.set_states(current)

    return run


# ----- selective checkpointing ----------------------------------------------------------------
def _ops(*names: str) -> frozenset[Any]:
    """The default overloads of the named aten ops this torch has (a missing one is skipped)."""
    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            found.append(packet.default)
    return frozenset(found)


#: The matrix products of linear layers: what a selective checkpoint is mostly there to avoid
#: recomputing. Batched products (``bmm``: attention scores and their product with the values,
#: where attention is not one fused kernel) are left out: their outputs are sequence x sequence
#: per head, large for their cost, and recomputed with the softmax beside them.
MATMUL_OPS = _ops("mm", "addmm", "_addmm_activation")
#: Fused attention kernels (CPU and CUDA): an expensive recompute for a small output.
ATTENTION_OPS = _ops(
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)

#: Dropout as one op (compiled code; CUDA): its output and mask are kept, as a random draw costs
#: more to repeat than its mask to keep (on CPU, ``bernoulli_`` runs on one thread). Eager CPU
#: dropout is in-place ops (``bernoulli_``, ``div_``) that a selective checkpoint cannot keep:
#: recomputed there, under the restored RNG state (the same mask).
RANDOM_OPS = _ops("native_dropout")


def _save_listed(saved: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep the outputs of the listed ops; recompute the others."""
    cp = _torch_ckpt.CheckpointPolicy
    return cp.MUST_SAVE if op in saved else cp.PREFER_RECOMPUTE


def _save_narrow_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """``save_matmuls``, except for the products that widen their input (``x @ W`` with more
    output than input features: an MLP's up and gate projections), which are recomputed."""
    cp = _torch_ckpt.CheckpointPolicy
    if op in ATTENTION_OPS or op in RANDOM_OPS:
        return cp.MUST_SAVE
    if op in MATMUL_OPS:
        x, w = (args[0], args[1]) if op == torch.ops.aten.mm.default else (args[1], args[2])
        return cp.PREFER_RECOMPUTE if w.shape[-1] > x.shape[-1] else cp.MUST_SAVE
    return cp.PREFER_RECOMPUTE


#: The named policies of selective checkpointing, each a policy function: which op outputs are
#: kept in forward. Every other op of the checkpointed region (norms, activations, residual adds,
#: reshapes) is recomputed in backward. From most kept (fastest) to least kept (smallest):
#:
#: * ``save_matmuls``: linear-layer products, attention kernels and dropout;
#: * ``save_narrow_matmuls``: the same without the products that widen their input (an MLP's
#:   up/gate projections, the largest outputs of a block), recomputed;
#: * ``save_attention``: attention kernels and dropout; every linear layer is recomputed.
CHECKPOINT_POLICIES: dict[str, Callable[..., Any]] = {
    "save_matmuls": functools.partial(_save_listed, MATMUL_OPS | ATTENTION_OPS | RANDOM_OPS),
    "save_narrow_matmuls": _save_narrow_matmuls,
    "save_attention": functools.partial(_save_listed, ATTENTION_OPS | RANDOM_OPS),
}


def _dropout_recomputed(
    policy: Callable[..., Any], ctx: Any, op: Any, *args: Any, **kw: Any
) -> Any:
    if op in RANDOM_OPS:
        return _torch_ckpt.CheckpointPolicy.PREFER_RECOMPUTE
    return policy(ctx, op, *args, **kw)


def recompute_dropout(policy: Policy) -> Callable[..., Any]:
    """``policy`` (a name, a list of ops or a function) with dropout recomputed, not kept.

    For blocks where inductor mis-compiles a kept dropout: with torch 2.13 on CPU, a compiled
    block that keeps dropout and also returns an embedding-derived tensor (T5's position bias)
    gets a wrongly indexed embedding backward (wrong gradients, writes out of bounds).

    Example:
        >>> keep = recompute_dropout("save_matmuls")
        >>> keep(None, torch.ops.aten.native_dropout.default).name
        'PREFER_RECOMPUTE'
    """
    return functools.partial(_dropout_recomputed, checkpoint_policy(policy))


Policy = str | Iterable[Any] | Callable[..., Any]


def checkpoint_policy(policy: Policy) -> Callable[..., Any]:
    """The policy function of a selective checkpoint, for ``policy=`` of :func:`checkpoint`.

    ``policy`` is a name in :data:`CHECKPOINT_POLICIES` (``"save_matmuls"`` keeps the outputs of
    linear layers, attention kernels and dropout; ``"save_narrow_matmuls"`` recomputes the
    widening linear layers too; ``"save_attention"`` keeps attention kernels and dropout only),
    a list of aten ops whose outputs to keep (``torch.ops.aten.mm``, every overload, or
    ``torch.ops.aten.mm.default``), or a function ``policy(ctx, op, *args, **kwargs)`` returning a
    ``torch.utils.checkpoint.CheckpointPolicy`` (or a bool: True keeps the output), as for
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

    Example:
        >>> keep = checkpoint_policy("save_matmuls")
        >>> keep(None, torch.ops.aten.mm.default) == _torch_ckpt.CheckpointPolicy.MUST_SAVE
        True
    """
    if isinstance(policy, str):
        if policy not in CHECKPOINT_POLICIES:
            raise SlapoError(
                f"unknown checkpoint policy {policy!r}; the named policies are "
                f"{', '.join(sorted(CHECKPOINT_POLICIES))}, or pass a list of aten ops to save "
                "(e.g. [torch.ops.aten.mm]) or a policy function"
            )
        return CHECKPOINT_POLICIES[policy]
    single_op = isinstance(policy, torch._ops.OpOverload | torch._ops.OpOverloadPacket)
    if callable(policy) and not single_op:
        return policy
    if single_op or isinstance(policy, Iterable):
        ops = [policy] if single_op else list(policy)
        resolved = set()
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):
                resolved.update(getattr(op, name) for name in op.overloads())
            elif isinstance(op, torch._ops.OpOverload):
                resolved.add(op)
            else:
                raise SlapoError(
                    f"checkpoint policy: {op!r} is not an aten op; list ops such as "
                    "torch.ops.aten.mm (all overloads) or torch.ops.aten.mm.default"
                )
        if not resolved:
            raise SlapoError("checkpoint policy: the list of ops to save is empty")
        return functools.partial(_save_listed, frozenset(resolved))
    raise SlapoError(
        f"checkpoint policy must be a name ({', '.join(sorted(CHECKPOINT_POLICIES))}), a list of "
        f"aten ops or a function, got {type(policy).__name__}"
    )


def _outer_pack_hook() -> Callable[[torch.Tensor], Any] | None:
    """The pack function of the saved-tensor hooks active here, if any (None: none, or this torch
    does not say)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(True) if top is not None else None
    return hooks[0] if hooks else None


def _shown_to(pack: Callable[[torch.Tensor], Any] | None, policy: Callable[..., Any]) -> Any:
    """``policy``, which also hands each output it keeps in forward to ``pack``.

    A selective checkpoint keeps those outputs in its own cache, where saved-tensor hooks do not
    see them; accounting built on the hooks (``slapo.train.PeakMemory``) would miss their bytes.
    """
    if pack is None:
        return policy
    cp = _torch_ckpt.CheckpointPolicy

    def counted(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        decision = policy(ctx, op, *args, **kwargs)
        keep = decision in (cp.MUST_SAVE, cp.PREFER_SAVE) or decision is True
        output = getattr(ctx, "op_output", None)
        if keep and not ctx.is_recompute and output is not None:
            for t in torch.utils._pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor):
                    pack(t.detach())
        return decision

    return counted


def _selective_context_fn(policy: Callable[..., Any]) -> Callable[[], tuple[Any, Any]]:
    """Checkpoint contexts of a selective checkpoint that also restore the tracker states."""
    pack = _outer_pack_hook()

    def context_fn() -> tuple[Any, Any]:
        forward_ctx, recompute_ctx = _torch_ckpt.create_selective_checkpoint_contexts(
            _shown_to(pack, policy)
        )
        _, tracker_ctx = _tracker_context_fn()
        # The tracker's states are swapped in before the cache's dispatch mode starts (and back
        # after it ends): its clones must not count among the recomputed ops.
        return forward_ctx, _entered_together(tracker_ctx, recompute_ctx)

    return context_fn


@contextlib.contextmanager
def _entered_together(*contexts: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        yield


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = True,
    policy: Policy | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoint a model or part of it, restoring the tracker's RNG states on recompute.

    Like ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=..., **kwargs)``: the
    activations inside ``function`` are recomputed in backward instead of kept. torch restores
    the default generator's state for the recompute; this also restores the states of the tracker
    used by ``fork_rng`` (:func:`get_cuda_rng_tracker`), so a dropout inside a forked block draws
    the same mask twice.

    ``use_reentrant=True`` (the default, as in Slapo's reference API) uses torch's reentrant
    implementation, which takes positional arguments only. Where no positional tensor requires
    a gradient it would leave the parameters inside ``function`` without gradients, so that case
    runs the non-reentrant implementation instead (same results). ``use_reentrant=False`` also
    passes ``**kwargs`` to ``function``.

    ``policy`` (non-reentrant only) makes the checkpoint selective: the outputs of the ops it
    names are kept in forward and the rest is recomputed; see :func:`checkpoint_policy`. The kept
    outputs are also handed to the pack hook of any ``saved_tensors_hooks`` active around the call
    (its result is dropped), so that memory accounting built on those hooks counts them. Inside
    ``torch.compile`` the compiler's partitioner applies the policy (no tracker states there:
    compiled code draws its random numbers from the default generator).

    Example:
        >>> layer = torch.nn.Linear(4, 4)
        >>> y = checkpoint(layer, torch.randn(2, 4, requires_grad=True))
        >>> y.sum().backward()
        >>> z = checkpoint(layer, torch.randn(2, 4), use_reentrant=False)
        >>> z = checkpoint(layer, torch.randn(2, 4), use_reentrant=False, policy="save_matmuls")
    """
    if policy is not None and use_reentrant:
        raise SlapoError(
            "slapo.checkpoint: a selective checkpoint (policy=) needs use_reentrant=False"
        )
    policy_fn = checkpoint_policy(policy) if policy is not None else None
    if not use_reentrant and torch.compiler.is_compiling():
        # Dynamo turns the call into a higher-order op and accepts only torch's own contexts.
        if policy_fn is None:
            return _torch_ckpt.checkpoint(function, *args, use_reentrant=False, **kwargs)
        context_fn = functools.partial(_torch_ckpt.create_selective_checkpoint_contexts, policy_fn)
        return _torch_ckpt.checkpoint(
            function, *args, use_reentrant=False, context_fn=context_fn, **kwargs
        )
    if use_reentrant:
        if kwargs:
            raise SlapoError(
                f"slapo.checkpoint: reentrant checkpointing cannot pass keyword arguments "
                f"{sorted(kwargs)} to the function; pass use_reentrant=False"
            )
        needs_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if needs_grad:
            return _torch_ckpt.checkpoint(
                _reentrant_with_tracker(function), *args, use_reentrant=True
            )
    context_fn = _tracker_context_fn if policy_fn is None else _selective_context_fn(policy_fn)
    return _torch_ckpt.checkpoint(
        function, *args, use_reentrant=False, context_fn=context_fn, **kwargs
    )

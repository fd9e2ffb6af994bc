"""``compile``: run a whole submodule (e.g. a transformer block) as ``torch.compile``d code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..exceptions import PrimitiveError
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import forward_wraps, label, wrap_forward
from .compile_rng import RNG_MODES, CompileError, inductor_backend

__all__ = ["CompileError", "CompilePrimitive", "COMPILE_MODES"]

#: The ``mode`` values of ``torch.compile``.
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# Compiled modules applied in this process. Each compiled block is one more cache entry of the
# same code object (blocks differ in their class, which the guards check), so torch's default
# limit of 8 entries would make the ninth block fall back to eager: the limit follows this count.
_applied = 0


def _compile_failures() -> tuple[type[BaseException], ...]:
    """The exception types by which dynamo and inductor report a failed compilation."""
    import torch._dynamo.exc as dynamo_exc  # deferred: only a compiled call needs them

    kinds: list[type[BaseException]] = [
        dynamo_exc.BackendCompilerFailed,
        dynamo_exc.Unsupported,
        dynamo_exc.InternalTorchDynamoError,
    ]
    try:
        from torch._inductor.exc import InductorError

        kinds.append(InductorError)
    except ImportError:  # older torch: its failures arrive as BackendCompilerFailed
        pass
    return tuple(kinds)


def _compiled(where: str, settings: dict[str, Any], grad_only: bool) -> Callable[..., Any]:
    """The forward wrapper: the wrapped forward, compiled once for every copy of the module.

    The function compiled is the class's forward with ``self`` as an argument, not a bound method,
    so a ``deepcopy`` of the module runs its own parameters through the same compiled code.
    """
    compiled: Any = None

    def run(forward: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if (grad_only and not torch.is_grad_enabled()) or torch.compiler.is_compiling():
            # eval / generate with grad_only; or inside an outer compiled region, which inlines it
            return forward(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(forward.__func__, **settings)
        try:
            return compiled(forward.__self__, *args, **kwargs)
        except _compile_failures() as exc:
            raise CompileError(
                f'compile on "{where}": torch.compile could not compile the module '
                f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}). Compile a "
                "smaller submodule, drop fullgraph=True (graph breaks then run eagerly), try "
                "backend='aot_eager' to tell a dynamo problem from an inductor one, or remove "
                "the compile primitive"
            ) from exc

    return run


def _check_backend(where: str, backend: Any) -> None:
    if callable(backend):
        return
    known = torch._dynamo.list_backends(exclude_tags=())
    if not isinstance(backend, str) or backend not in known:
        raise PrimitiveError(
            f'compile on "{where}": unknown backend {backend!r}; torch.compile backends here: '
            f"{', '.join(sorted(known))} (or a backend function)"
        )
    if backend == "inductor" and not torch.cuda.is_available():
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as exc:  # noqa: BLE001  (re-raised with advice)
            raise PrimitiveError(
                f'compile on "{where}": inductor compiles CPU code with a C++ compiler and none '
                f"works here ({exc}); install g++ (or clang++), or use backend='aot_eager'"
            ) from exc


def _raise_limits() -> None:
    """Let every compiled block keep its own cache entry (see :data:`_applied`)."""
    global _applied
    _applied += 1
    config = torch._dynamo.config
    for name, floor in (("recompile_limit", 8), ("accumulated_recompile_limit", 256)):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), floor + 2 * _applied))


@register_primitive()
class CompilePrimitive(Primitive):
    """Compile the module's forward with ``torch.compile`` (inductor by default).

    The module keeps its parameters, their names and its hooks (which run eagerly around the
    compiled forward; hooks of its submodules are compiled with it). Compilation happens at the
    first call and again for a new input shape or mode; a failure then raises
    :class:`CompileError` naming the module. Apply ``checkpoint`` (with or without ``policy``)
    and ``shard`` before ``compile``: the compiler then plans the recompute itself (a selective
    policy costs nothing at run time) and sees the sharded shapes.

    With inductor, ``rng`` says where random ops (dropout) draw from
    (:mod:`slapo.primitives.compile_rng`): ``"eager"`` (the default) from torch's generator op by
    op, the same masks as the uncompiled module; ``"bulk"``: each dropout mask from 64-bit draws
    of torch's generator, four elements a draw (:func:`slapo.op.dropout.bulk_dropout`: the same
    law, p rounded to 1/65536, about 4x cheaper on CPU, where dropout's ``bernoulli_`` can take a
    third of a small model's step); ``"inductor"``: inductor's own generated numbers (slower than
    both on CPU, and an inductor CPU bug of torch 2.13 corrupts the heap when they are recomputed
    in a checkpointed block that also returns an embedding-derived tensor).

    Args:
        backend: a ``torch.compile`` backend name (``"inductor"``, ``"aot_eager"``, ...) or
            function.
        mode: ``torch.compile``'s ``mode`` (e.g. ``"max-autotune-no-cudagraphs"``; inductor).
        options: inductor options (over those of ``mode``), e.g. ``{"max_autotune": True}``.
        dynamic: ``torch.compile``'s ``dynamic`` (None: specialize, then generalize on change).
        fullgraph: raise at the first call if the forward cannot be captured as one graph.
        grad_only: run eagerly while no gradient is recorded (eval, ``generate``), so that
            decoding token by token does not compile a graph per sequence length.
        rng: ``"eager"``, ``"bulk"`` or ``"inductor"`` (inductor only; see above).

    Example:
        >>> import slapo, transformers
        >>> config = transformers.LlamaConfig(
        ...     num_hidden_layers=1, hidden_size=16, intermediate_size=32,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
        ... )
        >>> sch = slapo.create_schedule(transformers.LlamaForCausalLM(config))
        >>> sch["model.layers.0"].checkpoint(policy="save_matmuls")
        >>> sch["model.layers.0"].compile()
        >>> # compiling the whole model takes inductor a minute on a CPU: not run here
        >>> sch.compile(rng="bulk")  # or the whole model, with cheap dropout masks  # doctest: +SKIP
    """

    name = "compile"

    @staticmethod
    def apply(
        sch: Schedule,
        backend: str | Callable[..., Any] = "inductor",
        *,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
        dynamic: bool | None = None,
        fullgraph: bool = False,
        grad_only: bool = False,
        rng: str = "eager",
    ) -> None:
        import torch._dynamo  # deferred: importing dynamo takes a second; only compile needs it

        where = label(sch.path)
        if not torch._dynamo.is_dynamo_supported():
            raise PrimitiveError(
                f'compile on "{where}": torch.compile is not supported with this Python and torch '
                "build; remove the compile primitive"
            )
        if isinstance(sch.mod, torch.jit.ScriptModule):
            raise PrimitiveError(
                f'compile on "{where}": a TorchScript module cannot be compiled by torch.compile; '
                "compile the module before scripting it, or keep it scripted"
            )
        if not isinstance(getattr(type(sch.mod), "forward", None), Callable):
            raise PrimitiveError(f'compile on "{where}": the module has no forward to compile')
        if mode not in COMPILE_MODES:
            raise PrimitiveError(
                f'compile on "{where}": mode must be one of {COMPILE_MODES}, got {mode!r}'
            )
        if options is not None and not isinstance(options, dict):
            raise PrimitiveError(
                f'compile on "{where}": options must be a dict of inductor settings, got '
                f"{type(options).__name__}"
            )
        if rng not in RNG_MODES:
            raise PrimitiveError(
                f'compile on "{where}": rng must be one of {RNG_MODES}, got {rng!r}'
            )
        _check_backend(where, backend)
        sch.require_unapplied("compile")
        settings: dict[str, Any] = {"backend": backend, "dynamic": dynamic, "fullgraph": fullgraph}
        if backend == "inductor":
            # mode is a preset of options: folded in, so that the defaults and options combine
            from torch._inductor import list_mode_options

            preset = list_mode_options(mode) if mode is not None else {}
            settings["backend"], settings["options"] = inductor_backend(
                rng, {**preset, **(options or {})}
            )
        elif mode is not None or options or rng != "eager":
            raise PrimitiveError(
                f'compile on "{where}": mode=, options= and rng= are inductor settings; backend '
                f"{backend!r} takes none of them"
            )
        _raise_limits()
        wrap_forward(sch.mod, "compile", _compiled(where, settings, grad_only))


def compiled(mod: nn.Module) -> bool:
    """Whether ``compile`` was applied to ``mod``.

    Example:
        >>> compiled(nn.Linear(2, 2))
        False
    """
    return "compile" in forward_wraps(mod)

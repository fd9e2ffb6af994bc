"""Kernels of the preset layers: SDPA attention and ``torch.compile`` of each block.

**Attention.** A preset runs attention through ``torch.nn.functional.scaled_dot_product_attention``
(transformers' ``"sdpa"``): on CUDA it dispatches to the FlashAttention / memory-efficient kernels,
which never build the ``seq x seq`` score matrix, and on CPU to a fused flash kernel. A model whose
config asks for ``"eager"`` (or nothing) is switched to ``"sdpa"`` by :func:`prefer_sdpa` when
its class supports it (results change within float tolerance only); any other choice
(``"flash_attention_2"``, ``"flex_attention"``, a kernel) is kept. Set
``roundpipe.models.PREFER_SDPA = False`` to keep eager attention.

**torch.compile.** Each dense block's decoder layer runs through one shared ``torch.compile``
of :func:`call_decoder_layer` (all blocks have the same structure and the device copies of a layer
swap their parameters, so a few graphs serve every layer: no-grad forward, recompute with grad,
sliding / full attention). ``roundpipe.models.DISABLE_TORCH_COMPILE`` decides: ``True`` never
compiles, ``False`` always does, ``None`` (default) compiles on CUDA and, on CPU virtual devices
(where inductor's C++ compiles are slow), only with ``ROUNDPIPE_TORCH_COMPILE=1``. Compiled
layers use eager random ops (inductor's ``fallback_random``), so dropout seeded by RoundPipe replays
exactly in recompute; mixture-of-experts blocks (routing replay has Python side effects) and calls
under a ``TorchDispatchMode`` (activation accounting) run eagerly.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "COMPILE_ENV",
    "call_decoder_layer",
    "call_gpt2_block",
    "compile_enabled",
    "prefer_sdpa",
]

COMPILE_ENV = "ROUNDPIPE_TORCH_COMPILE"
_COMPILE_OPTIONS = {"fallback_random": True}


def prefer_sdpa(model: nn.Module) -> str | None:
    """Switch ``model`` to SDPA attention when its config leaves attention unset or eager and
    its class supports SDPA (unless ``roundpipe.models.PREFER_SDPA`` is False); returns the
    attention implementation the model now uses.

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, attn_implementation="eager")
        >>> prefer_sdpa(transformers.LlamaForCausalLM(cfg))
        'sdpa'
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    current = getattr(config, "_attn_implementation", None)
    models = sys.modules[__package__]
    if (
        getattr(models, "PREFER_SDPA", True)
        and current in (None, "eager")
        and getattr(model, "_supports_sdpa", False)
        and hasattr(model, "set_attn_implementation")
    ):
        model.set_attn_implementation("sdpa")
        current = config._attn_implementation
    return current


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    return value in ("1", "true", "yes", "on")


def compile_enabled(on_cuda: bool) -> bool:
    """Whether preset blocks run through ``torch.compile`` for inputs on CUDA (``on_cuda``) or
    on a CPU virtual device (see the module docstring).

    Example:
        >>> import roundpipe.models as models
        >>> models.DISABLE_TORCH_COMPILE = True
        >>> compile_enabled(on_cuda=True)
        False
        >>> models.DISABLE_TORCH_COMPILE = None
    """
    flag = getattr(sys.modules[__package__], "DISABLE_TORCH_COMPILE", None)
    if flag is not None:
        return not flag
    env = _env_flag(COMPILE_ENV)
    if env is not None:
        return env
    return on_cuda


def _dispatch_mode_active() -> bool:
    # deferred: a private helper, only needed when compiling
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def _maybe_compiled(fn: Callable[..., Any], compiled: Callable[[], Any], x: torch.Tensor) -> Any:
    """``compiled()`` when compiling applies to a call on ``x``, else ``fn``."""
    if not compile_enabled(x.is_cuda) or torch.compiler.is_compiling() or _dispatch_mode_active():
        return fn
    return compiled()


def _decoder_layer(
    layer: nn.Module,
    hidden: torch.Tensor,
    mask: Any,
    position_ids: torch.Tensor,
    position_embeddings: Any,
) -> Any:
    return layer(
        hidden,
        attention_mask=mask,
        position_ids=position_ids,
        position_embeddings=position_embeddings,
    )


@functools.cache
def _compiled_decoder_layer() -> Any:
    return torch.compile(_decoder_layer, options=_COMPILE_OPTIONS)


def call_decoder_layer(
    layer: nn.Module,
    hidden: torch.Tensor,
    mask: Any,
    position_ids: torch.Tensor,
    position_embeddings: Any,
    allow_compile: bool = True,
) -> Any:
    """Call a Llama-style Hugging Face decoder layer, compiled when :func:`compile_enabled`
    (and ``allow_compile``).

    Example:
        >>> import transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2)
        >>> m = transformers.LlamaForCausalLM(cfg).model
        >>> h, pos = torch.randn(1, 4, 16), torch.arange(4)[None]
        >>> call_decoder_layer(m.layers[0], h, None, pos, m.rotary_emb(h, pos)).shape
        torch.Size([1, 4, 16])
    """
    fn = _decoder_layer
    if allow_compile:
        fn = _maybe_compiled(_decoder_layer, _compiled_decoder_layer, hidden)
    return fn(layer, hidden, mask, position_ids, position_embeddings)


def _gpt2_block(block: nn.Module, hidden: torch.Tensor, mask: Any) -> Any:
    return block(hidden, attention_mask=mask)


@functools.cache
def _compiled_gpt2_block() -> Any:
    return torch.compile(_gpt2_block, options=_COMPILE_OPTIONS)


def call_gpt2_block(block: nn.Module, hidden: torch.Tensor, mask: Any) -> Any:
    """Call a GPT-2 block, compiled when :func:`compile_enabled`.

    Example:
        >>> import transformers
        >>> cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
        >>> block = transformers.GPT2LMHeadModel(cfg).transformer.h[0]
        >>> out = call_gpt2_block(block, torch.randn(1, 4, 16), None)
        >>> (out[0] if isinstance(out, tuple) else out).shape
        torch.Size([1, 4, 16])
    """
    fn = _maybe_compiled(_gpt2_block, _compiled_gpt2_block, hidden)
    return fn(block, hidden, mask)

"""The models of the main job: families, sizes, their ready schedules and the causal LM loss.

Example:
    >>> from slapo.train import TrainConfig
    >>> from slapo.train.presets import build_model
    >>> model = build_model(TrainConfig(model="gpt2", preset="tiny"))
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ..data import VOCAB_SIZE
from ..exceptions import ConfigError, SlapoError
from ..model_schedule import apply_schedule
from ..schedule import Schedule
from .families import CAUSAL, MODELS, PRESETS

__all__ = ["CAUSAL", "MODELS", "PRESETS", "build_model", "causal_lm_loss", "default_schedule"]


class ModelChoice(Protocol):
    """What :func:`build_model` reads of a config (``TrainConfig`` has it)."""

    model: str
    preset: str
    seq_len: int


def build_model(cfg: ModelChoice, weights: bool = True) -> nn.Module:
    """A ``cfg.model`` model of size ``cfg.preset`` from a config, with random weights; or, for
    a transformers model type or a model directory, the model
    :mod:`~slapo.train.model_source` builds (a directory's weights loaded unless not
    ``weights``: then it stays on the meta device).

    Example:
        >>> from slapo.train import TrainConfig
        >>> model = build_model(TrainConfig(model="gpt2", preset="tiny"))
    """
    import transformers as tf  # deferred: transformers takes seconds to import

    if cfg.model not in MODELS:
        from .model_source import config_for, load_model, resolve_model  # transformers' loaders

        source = resolve_model(cfg.model)
        config = config_for(source, cfg.preset, cfg.seq_len, getattr(cfg, "tokenizer", None))
        return load_model(source, config, weights=weights)
    if cfg.preset not in PRESETS:
        raise SlapoError(f"preset must be one of {sorted(PRESETS)}, got {cfg.preset!r}")
    hidden, layers, heads, kv_heads, inter = PRESETS[cfg.preset]
    # use_cache=False: training reads no key/value cache (checkpointed layers run without one).
    positions = max(cfg.seq_len, 128)
    if cfg.model == "llama":
        config = tf.LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=positions, tie_word_embeddings=True, use_cache=False,
        )  # fmt: skip
        return tf.LlamaForCausalLM(config)
    if cfg.model == "gpt2":
        config = tf.GPT2Config(
            vocab_size=VOCAB_SIZE, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=inter,
            n_positions=positions, bos_token_id=0, eos_token_id=0, use_cache=False,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(config)
    if cfg.model == "opt":
        config = tf.OPTConfig(
            vocab_size=VOCAB_SIZE, hidden_size=hidden, ffn_dim=inter, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=positions,
            word_embed_proj_dim=hidden, bos_token_id=0, eos_token_id=0, pad_token_id=1,
            use_cache=False,
        )  # fmt: skip
        return tf.OPTForCausalLM(config)
    if cfg.model == "bert":
        config = tf.BertConfig(
            vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, intermediate_size=inter, max_position_embeddings=positions,
            use_cache=False,
        )  # fmt: skip
        return tf.BertForMaskedLM(config)
    config = tf.T5Config(  # half the layers in the encoder, half in the decoder
        vocab_size=VOCAB_SIZE, d_model=hidden, d_kv=hidden // heads, d_ff=inter,
        num_layers=max(layers // 2, 1), num_heads=heads, decoder_start_token_id=0, pad_token_id=0,
        use_cache=False,
    )  # fmt: skip
    return tf.T5ForConditionalGeneration(config)


def default_schedule(model: nn.Module, ckpt_ratio: float = 0.5, **knobs: Any) -> Schedule:
    """The model's ready schedule (``slapo.model_schedule``), checkpointing ``ckpt_ratio``.

    Example:
        >>> from slapo.train import TrainConfig
        >>> sch = default_schedule(build_model(TrainConfig()), 0.5)
    """
    try:
        return apply_schedule(model, ckpt_ratio=ckpt_ratio, **knobs)
    except SlapoError as exc:
        if "ckpt_ratio" in str(exc):
            raise ConfigError(str(exc)) from exc
        raise


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's loss from its logits and unshifted ``labels``, as the model computes it:
    token ``t`` predicts label ``t + 1``; the last position has no label (-100, ignored).

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2)
        >>> model = transformers.GPT2LMHeadModel(config).eval()  # no dropout: same logits twice
        >>> ids = torch.randint(0, 50257, (2, 8))
        >>> loss = causal_lm_loss(model(ids).logits, ids)
        >>> torch.testing.assert_close(loss, model(ids, labels=ids).loss)
    """
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten())

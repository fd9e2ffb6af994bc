"""Small real transformers models with random weights, and the equivalence oracle for tests."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
import transformers
from torch import nn

VOCAB = 96
SEQ = 12
BATCH = 2


def _training(overrides: dict) -> dict:
    """Config keywords of a training model: no key/value cache unless a test asks for one.

    Training needs no cache, and a cache changes the numerics: its first update copies k/v into
    contiguous tensors, and attention kernels sum in another order on strided than on contiguous
    k/v (ulps apart). Checkpointed blocks run without the cache (as with transformers' own
    gradient checkpointing), so a reference that builds one would differ from them by ulps for a
    reason that has nothing to do with checkpointing.
    """
    return {"use_cache": False, **overrides}


def gpt2(dropout: float = 0.1, **config: object) -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        **_training(config),
    )
    return transformers.GPT2LMHeadModel(cfg)


def llama(dropout: float = 0.1, layers: int = 2, **config: object) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=dropout,
        **_training(config),
    )
    return transformers.LlamaForCausalLM(cfg)


def bert(dropout: float = 0.1, **config: object) -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        **_training(config),
    )
    return transformers.BertForMaskedLM(cfg)


def opt(dropout: float = 0.1, **config: object) -> nn.Module:
    cfg = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=32,
        word_embed_proj_dim=32,
        dropout=dropout,
        attention_dropout=dropout,
        **_training(config),
    )
    return transformers.OPTForCausalLM(cfg)


def t5(dropout: float = 0.1, **config: object) -> nn.Module:
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=dropout,
        decoder_start_token_id=0,
        pad_token_id=0,
        **_training(config),
    )
    return transformers.T5ForConditionalGeneration(cfg)


FAMILIES: dict[str, Callable[..., nn.Module]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "opt": opt,
    "t5": t5,
}

# Where each family keeps its list of blocks.
LAYERS = {
    "gpt2": "transformer.h",
    "llama": "model.layers",
    "bert": "bert.encoder.layer",
    "opt": "model.decoder.layers",
    "t5": "encoder.block",
}


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def make(family: str, seed: int = 0, **kwargs) -> nn.Module:
    """A training-mode model of ``family`` seeded with ``seed``; ``kwargs``: the family's options
    (``dropout``, ``layers``) and config overrides (``use_cache=True``, ``attn_implementation``)."""
    torch.manual_seed(seed)
    model = FAMILIES[family](**kwargs)
    model.train()
    return model


def run(
    model: nn.Module, data: dict[str, torch.Tensor], seed: int = 1, context=None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and every parameter's gradient of one training step, with a fixed RNG seed, forward
    and backward inside ``context`` (a context manager) if one is given."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with context if context is not None else contextlib.nullcontext():
        loss = model(**data).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same_step(
    ref: nn.Module, test: nn.Module, data=None, exact: bool = False, ref_context=None
) -> None:
    """The equivalence oracle: same loss and the same gradient for every parameter.

    By default within torch.testing's float32 tolerance: any change of kernel, operand layout or
    summation order moves results by ulps, and which ones do depends on the CPU (vector width,
    BLAS blocking) and the thread count. ``exact=True`` asserts bit-identity; a caller passing it
    says at the call why no CPU and no thread count can change the order of the float operations
    (e.g. a non-reentrant checkpoint reruns the same kernels on the same operands and keeps the
    autograd graph, so every gradient is summed in the same order). ``ref_context``: a context
    manager the reference step runs in (e.g. ``slapo.op.dropout.bulk_dropout_masks()``).
    """
    data = data if data is not None else batch()
    loss_ref, grads_ref = run(ref, data, context=ref_context)
    loss_test, grads_test = run(test, data)
    assert set(grads_ref) == set(grads_test), set(grads_ref) ^ set(grads_test)
    kw = {"rtol": 0, "atol": 0} if exact else {}  # {}: float32 defaults (rtol 1.3e-6, atol 1e-5)
    torch.testing.assert_close(loss_test, loss_ref, **kw)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(
            grads_test[name], grad, **kw, msg=lambda m, n=name: f"gradient of {n}: {m}"
        )


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)

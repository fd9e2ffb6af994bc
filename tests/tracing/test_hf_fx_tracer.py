"""Slapo's Hugging Face tracer on transformers 5 blocks: ``trace(tracer="huggingface")`` needs no
example inputs and gives a torch.fx graph (no torch.export), on which ``find`` sees the
``call_module`` nodes. Each traced block computes what the original does (output and every
gradient) at shapes other than the synthesized ones, and a call the graph was not traced for is
traced again (unedited) or refused with a typed error (edited), never silently different."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import fx, nn

import slapo
from slapo.tracing import TraceSignatureError

transformers = pytest.importorskip("transformers")

HIDDEN, HEADS = 32, 4


def _bert() -> tuple[nn.Module, object]:
    config = transformers.BertConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=64,
        num_hidden_layers=1, vocab_size=64, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertModel(config), config


def _gpt_neo() -> tuple[nn.Module, object]:
    config = transformers.GPTNeoConfig(
        hidden_size=HIDDEN, num_heads=HEADS, num_layers=2, vocab_size=64,
        attention_types=[[["global", "local"], 1]], max_position_embeddings=64, window_size=4,
        embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
    )  # fmt: skip
    return transformers.GPTNeoModel(config), config


def _gpt2() -> tuple[nn.Module, object]:
    config = transformers.GPT2Config(
        n_embd=HIDDEN, n_head=HEADS, n_layer=1, vocab_size=64, n_positions=64,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2Model(config), config


def _llama() -> tuple[nn.Module, object]:
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2,
        intermediate_size=64, num_hidden_layers=1, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaModel(config), config


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[index,return-value]


def _check_same(traced: nn.Module, ref: nn.Module, *args: object, **kwargs: object) -> float:
    """Output and every gradient equal (float32 tolerance); returns the largest difference."""
    for m in (traced, ref):
        m.zero_grad(set_to_none=True)
    out, expected = _first(traced(*args, **kwargs)), _first(ref(*args, **kwargs))
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    grads = dict(ref.named_parameters())
    diff = (out - expected).abs().max().item()
    for name, p in traced.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)
        diff = max(diff, (p.grad - grads[name].grad).abs().max().item())
    return diff


def _called(gm: fx.GraphModule, op: str) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == op]


@pytest.fixture
def fx_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    slapo.logger.get_logger()  # configured first, so the capture's level and handler stay
    caplog.set_level(logging.INFO, logger="Slapo")
    return caplog


def _traced_with_fx(log: pytest.LogCaptureFixture) -> None:
    lines = [r.getMessage() for r in log.records if r.getMessage().startswith("traced ")]
    assert lines and all("torch.fx (Hugging Face-aware)" in m for m in lines), lines


def test_bert_attention_finds_qkv_and_matches(fx_log: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model, config = _bert()
    ref = copy.deepcopy(model.encoder.layer[0].attention)
    sch = slapo.create_schedule(model)
    gm = sch["encoder.layer.0.attention"].trace(tracer="huggingface", flatten=True, config=config)
    _traced_with_fx(fx_log)
    assert isinstance(gm, fx.GraphModule)
    subgraphs = sch["encoder.layer.0.attention"].find(r"self.(query|key|value)")
    assert sorted(m[0][1].target for m in subgraphs) == [
        "self.key",
        "self.query",
        "self.value",
    ]
    assert all(m[0][1].op == "call_module" for m in subgraphs)
    # The attention kernel stays one call of transformers' function, with the original module.
    kernels = [t for t in _called(gm, "call_function") if "attention_forward" in str(t)]
    assert len(kernels) == 1
    for batch, seq in ((2, 8), (3, 5)):  # other shapes than the synthesized 2 x 8 too
        _check_same(gm, ref, torch.randn(batch, seq, HIDDEN))


@pytest.mark.parametrize(
    ("make", "path"),
    [
        (_bert, "encoder.layer.0"),
        (_gpt_neo, "h.1"),  # its local attention slices a causal-mask buffer by the lengths
        (_gpt2, "h.0"),
        (_llama, "layers.0"),
    ],
)
@pytest.mark.parametrize("flatten", [True, False])
def test_blocks_trace_with_fx_and_match(
    make, path: str, flatten: bool, fx_log: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model, config = make()
    ref = copy.deepcopy(model.get_submodule(path))
    sch = slapo.create_schedule(model)
    gm = sch[path].trace(tracer="huggingface", flatten=flatten, config=config)
    _traced_with_fx(fx_log)
    kinds = {type(sch[path].mod.get_submodule(t)).__name__ for t in _modules(gm)}
    assert kinds & {"Linear", "LayerNorm", "LlamaRMSNorm"}, kinds  # call_module nodes to find
    for batch, seq in ((2, 8), (3, 5)):
        kwargs = {}
        if make is _llama:  # the model hands the rotary embeddings to each layer
            rotary = model.rotary_emb
            ids = torch.arange(seq).expand(batch, seq)
            kwargs["position_embeddings"] = rotary(torch.randn(batch, seq, HIDDEN), ids)
        diff = _check_same(gm, ref, torch.randn(batch, seq, HIDDEN), **kwargs)
        assert diff < 1e-4


def _modules(gm: fx.GraphModule) -> list[str]:
    return [
        f"{prefix}.{n.target}".lstrip(".")
        for prefix, sub in gm.named_modules()
        if isinstance(sub, fx.GraphModule)
        for n in sub.graph.nodes
        if n.op == "call_module"
    ]


def test_whole_model_trains_like_the_original_after_tracing_a_block() -> None:
    """GPT-2 with the first block traced by the fx tracer: loss and gradients of the whole
    model as before, in train mode (no dropout) and in eval mode."""
    torch.manual_seed(0)
    model, config = _gpt2()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    sch["h.0"].trace(tracer="huggingface", flatten=True, config=config)
    built, _ = slapo.build(sch, init_weights=False)
    ids = torch.randint(0, 64, (3, 11))
    for mode in ("train", "eval"):
        getattr(built, mode)()
        getattr(ref, mode)()
        built.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out, expected = built(ids).last_hidden_state, ref(ids).last_hidden_state
        torch.testing.assert_close(out, expected)
        out.square().mean().backward()
        expected.square().mean().backward()
        grads = dict(ref.named_parameters())
        for name, p in built.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


def test_concrete_args_and_leaf_modules() -> None:
    """Slapo's spelling: ``concrete_args`` fixes arguments (``**kwargs`` entries too), user
    leaves stay ``call_module`` nodes of the original submodule."""
    torch.manual_seed(0)
    model, config = _gpt2()
    ref = copy.deepcopy(model.h[0])
    sch = slapo.create_schedule(model)
    gm = sch["h.0"].trace(
        tracer="huggingface",
        flatten=True,
        concrete_args={"use_cache": False, "output_attentions": False},
        leaf_modules=["GPT2MLP"],
        config=config,
    )
    assert "mlp" in _called(gm, "call_module")
    assert type(gm.get_submodule("mlp")) is type(ref.mlp)
    _check_same(gm, ref, torch.randn(2, 6, HIDDEN), use_cache=False, output_attentions=False)


def test_a_call_unlike_the_traced_one_is_traced_again_or_refused() -> None:
    """The graph is specialised to the traced call (no attention mask, sizes of each branch):
    an unedited graph traces itself again for another call; an edited one refuses it by name."""
    torch.manual_seed(0)
    model, config = _bert()
    layer = model.encoder.layer[0]
    ref = copy.deepcopy(layer)
    sch = slapo.create_schedule(model)
    gm = sch["encoder.layer.0"].trace(tracer="huggingface", flatten=True, config=config)
    x = torch.randn(2, 6, HIDDEN)
    mask = torch.zeros(2, 1, 6, 6)
    mask[0, ..., -2:] = torch.finfo(torch.float32).min
    _check_same(gm, ref, x, mask)  # a mask: traced again (torch.export, on this call)
    assert len(gm._slapo_retrace.exported) == 1
    dense = sch["encoder.layer.0.output.dense"]
    dense.replace(copy.deepcopy(dense.mod))  # a primitive applied after tracing
    _check_same(gm, ref, x)  # as traced: still fine after the edit
    with pytest.raises(TraceSignatureError, match=r'"encoder.layer.0".*"attention_mask" = None'):
        gm(x, mask)

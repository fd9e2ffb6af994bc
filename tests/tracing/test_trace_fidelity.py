"""A traced block stays true to the module it replaces: every parameter, buffer and attribute
kept, loss and gradients equal at other shapes than the captured ones, and where the graph is
specialized (a loop over the sequence, an optional argument given or not) or cannot hold what
the module does (state kept on the module, a custom backward) a typed error naming the module."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import fx, nn

import slapo
from slapo.tracing import TraceEquivalenceError, TraceSignatureError

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seq))


def _step(model: nn.Module, **inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(ref: nn.Module, model: nn.Module, **inputs: torch.Tensor) -> None:
    loss_ref, grads_ref = _step(ref, **inputs)
    loss, grads = _step(model, **inputs)
    torch.testing.assert_close(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, n=name: f"{n}: {m}")


def _bart() -> nn.Module:
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BartForCausalLM(config).train()


def _rwkv() -> nn.Module:
    config = transformers.RwkvConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
        intermediate_size=64, context_length=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.RwkvForCausalLM(config).train()


def test_decoder_layer_keeps_unused_cross_attention_and_attributes():
    model = _bart()
    layer = model.model.decoder.layers[0]
    layer.block_type = "decoder"  # an attribute a parent could read
    state = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
    sch = slapo.create_schedule(model)
    gm = sch["model.decoder.layers.0"].trace()  # on a decoder-only call: no cross-attention
    assert isinstance(gm, fx.GraphModule)
    kept = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
    assert kept.keys() == state.keys() and all(kept[n] is p for n, p in state.items())
    assert gm.encoder_attn is layer.encoder_attn  # unused: the original submodule, put back
    assert gm.block_type == "decoder" and gm.embed_dim == layer.embed_dim


def test_dynamic_lengths_keep_loss_and_every_gradient():
    model = _bart()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    sch["model.decoder.layers.0"].trace()  # captured on dummy_inputs: batch 2, length 5
    built, _ = slapo.build(sch, init_weights=False)
    for batch, seq in ((2, 16), (3, 9)):
        ids = _ids(batch, seq)
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0  # padding, as in dummy_inputs: the layer gets a mask as captured
        _assert_same_step(ref, built, input_ids=ids, attention_mask=mask, labels=ids)


def _edit(sch: slapo.Schedule, path: str) -> None:
    """A primitive applied after tracing: a submodule of the traced graph replaced."""
    sch[path].replace(copy.deepcopy(sch[path].mod))


def test_an_argument_given_or_left_out_unlike_the_capture_is_traced_again():
    model = _bart()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    gm = sch["model.decoder.layers.0"].trace()  # dummy_inputs have an attention mask
    ids = _ids(2, 8)
    _assert_same_step(ref, model, input_ids=ids, labels=ids)  # no mask: traced again
    hidden = torch.randn(2, 8, 32)
    mask = torch.zeros(2, 1, 8, 8)
    layer = ref.model.decoder.layers[0]
    for encoder, kwargs in ((None, {}), (torch.randn(2, 3, 32), {}), (None, {"use_cache": True})):
        torch.testing.assert_close(
            gm(hidden, mask, encoder, **kwargs), layer(hidden, mask, encoder, **kwargs)
        )
    assert len(gm._slapo_retrace.exported) == 4  # no mask; use_cache left out; cross; cache


def test_an_edited_graph_called_unlike_the_capture_is_a_typed_error():
    model = _bart()
    sch = slapo.create_schedule(model)
    gm = sch["model.decoder.layers.0"].trace()
    _edit(sch, "model.decoder.layers.0.fc1")
    ids = _ids(2, 8)
    with pytest.raises(
        TraceSignatureError, match=r'"model.decoder.layers.0".*"attention_mask".*edited after'
    ):
        model(input_ids=ids, labels=ids)  # no mask: the graph would apply the captured one
    hidden = torch.randn(2, 8, 32)
    mask = torch.zeros(2, 1, 8, 8)
    gm(hidden, mask, None, use_cache=False)  # as captured (a cache would be dropped too)
    with pytest.raises(TraceSignatureError, match=r'argument "encoder_hidden_states" = None'):
        gm(hidden, mask, None, use_cache=False, encoder_hidden_states=torch.randn(2, 3, 32))
    with pytest.raises(TraceSignatureError, match=r'"encoder_attention_mask" = None, but'):
        gm(hidden, mask, None, use_cache=False, encoder_attention_mask=torch.zeros(2, 1, 8, 3))
    with pytest.raises(TraceSignatureError, match=r'"use_cache" = False.*"use_cache" = True'):
        gm(hidden, mask, None, use_cache=True)


def test_a_mask_absent_at_capture_is_traced_again_when_given():
    model = _bart()
    ref = copy.deepcopy(model)
    ids = _ids(2, 10)
    sch = slapo.create_schedule(model, example_inputs={"input_ids": ids, "labels": ids})
    sch["model.decoder.layers.0"].trace()  # captured with no attention mask
    _assert_same_step(ref, model, input_ids=ids, labels=ids)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    _assert_same_step(ref, model, input_ids=ids, attention_mask=mask, labels=ids)


def test_a_graph_fixed_to_the_captured_length_is_traced_again_for_other_lengths():
    model = _rwkv()  # its CPU attention loops over the sequence: export unrolls the loop
    ref = copy.deepcopy(model)
    ids = _ids(2, 12)
    sch = slapo.create_schedule(model, example_inputs={"input_ids": ids, "labels": ids})
    gm = sch["rwkv.blocks.0"].trace()
    _assert_same_step(ref, model, input_ids=ids, labels=ids)
    other = _ids(3, 12)  # the batch stays free
    _assert_same_step(ref, model, input_ids=other, labels=other)
    for batch, seq in ((2, 7), (3, 9), (2, 7)):  # traced again for 7 and 9, then reused
        ids = _ids(batch, seq)
        _assert_same_step(ref, model, input_ids=ids, labels=ids)
    retrace = gm._slapo_retrace
    assert len(retrace.exported) == 2
    params = dict(gm.named_parameters())
    for graph, _ in retrace.exported:  # one set of parameters: the graph's own objects
        assert all(params[n] is p for n, p in graph.named_parameters())
    assert {id(p) for p in retrace.mod.parameters()} == {id(p) for p in params.values()}


def test_an_edited_graph_fixed_to_the_captured_length_refuses_another_one():
    model = _rwkv()
    ids = _ids(2, 12)
    sch = slapo.create_schedule(model, example_inputs={"input_ids": ids, "labels": ids})
    sch["rwkv.blocks.0"].trace()
    _edit(sch, "rwkv.blocks.0.feed_forward")
    short = _ids(2, 7)
    with pytest.raises(
        TraceSignatureError,
        match=r'"rwkv.blocks.0" \(RwkvBlock\).*size 12 in dim 1.*edited after tracing',
    ):
        model(input_ids=short, labels=short)


def test_a_graph_edited_in_place_is_not_traced_again():
    gm = slapo.create_schedule(_Unrolled()).trace(
        tracer="export", example_inputs=torch.randn(2, 3, 4)
    )
    assert gm(torch.randn(2, 5, 4)).shape == (2, 5, 4)  # unedited: traced again
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        neg = gm.graph.call_function(torch.neg, (out.args[0],))
    out.args = (neg,)
    gm.recompile()
    with pytest.raises(TraceSignatureError, match=r"edited after tracing"):
        gm(torch.randn(2, 6, 4))
    with pytest.raises(TraceSignatureError, match=r"edited after tracing"):
        gm(torch.randn(2, 5, 4))  # a graph traced again before the edit is not used either


class _Embeddings(nn.Module):
    """Like BERT's embeddings: optional arguments that default to buffers when None."""

    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(VOCAB, 8)
        self.positions = nn.Embedding(32, 8)
        self.register_buffer("position_ids", torch.arange(32).unsqueeze(0), persistent=False)

    def forward(self, input_ids=None, position_ids=None, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.words(input_ids)
        if position_ids is None:
            position_ids = self.position_ids[:, : inputs_embeds.shape[1]]
        return inputs_embeds + self.positions(position_ids)


def test_fx_graph_of_optional_arguments_is_traced_again_for_none():
    model = _Embeddings()
    sch = slapo.create_schedule(model)
    gm = sch.trace(tracer="fx")  # fx takes every optional argument to be given
    ids = _ids(2, 6)
    positions = torch.arange(6).expand(2, 6)
    torch.testing.assert_close(gm(ids, positions), model(ids, positions))
    torch.testing.assert_close(gm(ids), model(ids))  # traced again
    embeds = torch.randn(2, 6, 8)
    torch.testing.assert_close(gm(inputs_embeds=embeds), model(inputs_embeds=embeds))


class _ClippedSqrt(torch.autograd.Function):
    """A custom backward (clipped), unlike autograd's of the forward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sqrt()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / (2 * x.sqrt()).clamp(min=1.0)


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return _ClippedSqrt.apply(self.fc(x).square() + 0.01)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = _Gate()
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.gate(x))


def test_a_custom_backward_stays_a_call_of_the_original_module():
    torch.manual_seed(0)
    model = _Block()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    sch = slapo.create_schedule(model)
    gm = sch.trace(tracer="export", example_inputs=x)
    assert type(gm.gate) is _Gate  # kept whole: a graph has no custom backward
    gm(x).sum().backward()
    ref(x).sum().backward()
    for (name, p), q in zip(gm.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class _Stateful(nn.Module):
    """Keeps its last output on itself, as recurrent layers keep their state."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.state = None

    def forward(self, x):
        self.state = self.fc(x)
        return self.state * 2


def test_a_module_that_keeps_state_on_itself_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4), _Stateful())
    sch = slapo.create_schedule(model, example_inputs=torch.randn(2, 4))
    with pytest.raises(TraceEquivalenceError, match=r'"1" \(_Stateful\).*assigns state'):
        sch["1"].trace(tracer="export")
    assert model[1].state is None  # no fake tensor left behind
    sch.trace(tracer="export", example_inputs=torch.randn(2, 4))  # the parent: kept as a call
    assert type(sch.mod.get_submodule("1")) is _Stateful


class _Unrolled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale=None):
        steps = [self.fc(x[:, i]) for i in range(x.shape[1])]  # export unrolls the loop
        out = torch.stack(steps, 1)
        return out if scale is None else out * scale


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch pickling its specs
def test_the_guard_survives_deepcopy_and_pickling():
    gm = slapo.create_schedule(_Unrolled()).trace(
        tracer="export", example_inputs=torch.randn(2, 3, 4)
    )
    for copied in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):  # not traced again
        assert copied(torch.randn(5, 3, 4)).shape == (5, 3, 4)
        with pytest.raises(TraceSignatureError, match=r"size 3 in dim 1 of argument 0 \(\"x\"\)"):
            copied(torch.randn(2, 6, 4))
        with pytest.raises(TraceSignatureError, match=r'"scale" = None \(not given\)'):
            copied(torch.randn(2, 3, 4), scale=torch.ones(1))

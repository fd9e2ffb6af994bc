"""Every dynamic primitive keeps loss and gradients equal to the unscheduled model."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import slapo
from hf_models import LAYERS, assert_same_step, batch, make, twin
from slapo.primitives import checkpoint as checkpoint_primitive

FAMILIES = list(LAYERS)


def layer_paths(sch, family):
    layers = sch[LAYERS[family]]
    return [f"{LAYERS[family]}.{name}" for name in layers.child]


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_every_layer_is_bit_identical_with_dropout(family):
    ref = make(family)
    model = twin(ref)
    sch = slapo.create_schedule(model)
    for path in layer_paths(sch, family):
        sch[path].checkpoint()
    built, _ = slapo.build(sch, init_weights=False)
    assert built.state_dict().keys() == ref.state_dict().keys()
    # Bit-exact on any CPU and thread count: a non-reentrant checkpoint keeps the autograd graph
    # (each gradient is summed in the same order) and its recompute reruns the same kernels on
    # the same operands, under the restored RNG state (the same dropout masks).
    assert_same_step(ref, built, exact=True)


class _Messages(logging.Handler):
    """Collects what slapo's logger says (it does not propagate to the root logger)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_checkpointed_layers_run_without_the_kv_cache_like_transformers(family, monkeypatch):
    # transformers' defaults: use_cache=True. With eager attention the causal mask is added to the
    # scores, so a recompute that appends its keys to the cache a second time breaks backward.
    ref = make(family, use_cache=True, attn_implementation="eager")
    assert ref.config.use_cache and ref.config._attn_implementation == "eager"
    model = twin(ref)
    sch = slapo.create_schedule(model)
    paths = layer_paths(sch, family)
    for path in paths:
        sch[path].checkpoint()
    monkeypatch.setattr(checkpoint_primitive, "_warned", False)
    said = _Messages()
    slapo.get_logger().addHandler(said)
    try:
        # The reference layers attend to k/v copied into the cache (contiguous), the checkpointed
        # ones to strided views: other kernel paths, ulps apart on some CPUs, so not bit-exact.
        assert_same_step(ref, model)
        out = model(**batch())  # training: the layers wrote nothing, on first run or recompute
        out.loss.backward()
    finally:
        slapo.get_logger().removeHandler(said)
    assert out.past_key_values is None or out.past_key_values.get_seq_length() == 0
    assert len(said.messages) == 1, said.messages  # once, though every layer dropped the cache
    assert f'"{paths[0]}"' in said.messages[0] and "use_cache=False" in said.messages[0]
    # Under no_grad nothing is checkpointed: the cache is built and used, as without slapo.
    model.eval()
    ref.eval()
    data = batch()
    with torch.no_grad():
        out, want = model(**data), ref(**data)
    assert out.past_key_values.get_seq_length() == data["input_ids"].shape[1]
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=0)  # the very same calls
    lengths = []
    model.get_submodule(paths[0]).register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(
            (args[0] if args else kwargs["hidden_states"]).shape[1]
        ),
        with_kwargs=True,
    )
    prompt = data["input_ids"][:, :4]
    kw = {"max_new_tokens": 3, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    generated = model.generate(prompt, **kw)
    # Greedy decoding with the same calls as the unscheduled model: the same tokens, bit for bit.
    assert torch.equal(generated, ref.generate(prompt, **kw))
    assert lengths == [4, 1, 1]  # after the prompt, one new token per step: the cache was read


class _CacheSpy(nn.Module):
    """Records the cache arguments each call gets; reads its ``past_key_values`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[tuple] = []

    def forward(self, x, past_key_values=None, cache=None, use_cache=False):
        self.seen.append((past_key_values, cache, use_cache))
        return self.linear(x)


class _CacheReader(_CacheSpy):
    _can_checkpoint_with_cache = True  # transformers' flag for layers that only read the cache


@pytest.mark.parametrize("spy_cls", [_CacheSpy, _CacheReader])
def test_checkpoint_switches_off_only_what_transformers_switches_off(spy_cls):
    spy = spy_cls()
    slapo.create_schedule(spy).checkpoint()
    memo, kv = ["a user's own cache"], object()
    spy(torch.randn(2, 4, requires_grad=True), kv, memo, use_cache=True).sum().backward()
    # Every call (the forward and its recompute) saw the same arguments: use_cache off always;
    # a reader keeps its key/value cache; a "cache" that is no transformers cache is not ours.
    want = (kv if spy_cls is _CacheReader else None, memo, False)
    assert spy.seen == [want, want]


@pytest.mark.parametrize("family", FAMILIES)
def test_replace_with_an_equal_module_is_bit_identical(family):
    ref = make(family)
    model = twin(ref)
    sch = slapo.create_schedule(model)
    path = layer_paths(sch, family)[0]
    sch[path].replace(copy.deepcopy(sch[path].mod))
    assert sch[path].mod is not ref.get_submodule(path)
    # Bit-exact: the copy runs the same kernels on bit-equal weights, in the same graph.
    assert_same_step(ref, slapo.build(sch, init_weights=False)[0], exact=True)


def test_replace_changes_numerics_and_rebuilds_children():
    ref = make("gpt2", dropout=0.0)
    model = twin(ref)
    sch = slapo.create_schedule(model)
    mlp = sch["transformer.h.0.mlp"]
    mlp["act"].replace(nn.ReLU())
    assert isinstance(model.transformer.h[0].mlp.act, nn.ReLU)
    data = batch()
    assert not torch.equal(model(**data).loss, ref(**data).loss)
    # The schedule of the replaced module is rebuilt from the new one's children.
    new_block = copy.deepcopy(ref.transformer.h[1])
    sch["transformer.h.1"].replace(new_block)
    assert sch["transformer.h.1.attn.c_attn"].mod is new_block.attn.c_attn
    assert sch["transformer.h.1"].parent is sch["transformer.h"]


def test_replace_keeps_forward_hooks():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    calls = []
    model[0].register_forward_hook(lambda m, a, out: calls.append("post"))
    sch = slapo.create_schedule(model)
    sch["0"].replace(nn.Linear(3, 3))
    model(torch.randn(1, 3))
    assert calls == ["post"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fork_rng_equals_the_same_model_run_under_the_forked_state(family):
    ref = make(family)
    model = twin(ref)
    sch = slapo.create_schedule(model)
    paths = layer_paths(sch, family)
    for path in paths:
        sch[path].fork_rng()
        sch[path].checkpoint()  # recompute must reuse the forked state
    data = batch()
    slapo.set_random_seed(7, tp_rank=0)
    loss, grads = _step(model, data)
    # Reference: the unscheduled model, no checkpointing, each layer forked by hand.
    ref_loss, ref_grads = _ManualFork(ref, paths).step(data)
    # Bit-exact: the same calls under the same RNG states; the non-reentrant checkpoint keeps the
    # autograd graph and reruns the same kernels (see the first test).
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)


class _ManualFork:
    """Runs the given layers under tracker.fork() by wrapping their forward by hand."""

    def __init__(self, model, paths):
        self.model = model
        for path in paths:
            layer = model.get_submodule(path)
            forward = layer.forward

            def forked(*args, _forward=forward, **kwargs):
                with slapo.get_cuda_rng_tracker().fork():
                    return _forward(*args, **kwargs)

            layer.forward = forked

    def step(self, data):
        slapo.set_random_seed(7, tp_rank=0)
        return _step(self.model, data)


def _step(model, data):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = model(**data).loss
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_fork_rng_draws_differ_across_tp_ranks_and_reproduce():
    def draws(tp_rank):
        model = nn.Dropout(0.5)
        sch = slapo.create_schedule(nn.Sequential(model))
        sch["0"].fork_rng()
        slapo.set_random_seed(3, tp_rank=tp_rank)
        x = torch.ones(64)
        return sch.mod(x), torch.rand(4)  # the second draw is outside the forked region

    a0, outside0 = draws(0)
    a1, outside1 = draws(1)
    b0, _ = draws(0)
    # Exact: a dropout mask is a function of the generator state alone (no float arithmetic).
    assert torch.equal(a0, b0)
    assert not torch.equal(a0, a1)
    assert torch.equal(outside0, outside1)  # the default stream is shared by TP peers


def test_fork_rng_without_seed_is_a_clear_error():
    sch = slapo.create_schedule(nn.Sequential(nn.Dropout(0.5)))
    sch["0"].fork_rng()
    slapo.get_cuda_rng_tracker().reset()
    with pytest.raises(slapo.SlapoError, match="set_random_seed"):
        sch.mod(torch.ones(3))


def test_annotate_survives_build_and_names_bad_params():
    ref = make("llama")
    sch = slapo.create_schedule(twin(ref))
    sch["model.layers.0.mlp.up_proj"].annotate("weight", "tp_axis", 0)
    model, _ = slapo.build(sch)
    assert model.model.layers[0].mlp.up_proj.weight.tp_axis == 0
    assert_same_step(ref, model, exact=True)  # exact: an annotation is an attribute, no float op
    with pytest.raises(
        slapo.PrimitiveError,
        match=r'"model.layers.0.mlp" .* no parameter "weight".*mlp.gate_proj"\]',
    ):
        sch["model.layers.0.mlp"].annotate("weight", "k", 1)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_sync_with_identity_functions_is_bit_identical(family):
    ref = make(family)
    sch = slapo.create_schedule(twin(ref))
    seen = []

    def ident(t):
        seen.append(tuple(t.shape))
        return t

    path = layer_paths(sch, family)[0]
    for mode in ("fwd_pre", "fwd_post", "bwd_post"):
        sch[path].sync(mode=mode, sync_op_or_fn=ident)
    # Exact: identity hooks return the very tensors they get; no float op is added or moved.
    assert_same_step(ref, slapo.build(sch, init_weights=False)[0], exact=True)
    # fwd_pre, fwd_post, bwd_post each saw the (batch, seq, hidden) activation once
    assert len(seen) == 3 and len(set(seen)) == 1 and len(seen[0]) == 3


def test_sync_reaches_keyword_inputs_and_input_gradients():
    model = make("llama", dropout=0.0)
    layer = model.model.layers[0]
    sch = slapo.create_schedule(model)
    sch["model.layers.0"].sync(mode="bwd_post", sync_op_or_fn=lambda g, k: g * k, k=3.0)
    sch["model.layers.0"].sync(mode="fwd_pre", sync_op_or_fn=lambda t: t + 1.0)
    hidden = torch.randn(2, 5, 32, requires_grad=True)
    pos = torch.arange(5).unsqueeze(0)
    emb = model.model.rotary_emb(hidden, pos)
    out = layer(hidden_states=hidden, position_embeddings=emb)
    out.sum().backward()
    # Reference: the same layer unscheduled, input shifted by one, gradient times three.
    ref_layer = copy.deepcopy(layer)
    ref_layer._forward_pre_hooks.clear()
    ref_layer._forward_pre_hooks_with_kwargs.clear()
    h2 = hidden.detach().clone().requires_grad_()
    ref_out = ref_layer(hidden_states=h2 + 1.0, position_embeddings=emb)
    ref_out.sum().backward()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(hidden.grad, 3.0 * h2.grad)


def test_hook_old_spelling_registers_torch_hooks():
    sch = slapo.create_schedule(nn.Sequential(nn.Linear(3, 3)))
    grads = []
    sch["0"].hook("fw_post", lambda m, a, out: out * 0)
    sch["0"].hook("bw_post", lambda m, gi, go: grads.append(go[0].shape))
    x = torch.randn(2, 3, requires_grad=True)
    out = sch.mod(x)
    assert torch.count_nonzero(out) == 0
    out.sum().backward()
    assert grads == [torch.Size([2, 3])]


def test_bad_input_errors_name_the_path():
    sch = slapo.create_schedule(make("gpt2"))
    with pytest.raises(slapo.PrimitiveTypeError, match='"transformer.h.0.mlp" needs an nn.Module'):
        sch["transformer.h.0.mlp"].replace(lambda x: x)
    sch["transformer.h.0"].checkpoint()
    with pytest.raises(slapo.PrimitiveError, match='"transformer.h.0" already has checkpoint'):
        sch["transformer.h.0"].checkpoint()
    sch["transformer.h.0"].fork_rng()
    with pytest.raises(slapo.PrimitiveError, match="already has fork_rng"):
        sch["transformer.h.0"].fork_rng()
    # "forward" is the older seed spelling of fwd_post (seed 003): a typo of it is still unknown.
    with pytest.raises(slapo.PrimitiveError, match='unknown mode "forwards"'):
        sch["transformer.h.1"].sync(mode="forwards", sync_op_or_fn=lambda t: t)
    with pytest.raises(slapo.PrimitiveError, match='unknown op "all_reduce_typo"'):
        sch["transformer.h.1"].sync(mode="fwd_post", sync_op_or_fn="all_reduce_typo")
    with pytest.raises(slapo.SlapoError, match="root schedule"):
        slapo.build(sch["transformer"])
    with pytest.raises(slapo.TargetError, match="available targets"):
        slapo.build(sch, target="no_such_target")
    # A failing primitive leaves no record behind.
    assert [r.name for r in sch.metadata.primitives] == ["checkpoint", "fork_rng"]


def test_a_hugging_face_checkpoint_loads_into_the_scheduled_model(tmp_path):
    source = make("llama", seed=5)
    source.save_pretrained(tmp_path)
    model = make("llama", seed=6)
    sch = slapo.create_schedule(model)
    for path in layer_paths(sch, "llama"):
        sch[path].checkpoint()
        sch[path].fork_rng()
    built, _ = slapo.build(sch, init_weights=False)
    import safetensors.torch

    missing, unexpected = built.load_state_dict(
        safetensors.torch.load_file(tmp_path / "model.safetensors"), strict=False
    )
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    for name, tensor in source.state_dict().items():  # exact: loading is a copy
        assert torch.equal(built.state_dict()[name], tensor), name

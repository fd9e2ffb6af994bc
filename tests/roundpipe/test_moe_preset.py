"""The mixture-of-experts presets (Qwen3-MoE, GPT-OSS): router loss, routing replay and
training against plain PyTorch."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.context import ForwardCtx, RecomputeCtx
from roundpipe.models import moe as moe_mod
from roundpipe.models.moe import MoECausalLMRoundPipe, MoEDecoderBlock

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _tiny_qwen3_moe(**overrides) -> nn.Module:
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        router_aux_loss_coef=0.1,
        initializer_range=0.1,  # decisive routing: top-k far from ties
    )
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**kwargs, **overrides}))


def _tiny_gpt_oss() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,  # shorter than the sequence: the sliding layer's mask matters
        router_aux_loss_coef=0.1,
        initializer_range=0.1,
    )
    return transformers.GptOssForCausalLM(cfg)


def _wrap(model: nn.Module, n_mb: int = 2) -> MoECausalLMRoundPipe:
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=n_mb),
    )
    assert isinstance(rp, MoECausalLMRoundPipe)
    return rp


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 8))
    labels = ids.clone()
    labels[0, 3:] = -100
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[3, 6:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _assert_grads(hf: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    ("with_mask", "grain"),
    [(False, "stage"), (True, "layer")],
    ids=["no-mask-stage", "mask-layer"],
)
@pytest.mark.parametrize("make", [_tiny_qwen3_moe, _tiny_gpt_oss], ids=["qwen3_moe", "gpt_oss"])
def test_loss_with_router_loss_and_grads_match(two_devices, monkeypatch, make, with_mask, grain):
    ref = make()
    hf = copy.deepcopy(ref)
    rp = _wrap(hf)
    rp.model_run_config.recompute_grain = grain
    replays = []
    for name, fn in list(moe_mod.ROUTER_SCORES.items()):  # count the replayed router calls
        spy = lambda r, logits, idx, fn=fn: replays.append(1) or fn(r, logits, idx)  # noqa: E731
        monkeypatch.setitem(moe_mod.ROUTER_SCORES, name, spy)
    batch = _batch()
    if not with_mask:
        batch.pop("attention_mask")
    want = ref(**batch, output_router_logits=True)
    want.loss.backward()
    out = rp(**batch, output_router_logits=True, return_logits=False)
    torch.testing.assert_close(out.aux_loss, want.aux_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, want.loss.detach(), rtol=1e-5, atol=1e-6)
    assert out.logits is None
    out.loss.backward()
    # the backward recomputed 2 MoE layers x 2 microbatches, once each at either grain
    assert len(replays) == 2 * 2
    _assert_grads(hf, ref)

    hf.zero_grad()  # the fused entry point: the router loss runs over the whole batch
    loss = rp.forward_backward(input_kwargs={**batch, "output_router_logits": True})
    torch.testing.assert_close(loss, want.loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_grads(hf, ref)


def test_config_default_and_no_router_loss(two_devices):
    ref = _tiny_qwen3_moe(output_router_logits=True)
    rp = _wrap(copy.deepcopy(ref), n_mb=3)
    batch = _batch()
    with torch.no_grad():
        for flag in (None, False):
            kw = {} if flag is None else {"output_router_logits": flag}
            want, got = ref(**batch, **kw), rp(**batch, **kw)
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
            assert (got.aux_loss is None) == (want.aux_loss is None)


def test_recompute_replays_saved_routing():
    """A block imposes the experts saved in forward, whatever its router picks in recompute."""
    model = _tiny_qwen3_moe(num_hidden_layers=1)
    base = model.model
    with torch.no_grad():
        base.layers[0].mlp.experts.down_proj.mul_(100)  # experts visible beside the residual
    block = MoEDecoderBlock(base.layers[0], base.rotary_emb, model.config, sliding=False)
    torch.manual_seed(2)
    hidden, pos = torch.randn(1, 6, 64), torch.arange(6)[None]
    saved: list[tuple] = []
    with torch.no_grad(), ForwardCtx(lambda *data: saved.append(data)):
        plain = block(hidden, None, pos, {})[0]
    assert len(saved) == 1 and saved[0][0].shape == (6, 2)
    forced = (saved[0][0] + 1) % 4  # another pair of experts than the router's, per token
    with RecomputeCtx(saved[0]):
        again = block(hidden, None, pos, {})[0]
    torch.testing.assert_close(again, plain)  # same choice: same result
    with torch.no_grad(), RecomputeCtx((forced,)):
        replayed = block(hidden, None, pos, {})[0]
    moe = base.layers[0].mlp

    def forced_moe(_module, args, _out):
        h = args[0].reshape(-1, 64)
        logits = nn.functional.linear(h, moe.gate.weight)
        scores = torch.softmax(logits, -1, dtype=torch.float).gather(-1, forced)
        return moe.experts(h, forced, scores.to(logits.dtype)).reshape(args[0].shape)

    handle = moe.register_forward_hook(forced_moe)
    try:
        with torch.no_grad():
            want = block(hidden, None, pos, {})[0]  # outside RoundPipe: the hook forces
    finally:
        handle.remove()
    torch.testing.assert_close(replayed, want)
    assert not torch.allclose(replayed, plain)


def test_training_curve_matches_pytorch(two_devices):
    ref = _tiny_qwen3_moe()
    hf = copy.deepcopy(ref)
    rp = _wrap(hf)
    opt = torch.optim.Adam(rp.optim_parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    got, want = [], []
    batch = {**_batch(seed=10), "output_router_logits": True}  # memorise one batch
    for _ in range(4):
        out = ref(**batch)
        out.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(out.loss.detach())
        got.append(rp.forward_backward(input_kwargs={**batch, "return_logits": False}))
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-5)
    assert want[-1] < want[0]  # it learns
    # Adam divides by sqrt(v): near-zero gradients turn float32 noise into ~lr * 1e-3
    for p, q in zip(hf.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def test_lora_on_attention_and_experts_matches(two_devices):
    peft = pytest.importorskip("peft")
    if "target_parameters" not in inspect.signature(peft.LoraConfig).parameters:
        pytest.skip(f"peft {peft.__version__} cannot put LoRA on expert parameters")
    lora = peft.LoraConfig(
        r=4,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,  # B != 0: every adapter gets a gradient
    )
    ref = peft.get_peft_model(_tiny_qwen3_moe(), lora)
    twin = copy.deepcopy(ref)
    rp = _wrap(twin)
    batch = {**_batch(), "output_router_logits": True}
    want = ref(**batch)
    want.loss.backward()
    out = rp(**batch, return_logits=False)
    torch.testing.assert_close(out.loss, want.loss.detach(), rtol=1e-5, atol=1e-6)
    out.loss.backward()
    pairs = [(n, p, q) for (n, p), q in zip(twin.named_parameters(), ref.parameters())]
    trained = [(n, p, q) for n, p, q in pairs if q.requires_grad]
    assert len(trained) == 16  # 2 layers x (q, v, gate_up, down) x (A, B)
    for name, p, q in trained:
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)

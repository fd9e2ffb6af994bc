"""RoundPipe trains a peft LoRA model like plain PyTorch, keeping nothing for its frozen weights.

Only the adapters are trainable: they alone get optimizer copies and optimizer state; the frozen
base weights are uploaded for compute, never receive a gradient, never get a copy, and are never
written back. Models are small transformers configs with random weights; LoRA B starts at zero
in peft, so the tests perturb it to make every adapter gradient non-trivial.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.attribute import ParamAttribute
from roundpipe.optim import Adam, RoundPipeOptimizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 128


def _lora(model: nn.Module, targets: list[str], seed: int = 1) -> nn.Module:
    """``model`` with LoRA adapters (r=4) on ``targets``; LoRA B randomized (peft zeros it)."""
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return pm


def _lora_llama(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        use_cache=False,
    )
    return _lora(transformers.LlamaForCausalLM(cfg), ["q_proj", "v_proj"])


def _lora_qwen3() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        use_cache=False,
    )
    return _lora(transformers.Qwen3ForCausalLM(cfg), ["q_proj", "v_proj"])


def _lora_gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return _lora(transformers.GPT2LMHeadModel(cfg), ["c_attn"])


def _wrap(pm: nn.Module) -> RoundPipe:
    rp = wrap_model_to_roundpipe(
        pm, model_run_config=RoundPipeRunConfig(num_microbatch=2), pin_model="off"
    )
    assert isinstance(rp, RoundPipe)
    return rp


def _batches(n: int, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, 8), generator=g) for _ in range(n)]


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _assert_only_adapters_have_copies(rp: RoundPipe, pm: nn.Module) -> None:
    trainable = _trainable(pm)
    assert trainable and all("lora_" in n for n in trainable)
    assert [n for n, _ in rp.optim_named_parameters()] == list(trainable)
    for name, p in nn.Module.named_parameters(pm):
        optim = ParamAttribute.get(p).optim
        if p.requires_grad:
            assert optim is not None and optim.shape == p.shape, name
        else:
            assert optim is None, f"frozen {name} got an optimizer copy"
    # room for gradients is planned for the adapters only (the embedding and head are frozen)
    adapter_bytes = [
        sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
        for layer in rp.layers
    ]
    assert rp.layer_grad_bytes == adapter_bytes
    assert adapter_bytes[0] == adapter_bytes[-1] == 0 and all(adapter_bytes[1:-1])


OPTIMIZERS = {
    "torch-adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "cpp-adam": lambda ps: Adam(ps, lr=1e-2, implementation="cpp"),
}


@pytest.mark.parametrize("make_opt", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))
def test_lora_llama_sync_training_equals_pytorch(ndev, make_opt):
    """Loss each step and adapters after 3 Adam steps equal plain PyTorch training of the same
    PEFT model; frozen weights get no copy, no state, no gradient and never change."""
    ref = _lora_llama(layers=3)
    pm = copy.deepcopy(ref)
    init = copy.deepcopy(ref)
    rp = _wrap(pm)
    assert rp.num_layers == 5  # the preset found the decoder layers inside PeftModel
    _assert_only_adapters_have_copies(rp, pm)
    opt = RoundPipeOptimizer(rp, make_opt(rp.optim_parameters()))
    ref_opt = torch.optim.Adam(_trainable(ref).values(), lr=1e-2)
    for step, ids in enumerate(_batches(3)):
        out = rp(input_ids=ids, labels=ids)
        out.loss.backward()
        ref_out = ref(input_ids=ids, labels=ids)
        ref_out.loss.backward()
        # microbatches of 2 rows averaged vs one 4-row batch: float32 sums in another order
        torch.testing.assert_close(out.loss.detach(), ref_out.loss.detach(), msg=f"step {step}")
        for name, p in nn.Module.named_parameters(pm):
            assert (p.grad is not None) == p.requires_grad, f"{name} at step {step}"
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    state = opt.state
    trainable = _trainable(pm)
    assert len(state) == len(trainable)
    state_numel = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in state.values())
    assert state_numel == 2 * sum(p.numel() for p in trainable.values())
    for (name, p), q, p0 in zip(
        nn.Module.named_parameters(pm), ref.parameters(), init.parameters()
    ):
        if p.requires_grad:
            torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")
            assert not torch.equal(p, p0), f"{name} did not train"
        else:  # nothing is ever written back into a frozen weight
            assert torch.equal(p, p0), f"frozen {name} changed"


def _delayed_update_lora_reference(
    pm0: nn.Module, batches: list[torch.Tensor], lr: float
) -> tuple[list[torch.Tensor], nn.Module]:
    """RoundPipe's asynchronous step in plain PyTorch for a PEFT model: iteration ``k`` runs on
    the adapters after step ``k - 2`` (one step stale); step ``k`` applies its gradient to the
    latest adapters (tests/roundpipe/helpers.py's reference, for trainable parameters only)."""
    used, master = copy.deepcopy(pm0), copy.deepcopy(pm0)
    used_t, master_t = _trainable(used), _trainable(master)
    opt = torch.optim.Adam(master_t.values(), lr=lr)
    snapshots, losses = [], []
    for k, ids in enumerate(batches):
        if k >= 2:
            with torch.no_grad():
                for name, p in used_t.items():
                    p.copy_(snapshots[k - 2][name])
        loss = used(input_ids=ids, labels=ids).loss
        loss.backward()
        for name, p in master_t.items():
            p.grad = used_t[name].grad.clone()
        opt.step()
        opt.zero_grad()
        used.zero_grad()
        snapshots.append({n: p.detach().clone() for n, p in master_t.items()})
        losses.append(loss.detach())
    return losses, master


def test_lora_llama_async_training_equals_the_delayed_update_reference(two_devices):
    ref = _lora_llama()
    pm = copy.deepcopy(ref)
    rp = _wrap(pm)
    opt = RoundPipeOptimizer(rp, Adam(rp.optim_parameters(), lr=1e-2), is_async=True)
    batches = _batches(4)
    losses = []
    for ids in batches:
        out = rp(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.detach())
    rp.synchronize()
    ref_losses, master = _delayed_update_lora_reference(ref, batches, lr=1e-2)
    # microbatched loss and C++ Adam vs one batch and torch Adam: rounding differs
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for (name, p), q in zip(nn.Module.named_parameters(pm), master.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")
    assert len(opt.state) == len(_trainable(pm))


@pytest.mark.parametrize("make", [_lora_qwen3, _lora_gpt2], ids=["qwen3", "gpt2"])
def test_lora_qwen3_gpt2_presets_match_pytorch(two_devices, make):
    """The Qwen3 and GPT-2 presets find their blocks inside PeftModel; loss and adapter
    gradients equal plain PyTorch and frozen weights get no gradient."""
    ref = make()
    pm = copy.deepcopy(ref)
    rp = _wrap(pm)
    assert rp.num_layers == 4
    _assert_only_adapters_have_copies(rp, pm)
    ids = _batches(1)[0]
    out = rp(input_ids=ids, labels=ids)
    ref_out = ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss.detach(), ref_out.loss.detach())  # microbatch sums
    out.loss.backward()
    ref_out.loss.backward()
    for (name, p), q in zip(nn.Module.named_parameters(pm), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert p.grad is None, f"frozen {name} got a gradient"


def test_unfreezing_after_wrapping_is_a_clear_error(two_devices):
    """A weight frozen at wrap time has no optimizer copy: training it later would silently drop
    its gradient, so the step names the problem instead."""
    rp = _wrap(_lora_llama())
    opt = RoundPipeOptimizer(rp, torch.optim.SGD(rp.optim_parameters(), lr=0.1))
    rp.model.base_model.model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    ids = _batches(1)[0]
    rp(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="frozen .*requires_grad=False.* when the model was"):
        opt.step()


def test_peft_special_cases_are_clear_errors(two_devices):
    pm = _lora_llama()
    rp = _wrap(pm)
    ids = _batches(1)[0]
    with pytest.raises(NotImplementedError, match="adapter_names"):
        rp(input_ids=ids, adapter_names=["default"] * 4)
    torch.manual_seed(0)
    prompt = peft.get_peft_model(
        transformers.LlamaForCausalLM(pm.get_base_model().config),
        peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2),
    )
    assert roundpipe.models.find_preset(prompt) is None  # the size heuristic keeps its forward
    with pytest.raises(NotImplementedError, match="prompt-learning"):
        wrap_model_to_roundpipe(prompt, use_sequential_preset=True, pin_model="off")

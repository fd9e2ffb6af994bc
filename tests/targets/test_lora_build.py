"""slapo.build trains a peft LoRA model (base weights frozen) on "eager" and "roundpipe" like plain
PyTorch, through the training-loop contract; the optimizer covers the adapters only."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe
import slapo
from roundpipe import device, optim_stream
from roundpipe.attribute import ParamAttribute
from roundpipe.optim import RoundPipeOptimizer
from slapo.targets.common import make_optimizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 128


@pytest.fixture(autouse=True)
def _devices(monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_WAIT_TIMEOUT", "60")
    roundpipe.init_devices(num_virtual=2)
    yield
    optim_stream.synchronize_optim()
    device.wait_devices_idle(timeout=30)


def _lora_llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        use_cache=False,
    )
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    pm = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)
    with torch.no_grad():  # peft starts LoRA B at zero: randomize it for non-trivial gradients
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return pm


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (4, 8), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _reference(ref: nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(_trainable(ref), lr=1e-2)
    losses = []
    for batch in batches:
        loss = ref(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _contract_loop(model, opt, batches) -> list[torch.Tensor]:
    losses = []
    for batch in batches:
        losses.append(slapo.train_step(model, batch))
        opt.step()
        opt.zero_grad()
    return losses


def test_make_optimizer_takes_only_trainable_parameters():
    pm = _lora_llama()
    opt = make_optimizer(pm, torch.optim.AdamW, {"lr": 1e-2})
    params = opt.param_groups[0]["params"]
    assert [id(p) for p in params] == [id(p) for p in _trainable(pm)]
    assert len(params) == 12 and len(params) < len(list(pm.parameters()))


def test_eager_target_trains_lora_like_pytorch():
    ref = _lora_llama()
    init = copy.deepcopy(ref)
    model, opt = slapo.build(
        slapo.create_schedule(copy.deepcopy(ref)),
        target="eager",
        optimizer=torch.optim.AdamW,
        optimizer_kwargs={"lr": 1e-2},
    )
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in _trainable(model)}
    batches = _batches(3)
    losses = _contract_loop(model, opt, batches)
    ref_losses = _reference(ref, batches)
    # the same module code on the same batches in one process: the very same kernels run
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), init.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(p, p0) != p.requires_grad, f"{name}: trained iff trainable"


def test_roundpipe_target_trains_lora_like_pytorch():
    """Sync RoundPipe from the schedule (preset found inside PeftModel, a pipeline cut taken from
    the schedule) gives plain PyTorch's losses and adapters; only adapters have copies/state."""
    ref = _lora_llama()
    init = copy.deepcopy(ref)
    sch = slapo.create_schedule(copy.deepcopy(ref))
    sch["base_model.model.model.layers.1"].cut_pipeline_stage()
    model, opt = slapo.build(
        sch,
        target="roundpipe",
        num_microbatch=2,
        pin_model="off",
        optimizer=roundpipe.optim.Adam,
        optimizer_kwargs={"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.01},
    )
    assert isinstance(opt, RoundPipeOptimizer) and not opt.is_async
    assert [list(r) for r in model.model_run_config.execute_plan.fwd_plan] == [[0, 1, 2], [3, 4]]
    net = model.model  # the PeftModel itself
    trainable = _trainable(net)
    copies = [ParamAttribute.get(p).optim for p in nn.Module.parameters(net)]
    assert sum(c is not None for c in copies) == len(trainable)
    assert [id(p) for p in opt.optimizer.param_groups[0]["params"]] == [
        id(ParamAttribute.get(p).optim) for p in trainable
    ]
    batches = _batches(3)
    losses = _contract_loop(model, opt, batches)
    ref_losses = _reference(ref, batches)
    # microbatches averaged vs one batch, C++ vs torch AdamW: float32 rounding differs
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    state = opt.state
    assert len(state) == len(trainable)
    assert sum(s["exp_avg"].numel() for s in state.values()) == sum(p.numel() for p in trainable)
    for (name, p), q, p0 in zip(
        nn.Module.named_parameters(net), ref.parameters(), init.parameters()
    ):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")
        assert torch.equal(p, p0) != p.requires_grad, f"{name}: trained iff trainable"

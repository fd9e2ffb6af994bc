"""User guide examples: Train a Custom Model (ResNet on CIFAR-100) and Fine-Tune Qwen3-1.7B.

Both notebooks' flows run end to end on CPU virtual devices (instead of CUDA GPUs):

* the ResNet is a smaller one written here in the page's shape (stem, BasicBlocks, head as one
  ``nn.Sequential``; torchvision is not used), trained on random 8x8 "images" of 100 classes;
* Qwen3 is a tiny random ``transformers.Qwen3ForCausalLM`` (no hub download), trained on random
  padded token batches standing in for the tokenized NekoQA-10K texts.

Each is checked against the same loop in plain PyTorch (float16 model, float32 master weights
stepped by the same Adam, one step stale, torch.amp.GradScaler): printed losses, accuracies,
evaluation results, generated tokens and final weights within rtol 1e-3 / atol 1e-3.
"""

from __future__ import annotations

import copy

import pytest
import torch
from guide_reference import PlainTrainer, assert_params
from helpers import tiny_qwen3
from torch import nn

import roundpipe
from roundpipe import (
    GradScaler,
    OptimizerCtx,
    RoundPipe,
    RoundPipeRunConfig,
    wrap_model_to_roundpipe,
)
from roundpipe.optim import Adam

TOL = {"rtol": 1e-3, "atol": 1e-3}


# -- ResNet on CIFAR-100 ------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a (projected when the shape changes) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def build_resnet(num_classes: int = 100) -> nn.Sequential:
    """Stem, BasicBlocks (the channel changes with stride 2), pooling and classifier, one layer
    per Sequential entry so RoundPipe can stage them."""
    blocks = [BasicBlock(8, 16, 2), BasicBlock(16, 16), BasicBlock(16, 32, 2)]
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, 1, 1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        *blocks,
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def _cifar_like(n_batches: int, batch_size: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, 3, 8, 8, generator=g),
            torch.randint(0, 100, (batch_size,), generator=g),
        )
        for _ in range(n_batches)
    ]


def test_resnet_cifar100_notebook(two_devices):
    """The notebook's training (forward_backward with return_outputs, asynchronous step,
    GradScaler, printed loss and accuracy) and its evaluation after synchronize()."""
    torch.manual_seed(0)
    net = build_resnet().to(torch.float16)
    ref = PlainTrainer(net, lambda ps: Adam(ps), optim_dtype=torch.float32)
    ref_scaler = torch.amp.GradScaler("cpu")
    trainloader = _cifar_like(2, 12, seed=1)
    testloader = _cifar_like(1, 12, seed=2)

    model = RoundPipe(copy.deepcopy(net), optim_dtype=torch.float32)
    with OptimizerCtx():
        optimizer = Adam(model.parameters())
    scaler = GradScaler()
    criterion = nn.CrossEntropyLoss()
    num_mb = roundpipe.get_num_devices() + 1  # the default num_microbatch

    def evaluate(loader, net_):
        net_.eval()
        correct, total, loss_sum = 0, 0, 0.0
        with torch.no_grad():
            for images, labels in loader:
                outputs = net_(images.to(torch.float16))
                loss_sum += criterion(outputs.float(), labels).item() * labels.size(0)
                correct += outputs.max(1)[1].eq(labels).sum().item()
                total += labels.size(0)
        net_.train()
        return loss_sum / total, correct / total

    def optimizer_step():
        scaler.step(optimizer)
        optimizer.zero_grad()

    for _epoch in range(2):
        model.train()
        running_loss, correct, total = 0.0, 0, 0
        ref_running, ref_correct = 0.0, 0
        for images, labels in trainloader:
            loss, outputs = model.forward_backward(
                input_args=(images.to(torch.float16),),
                label=labels,
                loss_fn=lambda outputs, labels: (
                    scaler.scale(criterion(outputs.float(), labels)) / num_mb
                ),
                return_outputs=True,
            )
            model.step(optimizer_step)
            scaler.update()
            loss_item = loss.item() / scaler.get_scale()
            running_loss += loss_item * labels.size(0)
            correct += outputs.max(1)[1].eq(labels).sum().item()
            total += labels.size(0)

            ref_outputs: list[torch.Tensor] = []
            ref_loss = ref.forward_backward(
                (images.to(torch.float16),),
                {},
                labels,
                lambda out, t: ref_scaler.scale(criterion(out.float(), t)) / num_mb,
                num_mb,
                ref_outputs,
            )
            used = ref_scaler.get_scale()
            ref.step(lambda opt: (ref_scaler.step(opt), opt.zero_grad()))
            ref_scaler.update()
            ref_running += ref_loss.item() / used * labels.size(0)
            ref_correct += torch.cat(ref_outputs).max(1)[1].eq(labels).sum().item()
            torch.testing.assert_close(outputs, torch.cat(ref_outputs), **TOL)
        assert running_loss / total == pytest.approx(ref_running / total, rel=1e-3)
        assert correct == ref_correct
        model.synchronize()  # the page: refresh the parameters before evaluating
        test_loss, test_acc = evaluate(testloader, model)
        want_loss, want_acc = evaluate(testloader, ref.synchronized())
        assert test_loss == pytest.approx(want_loss, rel=1e-3) and test_acc == want_acc
    assert_params(model.model.parameters(), ref.synchronized().parameters(), "weights", **TOL)
    assert_params(model.model.buffers(), ref.model.buffers(), "batch-norm statistics", **TOL)


# -- Qwen3 fine-tuning --------------------------------------------------------------------------
def _tiny_qwen3():
    model = tiny_qwen3(use_cache=False, pad_token_id=0, eos_token_id=1)
    return pytest.importorskip("transformers"), model.to(torch.float16)


def _tokenized_batches(n: int, batch_size: int, seed: int):
    """What the page's tokenize() returns for padded texts: input_ids and attention_mask (pad
    id 0 at the end of shorter rows), labels with the pad positions set to -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, 64, (batch_size, 10), generator=g)
        lengths = torch.randint(5, 11, (batch_size,), generator=g)
        mask = (torch.arange(10) < lengths.unsqueeze(1)).long()
        ids = ids * mask
        labels = ids.clone()
        labels[labels == 0] = -100
        out.append(({"input_ids": ids, "attention_mask": mask}, labels))
    return out


def test_qwen3_nekoqa_notebook(two_devices, tmp_path):
    """wrap_model_to_roundpipe (Qwen3 preset), the fine-tuning loop (forward_backward with
    input_kwargs and the model's loss_function, GradScaler, asynchronous step), greedy generation
    after synchronize(), and save_pretrained() of the fine-tuned weights."""
    transformers, raw_model = _tiny_qwen3()
    ref = PlainTrainer(raw_model, lambda ps: Adam(ps, lr=1e-3), optim_dtype=torch.float32)
    ref_scaler = torch.amp.GradScaler("cpu")

    model = wrap_model_to_roundpipe(
        raw_model,
        model_run_config=RoundPipeRunConfig(num_microbatch=10),
        optim_dtype=torch.float32,
    )
    optim = Adam(model.optim_parameters(), lr=1e-3)
    scaler = GradScaler()
    NUM_MICROBATCH = 10  # noqa: N806 - the page's name

    def optimizer_step():
        scaler.step(optim)
        optim.zero_grad()

    dataloader = _tokenized_batches(2, 20, seed=1)
    for _epoch in range(2):
        model.train()
        epoch_loss, ref_epoch_loss = [], []
        for input_dict, labels in dataloader:
            loss = model.forward_backward(
                input_kwargs=input_dict,
                label=labels,
                loss_fn=lambda outputs, labels: scaler.scale(
                    model.loss_function(
                        logits=outputs.logits, labels=labels, vocab_size=model.vocab_size
                    )
                    / NUM_MICROBATCH
                ),
            )
            loss_item = loss.item() / scaler.get_scale()
            epoch_loss.append(loss_item)
            model.step(optimizer_step)
            scaler.update()

            ref_loss = ref.forward_backward(
                (),
                input_dict,
                labels,
                lambda out, t: ref_scaler.scale(
                    ref.model.loss_function(logits=out.logits, labels=t, vocab_size=64)
                    / NUM_MICROBATCH
                ),
                NUM_MICROBATCH,
            )
            ref_epoch_loss.append(ref_loss.item() / ref_scaler.get_scale())
            ref.step(lambda opt: (ref_scaler.step(opt), opt.zero_grad()))
            ref_scaler.update()
        assert epoch_loss == pytest.approx(ref_epoch_loss, rel=1e-3)

    @torch.no_grad()
    def generate(net, prompt_ids, max_new_tokens=4, **call_kwargs):
        input_ids = prompt_ids
        for _ in range(max_new_tokens):
            attention_mask = torch.ones_like(input_ids)
            outputs = net(
                input_ids=input_ids.to(torch.long), attention_mask=attention_mask, **call_kwargs
            )
            next_id = outputs.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            input_ids = torch.cat([input_ids, next_id], dim=-1)
            if next_id.item() == 1:
                break
        return input_ids, outputs.logits

    model.synchronize()
    model.eval()
    prompt = torch.randint(2, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    got_ids, got_logits = generate(
        model, prompt, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1)
    )
    model.train()
    plain = ref.synchronized().eval()
    want_ids, want_logits = generate(plain, prompt)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_logits, want_logits, **TOL)

    model.synchronize()
    model.save_pretrained(tmp_path / "qwen3-nekoqa-finetuned")
    saved = transformers.Qwen3ForCausalLM.from_pretrained(
        tmp_path / "qwen3-nekoqa-finetuned", dtype=torch.float16
    )
    assert_params(saved.parameters(), plain.parameters(), "saved weights", **TOL)
    assert_params(raw_model.parameters(), plain.parameters(), "raw_model weights", **TOL)

"""The user guide's "Custom Microbatch Splitting" and "Registering Custom Data Types" pages, each
flow as a test on CPU virtual devices: RoundPipe's outputs, loss and gradients equal the
unwrapped model's on the whole batch."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from helpers import assert_close
from torch import nn
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate
from torch.utils._pytree import register_pytree_node

from roundpipe import RoundPipe, RoundPipePackedData, RoundPipeRunConfig
from roundpipe.batch import Batch, MicrobatchMergeError
from roundpipe.run_config import FullRoundPipeRunConfig


def _rp(net: nn.Module, **kw) -> RoundPipe:
    return RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(**kw))


def _assert_grads(model: RoundPipe, ref: nn.Module) -> None:
    for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad {name}")


# -- custom data types, registered before any RoundPipe instance is made (as the page says) ---
@dataclass
class TransformerOutput:
    logits: torch.Tensor
    hidden_states: torch.Tensor
    loss: float = 0.0  # not a tensor: kept in the pytree context


register_pytree_node(
    TransformerOutput,
    lambda o: ([o.logits, o.hidden_states], {"loss": o.loss}),
    lambda children, ctx: TransformerOutput(children[0], children[1], loss=ctx["loss"]),
)


class FlexibleOutput:
    def __init__(self, logits: torch.Tensor, attentions: torch.Tensor | None = None) -> None:
        self.logits = logits
        self.attentions = attentions


def _flatten_flexible(o: FlexibleOutput):
    present = o.attentions is not None
    return ([o.logits, o.attentions] if present else [o.logits]), {"has_attentions": present}


def _unflatten_flexible(children, ctx) -> FlexibleOutput:
    return FlexibleOutput(children[0], children[1] if ctx["has_attentions"] else None)


register_pytree_node(FlexibleOutput, _flatten_flexible, _unflatten_flexible)


class BatchResult:
    def __init__(self, outputs: list, metadata: dict) -> None:
        self.outputs = outputs
        self.metadata = metadata


register_pytree_node(
    BatchResult,
    lambda r: ([r.outputs, r.metadata], None),
    lambda children, _: BatchResult(children[0], children[1]),
)


# ================================ Custom Microbatch Splitting ================================
class _ImageNet(nn.Module):
    """(images, scale_factor) -> logits: a small conv head; ``scale_factor`` is replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, images, scale_factor=None, mode="train"):
        h = torch.tanh(self.conv(images)).flatten(1)
        logits = self.fc(h)
        if scale_factor is not None:
            logits = logits * scale_factor
        return logits


def _images(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 4, 4), torch.randint(0, 5, (n,))


def test_default_split_chunks_batched_tensors_and_replicates_the_rest(two_devices):
    """12 images at num_microbatch=4: microbatches of 3; a 0-d scale and a string replicated;
    training equals the whole batch's cross entropy."""
    images, labels = _images(12)
    cfg = FullRoundPipeRunConfig(RoundPipeRunConfig(num_microbatch=4), RoundPipeRunConfig())
    batch = Batch((images, torch.tensor(0.5)), {"mode": "eval"}, cfg)
    assert [mb[0].shape for mb in batch.flatten_states] == [(3, 3, 4, 4)] * 4
    assert all(float(mb[1]) == 0.5 and mb[2] == "eval" for mb in batch.flatten_states)

    ref = _ImageNet()
    model = _rp(copy.deepcopy(ref), num_microbatch=4)
    scale = torch.tensor(0.5)
    loss = model.forward_backward(
        (images, scale),
        {"mode": "eval"},
        label=labels,
        loss_fn=lambda out, y: nn.functional.cross_entropy(out, y) / 4,
    )
    ref_loss = nn.functional.cross_entropy(ref(images, scale, mode="eval"), labels)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    _assert_grads(model, ref)


class _LogitsAndStats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        logits = self.lin(x)
        return logits, logits.pow(2).mean(), "logits"


def test_default_merge_cats_averages_and_checks_non_tensors(two_devices):
    ref = _LogitsAndStats()
    model = _rp(nn.Sequential(copy.deepcopy(ref)), num_microbatch=2)
    x = torch.randn(6, 8)
    logits, mean_sq, name = model(x)
    ref_logits, ref_mean_sq, _ = ref(x)
    assert name == "logits"
    assert_close(logits, ref_logits.detach(), "concatenated logits")
    assert_close(mean_sq, ref_mean_sq.detach(), "averaged scalar")
    (logits.sum() + mean_sq).backward()
    (ref_logits.sum() + ref_mean_sq).backward()
    _assert_grads(model, ref)


def test_split_input_spec_replicates_a_batch_sized_scale_factor(two_devices):
    """The scale factor has as many entries as the batch has rows: the automatic split would
    chunk it; ``(TensorChunkSpec(0), _Replicate)`` keeps it whole for every microbatch."""
    torch.manual_seed(0)
    ref = _ImageNet()
    ref.fc = nn.Linear(64, 4)  # 4 classes, batch of 4: scale_factor (4,) looks batched
    config = RoundPipeRunConfig(
        num_microbatch=2, split_input=((TensorChunkSpec(0), _Replicate), None)
    )
    model = RoundPipe(copy.deepcopy(ref), pin_model="off", model_run_config=config)
    images, scale = torch.randn(4, 3, 4, 4), torch.tensor([1.0, 2.0, 0.5, -1.0])
    out = model(images, scale)
    ref_out = ref(images, scale)
    assert_close(out, ref_out.detach(), "logits scaled per class")
    out.pow(2).sum().backward()
    ref_out.pow(2).sum().backward()
    _assert_grads(model, ref)


class _Tokens(nn.Module):
    """(tokens (B, T, D), position_ids (T, B)) -> (B, T, D): positions split along dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(8, 6)
        self.lin = nn.Linear(6, 6)

    def forward(self, tokens, position_ids):
        return torch.tanh(self.lin(tokens + self.pos(position_ids.t())))


def test_split_input_spec_splits_position_ids_along_dim_1(two_devices):
    ref = _Tokens()
    config = RoundPipeRunConfig(
        num_microbatch=2, split_input=((TensorChunkSpec(0), TensorChunkSpec(1)), None)
    )
    model = RoundPipe(nn.Sequential(copy.deepcopy(ref)), pin_model="off", model_run_config=config)
    tokens = torch.randn(4, 5, 6)
    position_ids = torch.randint(0, 8, (5, 4))
    y = torch.randn(4, 5, 6)
    loss = model.forward_backward(
        (tokens, position_ids),
        label=y,
        loss_fn=lambda out, t: nn.functional.mse_loss(out, t) / 2,
        run_config=config,
    )
    ref_loss = nn.functional.mse_loss(ref(tokens, position_ids), y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    _assert_grads(model, ref)


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, images, masks, bias=0.0):
        return self.lin(images * masks) + bias


def test_custom_split_function_for_images_and_masks(two_devices):
    def custom_split(args, kwargs, num_microbatch):
        images, masks = args
        pairs = zip(images.chunk(num_microbatch), masks.chunk(num_microbatch))
        return [(img, mask) for img, mask in pairs], [kwargs] * num_microbatch

    ref = _Masked()
    model = _rp(nn.Sequential(copy.deepcopy(ref)), num_microbatch=3, split_input=custom_split)
    images, masks, y = torch.randn(6, 8), (torch.rand(6, 8) > 0.3).float(), torch.randn(6, 1)
    loss = model.forward_backward(
        (images, masks),
        {"bias": 0.25},
        label=y,
        loss_fn=lambda out, t: nn.functional.mse_loss(out, t) / 3,
    )
    ref_loss = nn.functional.mse_loss(ref(images, masks, bias=0.25), y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    _assert_grads(model, ref)


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.pos = nn.Embedding(5, 6)
        self.head = nn.Linear(6, 10)

    def forward(self, input_ids, attention_mask, position_ids):
        h = self.embed(input_ids) + self.pos(position_ids)
        return self.head(torch.tanh(h) * attention_mask[..., None])


def test_custom_split_function_for_transformer_kwargs(two_devices):
    def split_transformer_input(args, kwargs, num_microbatch):
        parts = [
            kwargs[k].chunk(num_microbatch) for k in ("input_ids", "attention_mask", "position_ids")
        ]
        kwargs_list = [
            {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
            for ids, mask, pos in zip(*parts)
        ]
        return [()] * num_microbatch, kwargs_list

    ref = _TinyLM()
    model = _rp(
        nn.Sequential(copy.deepcopy(ref)), num_microbatch=2, split_input=split_transformer_input
    )
    ids = torch.randint(0, 10, (4, 5))
    kwargs = {
        "input_ids": ids,
        "attention_mask": torch.ones(4, 5).tril(),
        "position_ids": torch.arange(5).expand(4, 5),
    }
    targets = torch.randint(0, 10, (4, 5))
    loss = model.forward_backward(
        input_kwargs=kwargs,
        label=targets,
        loss_fn=lambda out, t: nn.functional.cross_entropy(out.flatten(0, 1), t.flatten()) / 2,
    )
    ref_loss = nn.functional.cross_entropy(ref(**kwargs).flatten(0, 1), targets.flatten())
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    _assert_grads(model, ref)


class _Classifier(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(8, classes)

    def forward(self, x):
        return self.lin(x)


def _weighted_ce(logits, targets, weights, n_rows):
    """Sum of per-sample weighted cross entropy over ``n_rows``: microbatch losses add up to
    the whole batch's."""
    return (nn.functional.cross_entropy(logits, targets, reduction="none") * weights).sum() / n_rows


@pytest.mark.parametrize("style", ["spec", "function"])
def test_split_label_with_per_sample_weights(two_devices, style):
    def custom_split_label(label, num_microbatch):
        targets, weights = label
        return list(zip(targets.chunk(num_microbatch), weights.chunk(num_microbatch)))

    split_label = (
        (TensorChunkSpec(0), TensorChunkSpec(0)) if style == "spec" else custom_split_label
    )
    ref = _Classifier()
    model = _rp(nn.Sequential(copy.deepcopy(ref)), num_microbatch=2, split_label=split_label)
    x, targets, weights = torch.randn(6, 8), torch.randint(0, 4, (6,)), torch.rand(6)
    loss = model.forward_backward(
        (x,), label=(targets, weights), loss_fn=lambda out, lab: _weighted_ce(out, *lab, 6)
    )
    ref_loss = _weighted_ce(ref(x), targets, weights, 6)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    _assert_grads(model, ref)


def test_split_label_replicates_class_weights(two_devices):
    """Class weights with as many entries as the batch has rows: ``_Replicate`` keeps them
    whole for every microbatch."""
    ref = _Classifier(classes=4)
    config = RoundPipeRunConfig(num_microbatch=2, split_label=(TensorChunkSpec(0), _Replicate))
    model = RoundPipe(nn.Sequential(copy.deepcopy(ref)), pin_model="off", model_run_config=config)
    x, targets = torch.randn(4, 8), torch.randint(0, 4, (4,))
    class_weights = torch.tensor([0.5, 1.0, 2.0, 1.5])

    def loss_fn(out, lab):
        t, cw = lab
        return nn.functional.cross_entropy(out, t, weight=cw, reduction="sum")

    loss = model.forward_backward((x,), label=(targets, class_weights), loss_fn=loss_fn)
    ref_loss = loss_fn(ref(x), (targets, class_weights))
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    _assert_grads(model, ref)


class _LogitsHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        hidden = torch.tanh(self.lin(x))
        return self.out(hidden), hidden


def test_merge_output_specs_concatenate_and_sum_reduce(two_devices):
    ref = _LogitsHidden()
    model = _rp(
        nn.Sequential(copy.deepcopy(ref)),
        num_microbatch=2,
        merge_output=(TensorChunkSpec(0), TensorChunkSpec(0)),
    )
    x = torch.randn(4, 8)
    logits, hidden = model(x)
    ref_logits, ref_hidden = ref(x)
    assert_close(logits, ref_logits.detach(), "logits")
    assert_close(hidden, ref_hidden.detach(), "hidden states")
    (logits.sum() + hidden.pow(2).sum()).backward()
    (ref_logits.sum() + ref_hidden.pow(2).sum()).backward()
    _assert_grads(model, ref)

    class _SumLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x):
            return self.lin(x).pow(2).sum()

    ref2 = _SumLoss()
    sum_reducer = _CustomReducer(torch.tensor(0.0), lambda a, b: a + b)
    model2 = _rp(nn.Sequential(copy.deepcopy(ref2)), num_microbatch=2, merge_output=sum_reducer)
    total = model2(x)
    ref_total = ref2(x)
    assert_close(total, ref_total.detach(), "summed losses")
    total.backward()
    ref_total.backward()
    _assert_grads(model2, ref2)


def test_merge_output_function_keeps_only_the_logits(two_devices):
    class _Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x):
            logits = self.lin(x)
            return TransformerOutput(logits=logits, hidden_states=torch.tanh(logits))

    def custom_merge(outputs):
        return torch.cat([out.logits for out in outputs], dim=0)

    ref = _Model()
    model = _rp(nn.Sequential(copy.deepcopy(ref)), num_microbatch=2, merge_output=custom_merge)
    x = torch.randn(4, 8)
    logits = model(x)
    ref_logits = ref(x).logits
    assert_close(logits, ref_logits.detach(), "logits")
    logits.pow(2).sum().backward()
    ref_logits.pow(2).sum().backward()
    _assert_grads(model, ref)


def test_merge_output_false_packs_microbatches_for_the_next_model(two_devices):
    ref_a, ref_b = _LogitsHidden(), nn.Sequential(nn.Linear(3, 1))
    a = _rp(nn.Sequential(copy.deepcopy(ref_a)), num_microbatch=2, merge_output=False)
    b = _rp(copy.deepcopy(ref_b), num_microbatch=2)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    logits, hidden = a(x)
    assert isinstance(logits, RoundPipePackedData) and len(logits) == 2
    logits.synchronize()  # the transfers are done: read it like a list
    ref_logits, ref_hidden = ref_a(x)
    assert_close(torch.cat(list(logits)), ref_logits.detach(), "packed logits")
    assert_close(torch.cat(list(hidden)), ref_hidden.detach(), "packed hidden states")
    loss = b.forward_backward(
        (logits,), label=y, loss_fn=lambda out, t: nn.functional.mse_loss(out, t) / 2
    )
    ref_loss = nn.functional.mse_loss(ref_b(ref_logits), y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss through both models")
    _assert_grads(a, ref_a)
    _assert_grads(b, ref_b)


# ================================ Registering Custom Data Types ===============================
class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        hidden = torch.tanh(self.lin(x))
        return TransformerOutput(logits=self.out(hidden), hidden_states=hidden)


class _Refine(nn.Module):
    """Reads a TransformerOutput from the previous layer (another stage) and returns one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, prev: TransformerOutput) -> TransformerOutput:
        hidden = torch.tanh(self.lin(prev.hidden_states)) + prev.hidden_states
        return TransformerOutput(self.out(hidden) + prev.logits, hidden, loss=prev.loss)


def test_registered_dataclass_flows_between_stages_and_merges(two_devices):
    """Stage outputs of a registered dataclass: tensors move and split, the merged output is a
    TransformerOutput with concatenated tensors and the (equal) ``loss`` field kept."""
    ref = nn.Sequential(_Encoder(), _Refine(), _Refine())
    model = _rp(copy.deepcopy(ref), num_microbatch=2)
    x, targets = torch.randn(4, 8), torch.randint(0, 3, (4,))
    out = model(x)
    ref_out = ref(x)
    assert isinstance(out, TransformerOutput) and out.loss == 0.0
    assert_close(out.logits, ref_out.logits.detach(), "logits")
    assert_close(out.hidden_states, ref_out.hidden_states.detach(), "hidden states")
    nn.functional.cross_entropy(out.logits, targets).backward()
    nn.functional.cross_entropy(ref_out.logits, targets).backward()
    _assert_grads(model, ref)


def test_registered_dataclass_in_forward_backward(two_devices):
    ref = nn.Sequential(_Encoder(), _Refine())
    model = _rp(copy.deepcopy(ref), num_microbatch=2)
    x, targets = torch.randn(4, 8), torch.randint(0, 3, (4,))
    loss, out = model.forward_backward(
        (x,),
        label=targets,
        loss_fn=lambda o, t: nn.functional.cross_entropy(o.logits, t) / 2,
        return_outputs=True,
    )
    ref_out = ref(x)
    ref_loss = nn.functional.cross_entropy(ref_out.logits, targets)
    ref_loss.backward()
    assert isinstance(out, TransformerOutput)
    assert_close(loss, ref_loss.detach(), "loss")
    assert_close(out.logits, ref_out.logits.detach(), "logits")
    _assert_grads(model, ref)


def test_registered_dataclass_as_input_is_split_along_the_batch(two_devices):
    ref = _Refine()
    model = _rp(nn.Sequential(copy.deepcopy(ref)), num_microbatch=2)
    prev = TransformerOutput(torch.randn(4, 3), torch.randn(4, 6), loss=1.5)
    cfg = FullRoundPipeRunConfig(RoundPipeRunConfig(num_microbatch=2), RoundPipeRunConfig())
    pieces = [args[0] for args, _ in Batch((prev,), {}, cfg).outputs()]
    assert all(isinstance(p, TransformerOutput) and p.loss == 1.5 for p in pieces)
    assert [p.logits.shape[0] for p in pieces] == [2, 2]
    out = model(prev)
    ref_out = ref(prev)
    assert out.loss == 1.5
    assert_close(out.logits, ref_out.logits.detach(), "logits")
    out.logits.sum().backward()
    ref_out.logits.sum().backward()
    _assert_grads(model, ref)


def test_non_tensor_field_that_differs_is_refused(two_devices):
    """The ``loss`` field is checked for consistency: differing per microbatch is an error."""

    class _PerBatchLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x):
            logits = self.lin(x)
            return TransformerOutput(logits, logits, loss=float(x[0, 0]))

    model = _rp(nn.Sequential(_PerBatchLoss()), num_microbatch=2)
    x = torch.randn(4, 8)
    x[0, 0], x[2, 0] = 1.0, 2.0
    where = (
        r"output \(TransformerOutput\) holds \{'loss': 1.0\} in microbatch 0 but \{'loss': 2.0\}"
    )
    with torch.no_grad(), pytest.raises(MicrobatchMergeError, match=where):
        model(x)
    x[2, 0] = 1.0
    with torch.no_grad():
        assert model(x).loss == 1.0


class _Attend(nn.Module):
    def __init__(self, with_attentions: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.with_attentions = with_attentions

    def forward(self, x):
        logits = self.lin(x)
        att = torch.softmax(logits, -1) if self.with_attentions else None
        return FlexibleOutput(logits, att)


class _AttendHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, o: FlexibleOutput) -> FlexibleOutput:
        h = o.logits if o.attentions is None else o.logits * o.attentions
        return FlexibleOutput(self.lin(h), o.attentions)


@pytest.mark.parametrize("with_attentions", [True, False])
def test_optional_field_type(two_devices, with_attentions):
    ref = nn.Sequential(_Attend(with_attentions), _AttendHead())
    model = _rp(copy.deepcopy(ref), num_microbatch=2)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    loss = model.forward_backward(
        (x,), label=y, loss_fn=lambda o, t: nn.functional.mse_loss(o.logits, t) / 2
    )
    ref_out = ref(x)
    ref_loss = nn.functional.mse_loss(ref_out.logits, y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    _assert_grads(model, ref)
    with torch.no_grad():
        out = model(x)
    assert (out.attentions is None) == (not with_attentions)
    if with_attentions:
        assert_close(out.attentions, ref_out.attentions.detach(), "attentions")


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 2)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return BatchResult([self.a(x), self.b(x)], {"norm": x.norm(dim=1), "source": "nested"})


def test_nested_custom_type(two_devices):
    ref = _Nested()
    model = _rp(nn.Sequential(copy.deepcopy(ref)), num_microbatch=2)
    x = torch.randn(6, 8)
    out = model(x)
    ref_out = ref(x)
    assert isinstance(out, BatchResult) and out.metadata["source"] == "nested"
    for got, want in zip(out.outputs, ref_out.outputs):
        assert_close(got, want.detach(), "nested output")
    assert_close(out.metadata["norm"], ref_out.metadata["norm"], "metadata tensor")
    (out.outputs[0].sum() + out.outputs[1].pow(2).sum()).backward()
    (ref_out.outputs[0].sum() + ref_out.outputs[1].pow(2).sum()).backward()
    _assert_grads(model, ref)

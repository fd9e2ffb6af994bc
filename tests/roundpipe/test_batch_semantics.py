"""Batch semantics the user guide publishes, checked against plain PyTorch on the whole batch:
0-d tensors replicated and handed back as given, ``None`` passing through, uneven batches
(a warning, ``torch.tensor_split`` sizes), a real (forward, backward) event pair per microbatch
on CPU virtual devices, and differing non-tensor outputs refused by name."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import assert_close
from torch import nn
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

from roundpipe import RoundPipe, RoundPipePackedData, RoundPipeRunConfig
from roundpipe.batch import Batch, MicrobatchMergeError, merge_microbatches
from roundpipe.devices.link import CopyEngine
from roundpipe.devices.virtual_backend import CpuEvent
from roundpipe.run_config import FullRoundPipeRunConfig


def _cfg(**kw) -> FullRoundPipeRunConfig:
    return FullRoundPipeRunConfig(RoundPipeRunConfig(**kw), RoundPipeRunConfig())


def _rp(net: nn.Module, **kw) -> RoundPipe:
    return RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(**kw))


def _chain(layers: nn.Sequential, *args):
    """Plain PyTorch through ``layers``, tuples spread over the next layer's arguments (as
    RoundPipe passes a layer's tuple output on)."""
    for layer in layers:
        args = layer(*args)
        args = args if isinstance(args, tuple) else (args,)
    return args


def _assert_grads(model: RoundPipe, ref: nn.Module) -> None:
    for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad {name}")


class _Scale(nn.Module):
    """``(lin(x) * scale, step)``: ``scale`` a float 0-d tensor, ``step`` handed back."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, scale, step):
        return torch.tanh(self.lin(x)) * scale, step


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, h, step):
        return self.lin(h), step


# -- 1. 0-d tensors: replicated, handed back as given -----------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_zero_dim_argument_is_replicated_to_every_microbatch(n):
    step = torch.tensor(233)
    for spec in (None, (TensorChunkSpec(0), None)):  # a spec prefix covers the 0-d leaf too
        b = Batch(
            (torch.ones(6, 2), step),
            {"t": torch.tensor(0.5)},
            _cfg(num_microbatch=n, split_input=spec),
        )
        assert b.num_microbatch == n
        for leaves in b.flatten_states:
            assert leaves[0].shape == (6 // n, 2)
            assert leaves[1] is step and float(leaves[2]) == 0.5


@pytest.mark.parametrize("n", [2, 3])
def test_zero_dim_output_comes_back_as_given(two_devices, n):
    """233 stays 233 (int64) at any microbatch count; the float scale feeds the model as in
    plain PyTorch, and its gradient (and every parameter's) equals the whole batch's."""
    ref = nn.Sequential(_Scale(), _Head())
    model = _rp(copy.deepcopy(ref), num_microbatch=n)
    x, y = torch.randn(6, 8), torch.randn(6, 1)
    step = torch.tensor(233)
    scale = torch.tensor(1.5, requires_grad=True)
    scale_ref = scale.detach().clone().requires_grad_(True)
    out, step_out = model(x, scale, step)
    assert step_out.dtype == torch.int64 and step_out.shape == () and int(step_out) == 233
    ref_out, _ = _chain(ref, x, scale_ref, step)
    assert_close(out, ref_out.detach(), "output")
    loss = nn.functional.mse_loss(out, y)
    ref_loss = nn.functional.mse_loss(ref_out, y)
    loss.backward()
    ref_loss.backward()
    assert_close(loss.detach(), ref_loss.detach(), "loss")
    assert_close(scale.grad, scale_ref.grad, "grad of the replicated 0-d input")
    _assert_grads(model, ref)
    with torch.no_grad():
        assert int(model(x, scale, step)[1]) == 233


def test_zero_dim_in_forward_backward_equals_pytorch(two_devices):
    ref = nn.Sequential(_Scale(), _Head())
    model = _rp(copy.deepcopy(ref), num_microbatch=2)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    scale, step = torch.tensor(0.5), torch.tensor(7)
    loss, (out, step_out) = model.forward_backward(
        (x, scale, step),
        label=y,
        loss_fn=lambda o, t: nn.functional.mse_loss(o[0], t) / 2,
        return_outputs=True,
    )
    assert int(step_out) == 7 and step_out.dtype == torch.int64
    ref_loss = nn.functional.mse_loss(_chain(ref, x, scale, step)[0], y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    assert_close(out, _chain(ref, x, scale, step)[0].detach(), "outputs")
    _assert_grads(model, ref)


def test_zero_dim_merge_rules():
    """Scalars are averaged (the guide): a value every microbatch agrees on comes back as it
    was, dtype included; differing ones average (rows-weighted when microbatches differ)."""
    step = torch.tensor(233)
    assert merge_microbatches([step, step, step]) is step
    assert_close(merge_microbatches([torch.tensor(1.0), torch.tensor(4.0)]), torch.tensor(2.5))
    assert_close(merge_microbatches([torch.tensor(2), torch.tensor(5)]), torch.tensor(3.5))
    weighted = merge_microbatches([torch.tensor(1.0), torch.tensor(4.0)], rows=[3, 1])
    assert_close(weighted, torch.tensor(1.75))


# -- 2. None passes through ---------------------------------------------------------------------
class _Optional(nn.Module):
    """An optional mask and an optional extra output, both None in these tests."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, mask=None, bias=None):
        h = torch.tanh(self.lin(x))
        if mask is not None:
            h = h * mask
        if bias is not None:
            h = h + bias
        return {"h": h, "attn": None}


class _OptionalHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, out):
        assert out["attn"] is None
        return self.lin(out["h"]), out["attn"]


def test_none_arguments_reach_every_microbatch():
    for spec in (None, ((0, 0), {"bias": 0})):  # also where a spec chunks that position
        b = Batch(
            (torch.ones(4, 8), None), {"bias": None}, _cfg(num_microbatch=2, split_input=spec)
        )
        assert b.num_microbatch == 2
        for mb in b.outputs():
            args, kwargs = mb
            assert args[0].shape == (2, 8) and args[1] is None and kwargs["bias"] is None


@pytest.mark.parametrize("merge", [None, {"h": TensorChunkSpec(0), "attn": TensorChunkSpec(0)}])
def test_none_outputs_merge_to_none(two_devices, merge):
    ref = nn.Sequential(_Optional(), _OptionalHead())
    model = _rp(
        copy.deepcopy(ref), num_microbatch=2, merge_output=(merge and (TensorChunkSpec(0), None))
    )
    mid = _rp(nn.Sequential(copy.deepcopy(ref[0])), num_microbatch=2, merge_output=merge)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    out, attn = model(x, None, bias=None)
    assert attn is None
    h = mid(x, None, bias=None)
    assert h["attn"] is None
    ref_out, _ = ref(x)
    assert_close(h["h"], ref[0](x)["h"].detach(), "merged dict with a None leaf")
    assert_close(out, ref_out.detach(), "output")
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    nn.functional.mse_loss(ref_out, y).backward()
    _assert_grads(model, ref)


def test_none_outputs_pack_and_chain(two_devices):
    ref_a, ref_b = _Optional(), _OptionalHead()
    a = _rp(nn.Sequential(copy.deepcopy(ref_a)), num_microbatch=2, merge_output=False)
    b = _rp(nn.Sequential(copy.deepcopy(ref_b)), num_microbatch=2)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    packed = a(x)
    assert isinstance(packed["attn"], RoundPipePackedData) and list(packed["attn"]) == [None, None]
    loss = b.forward_backward(
        (packed,), label=y, loss_fn=lambda o, t: nn.functional.mse_loss(o[0], t) / 2
    )
    ref_loss = nn.functional.mse_loss(ref_b(ref_a(x))[0], y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    _assert_grads(a, ref_a)
    _assert_grads(b, ref_b)


# -- 3. uneven batches: a warning, tensor_split sizes, whole-batch results ----------------------
def test_uneven_batch_warns_and_splits_like_tensor_split():
    x = torch.arange(14.0).reshape(7, 2)
    with pytest.warns(UserWarning, match=r"size 7 \(args\[0\], dim 0\) splits into \[3, 2, 2\]"):
        b = Batch((x,), {}, _cfg(num_microbatch=3))
    assert [mb[0].shape[0] for mb in b.flatten_states] == [3, 2, 2]
    assert b.microbatch_rows == [3, 2, 2]
    assert_close(torch.cat([mb[0] for mb in b.flatten_states]), x, "chunks")
    with pytest.warns(UserWarning, match=r"kwargs\['m'\], dim 1\) splits into \[2, 1\]"):
        Batch((), {"m": torch.ones(2, 3)}, _cfg(num_microbatch=2, split_input=((), {"m": 1})))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an even batch does not warn
        Batch((torch.ones(6, 2),), {}, _cfg(num_microbatch=3))


class _MeanLoss(nn.Module):
    """Returns the batched prediction and its mean loss against the target (a 0-d output)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, t):
        p = self.lin(x)
        return p, nn.functional.mse_loss(p, t)


def test_uneven_batch_outputs_equal_the_whole_batch(two_devices):
    ref = _MeanLoss()
    model = _rp(nn.Sequential(copy.deepcopy(ref)), num_microbatch=3)
    x, t = torch.randn(7, 8), torch.randn(7, 1)
    with pytest.warns(UserWarning, match="does not divide into 3 microbatches"):
        p, loss = model(x, t)
    ref_p, ref_loss = ref(x, t)
    assert_close(p, ref_p.detach(), "predictions")
    assert_close(loss, ref_loss.detach(), "mean loss merged over [3, 2, 2] rows")
    loss.backward()
    ref_loss.backward()
    _assert_grads(model, ref)


def test_uneven_forward_backward_equals_the_whole_batch(two_devices):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model = _rp(copy.deepcopy(ref), num_microbatch=2)
    x, y = torch.randn(5, 8), torch.randn(5, 1)
    with pytest.warns(UserWarning, match=r"size 5 .*splits into \[3, 2\]"):
        loss = model.forward_backward((x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum() / 5)
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    _assert_grads(model, ref)


# -- 4. a real (forward, backward) event pair per microbatch -----------------------------------
@pytest.mark.parametrize("grad", [True, False], ids=["train", "infer"])
def test_packed_outputs_carry_cpu_event_pairs(two_devices, grad):
    ref = nn.Sequential(nn.Linear(8, 4), nn.Tanh())
    model = _rp(copy.deepcopy(ref), num_microbatch=2, merge_output=False)
    x = torch.randn(4, 8)
    with torch.set_grad_enabled(grad):
        packed = model(x)
    assert len(packed.transfer_event) == 2
    for fwd, bwd in packed.transfer_event:
        for ev in (fwd, bwd):
            assert isinstance(ev, CpuEvent) and ev.query()
            ev.synchronize()
            ev.wait()
    packed.synchronize()
    assert_close(torch.cat(list(packed)), ref(x).detach(), "packed values")


def test_forward_backward_packed_outputs_carry_event_pairs(two_devices):
    ref = nn.Sequential(nn.Linear(8, 1))
    model = _rp(copy.deepcopy(ref), num_microbatch=2, merge_output=False)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    loss, packed = model.forward_backward(
        (x,), label=y, loss_fn=lambda o, t: nn.functional.mse_loss(o, t) / 2, return_outputs=True
    )
    assert all(
        isinstance(f, CpuEvent) and isinstance(b, CpuEvent) for f, b in packed.transfer_event
    )
    packed.synchronize()
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    assert_close(torch.cat(list(packed)), ref(x).detach(), "packed outputs")
    _assert_grads(model, ref)


def test_cpu_event_has_the_cuda_event_interface():
    """Record on a (slow, modelled) copy lane: pending until the lane reaches it, then
    complete; never recorded: complete; elapsed_time between timed, recorded events."""
    engine = CopyEngine("event test", gbps=1e-4, threaded=True)  # 100 kB/s
    try:
        start, end = CpuEvent(enable_timing=True), CpuEvent(enable_timing=True)
        assert start.query() and end.query()  # never recorded: complete, as on CUDA
        start.record()
        engine.bulk.submit("upload", "test", 500)  # 5 ms on the lane
        end.record(engine.bulk)
        assert not end.query()
        end.wait()
        assert end.query()
        assert isinstance(start.elapsed_time(end), float) and start.elapsed_time(end) >= 0.0
        with pytest.raises(RuntimeError, match="enable_timing"):
            CpuEvent().elapsed_time(end)
        with pytest.raises(RuntimeError, match="recorded"):
            CpuEvent(enable_timing=True).elapsed_time(end)
    finally:
        engine.shutdown()


# -- 5. non-tensor outputs: equal ones merge, differing ones are an error -----------------------
class _FirstValue(nn.Module):
    """Returns the prediction, the batch rows (a Python int) and a float read off the input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        return self.lin(x), x.shape[0], float(x[0, 0])


def _halves(args, kwargs, n):
    (x,) = args
    return [(c,) for c in x.chunk(n)], [kwargs] * n


@pytest.mark.parametrize("grad", [True, False], ids=["train", "infer"])
def test_differing_non_tensor_output_is_an_error(two_devices, grad):
    model = _rp(nn.Sequential(_FirstValue()), num_microbatch=2, split_input=_halves)
    x = torch.randn(4, 8)
    x[0, 0], x[2, 0] = 1.25, -3.5
    with torch.set_grad_enabled(grad):
        with pytest.raises(MicrobatchMergeError, match=r"output\[2\].*1\.25.*-3\.5") as info:
            model(x)
    assert isinstance(info.value, ValueError)


def test_equal_non_tensor_output_merges_to_the_value(two_devices):
    ref = _FirstValue()
    model = _rp(nn.Sequential(copy.deepcopy(ref)), num_microbatch=2, split_input=_halves)
    x = torch.randn(4, 8)
    x[2, 0] = x[0, 0]  # both microbatches read the same float
    pred, rows, first = model(x)
    assert rows == 2 and first == float(x[0, 0])
    assert_close(pred, ref(x)[0].detach(), "prediction")
    pred.sum().backward()
    ref(x)[0].sum().backward()
    _assert_grads(model, ref)


def test_uneven_custom_split_rows_differ_by_name(two_devices):
    def uneven(args, kwargs, n):
        (x,) = args
        return [(x[:3],), (x[3:],)], [kwargs, kwargs]

    model = _rp(nn.Sequential(_FirstValue()), num_microbatch=2, split_input=uneven)
    with torch.no_grad(), pytest.raises(MicrobatchMergeError, match=r"output\[1\] differs.*\(3 in"):
        model(torch.randn(4, 8))


def test_replicate_merge_spec_refuses_differing_values():
    with pytest.raises(MicrobatchMergeError, match=r"output\['n'\] is replicated.*microbatch 1"):
        merge_microbatches([{"n": torch.tensor(1)}, {"n": torch.tensor(2)}], spec={"n": _Replicate})
    assert merge_microbatches([{"n": "a"}, {"n": "a"}], spec={"n": _Replicate}) == {"n": "a"}

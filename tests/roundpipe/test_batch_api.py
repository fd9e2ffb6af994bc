"""Seed 004's ``roundpipe.batch`` API, whole: transfer events, merge rules and specs, packed
outputs per leaf, packed batch sizes, custom split functions; and ``GradScaler.update``."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from helpers import assert_close, mlp
from torch import nn
from torch.distributed.pipelining.microbatch import (
    TensorChunkSpec,
    _CustomReducer,
    _Replicate,
    sum_reducer,
)

import roundpipe
from roundpipe import RoundPipe, RoundPipePackedData, RoundPipeRunConfig
from roundpipe.batch import (
    AvgReducer,
    Batch,
    MicrobatchSplitError,
    avg_reducer,
    guess_split_spec,
    merge_microbatches,
)
from roundpipe.devices.link import CopyEvent
from roundpipe.devices.virtual_backend import CpuEvent
from roundpipe.run_config import FullRoundPipeRunConfig


def _cfg(**kw) -> FullRoundPipeRunConfig:
    return FullRoundPipeRunConfig(RoundPipeRunConfig(**kw), RoundPipeRunConfig())


def _rp(net: nn.Module, **kw) -> RoundPipe:
    return RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(**kw))


class _CountingEvent:
    """An event whose synchronize() runs ``on_wait`` once (the transfer landing) and counts."""

    def __init__(self, on_wait=None) -> None:
        self.waits = 0
        self.on_wait = on_wait

    def synchronize(self) -> None:
        if self.waits == 0 and self.on_wait is not None:
            self.on_wait()
        self.waits += 1


def test_seed_names_import_from_where_the_seed_says():
    from roundpipe.batch import AvgReducer as A
    from roundpipe.batch import Batch as B
    from roundpipe.batch import RoundPipePackedData as P
    from roundpipe.batch import avg_reducer as a
    from roundpipe.batch import guess_split_spec as g
    from roundpipe.grad_scaler import GradScaler

    assert issubclass(A, _CustomReducer) and isinstance(a, A)
    assert roundpipe.RoundPipePackedData is P and issubclass(P, list)
    assert roundpipe.GradScaler is GradScaler and callable(g) and B is Batch
    spec, bs = guess_split_spec((torch.ones(4, 2), torch.ones(3)))
    assert bs == 4 and isinstance(spec[0], TensorChunkSpec) and isinstance(spec[1], _Replicate)


# -- 1. transfer events -----------------------------------------------------------------------
def test_packed_input_events_fill_the_batch():
    fwd = [_CountingEvent(), _CountingEvent()]
    bwd = [_CountingEvent(), None]
    packed = RoundPipePackedData([torch.ones(2, 3), torch.ones(2, 3)], list(zip(fwd, bwd)))
    b = Batch((packed,), {"mask": torch.ones(4)}, _cfg(num_microbatch=2))
    assert b.forward_events == [[fwd[0]], [fwd[1]]]
    assert b.backward_events == [[bwd[0]], []]
    assert [t.shape[0] for t, _ in b.flatten_states] == [2, 2]  # the mask follows the rows
    with pytest.raises(TypeError, match=r"transfer_event\[1\]"):
        RoundPipePackedData([1, 2], [None, (object(), None)])
    with pytest.raises(ValueError, match="one \\(forward_event, backward_event\\) per"):
        RoundPipePackedData([1, 2], [None])


def test_forward_waits_for_packed_data_still_in_flight(two_devices):
    """The packed values are NaN until their (virtual-device) event completes, 0.2 s later
    on another thread: a RoundPipe model reading them early would output NaN."""
    ref = mlp(3)
    model = _rp(copy.deepcopy(ref), num_microbatch=2)
    x = torch.randn(4, 8)
    chunks = [torch.full((2, 8), float("nan")) for _ in range(2)]
    events = [CopyEvent("d2h", "test", done=False) for _ in range(2)]

    def land() -> None:
        for c, src, ev in zip(chunks, x.tensor_split(2), events):
            c.copy_(src)
            ev.record()  # not a copy lane: completes now

    packed = RoundPipePackedData(chunks, [(ev, None) for ev in events])
    timer = threading.Timer(0.2, land)
    timer.start()
    with torch.no_grad():
        out = model(packed)
    timer.join()
    assert_close(out, ref(x).detach(), "output of packed data that landed late")


@pytest.mark.parametrize("mode", ["autograd", "forward_backward"])
def test_backward_waits_for_packed_backward_events(two_devices, mode):
    ref = mlp(4)
    model = _rp(copy.deepcopy(ref), num_microbatch=2)
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = torch.randn(4, 1)
    chunks = list(x.tensor_split(2))
    fwd, bwd = [_CountingEvent(), _CountingEvent()], [_CountingEvent(), _CountingEvent()]
    packed = RoundPipePackedData(chunks, list(zip(fwd, bwd)))
    if mode == "autograd":
        out = model(packed)
        assert [e.waits for e in fwd] == [1, 1] and [e.waits for e in bwd] == [0, 0]
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
    else:
        loss = model.forward_backward(
            (packed,), label=y, loss_fn=lambda o, t: nn.functional.mse_loss(o, t) / 2
        )
        assert all(e.waits >= 1 for e in fwd)
    assert all(e.waits >= 1 for e in bwd)
    ref_loss = nn.functional.mse_loss(ref(x_ref), y)
    ref_loss.backward()
    assert_close(loss.detach(), ref_loss.detach(), "loss")
    assert_close(x.grad, x_ref.grad, "input grad through packed data")
    for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad {name}")


@pytest.mark.parametrize("grad", [True, False], ids=["train", "infer"])
def test_packed_outputs_carry_real_transfer_events(two_devices, grad):
    a = _rp(mlp(3), num_microbatch=2, merge_output=False)
    with torch.set_grad_enabled(grad):
        packed = a(torch.randn(4, 8))
    assert isinstance(packed, RoundPipePackedData) and len(packed.transfer_event) == 2
    for fwd_ev, bwd_ev in packed.transfer_event:
        assert isinstance(fwd_ev, CpuEvent) and fwd_ev.query()
        # without a backward here, the consumer's backward reads the data its forward read
        assert bwd_ev is fwd_ev
    packed.synchronize()
    b = Batch((packed,), {}, _cfg(num_microbatch=2))
    assert b.forward_events == [[e] for e, _ in packed.transfer_event]


# -- 2. merging scalars and non-tensors -------------------------------------------------------
class _Stats(nn.Module):
    """Returns a batched tensor with integer / bool scalars and plain Python values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        y = self.lin(x)
        return {
            "y": y,
            "loss": (y**2).mean(),
            "positive": (y > 0).sum(),  # int64 0-d
            "any_positive": (y > 0).any(),  # bool 0-d
            "rows": x.shape[0],  # Python int, equal per microbatch
            "tag": "stats",
            "nothing": None,
        }


@pytest.mark.parametrize("grad", [True, False], ids=["train", "infer"])
def test_integer_and_bool_scalars_and_python_values_merge(two_devices, grad):
    """The user guide's rules: scalar tensors (integer and bool ones too) are averaged, equal
    non-tensors kept once (differing ones: tests/roundpipe/test_batch_semantics.py)."""
    ref = _Stats()
    model = _rp(nn.Sequential(copy.deepcopy(ref)), num_microbatch=2)
    x = torch.randn(6, 8)
    with torch.set_grad_enabled(grad):
        out = model(x)
    y = ref(x)["y"].detach()
    assert_close(out["y"], y, "y")
    halves = y.tensor_split(2)
    counts = [float((h > 0).sum()) for h in halves]
    flags = [float((h > 0).any()) for h in halves]
    assert float(out["positive"]) == sum(counts) / 2
    assert float(out["any_positive"]) == sum(flags) / 2
    assert out["rows"] == 3 and out["tag"] == "stats" and out["nothing"] is None
    assert_close(out["loss"], (y**2).mean(), "loss")
    if grad:
        out["loss"].backward()
        (ref(x)["loss"]).backward()
        for p, q in zip(model.model.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, "grad through a dict output")


# -- 3. pipelining specs ----------------------------------------------------------------------
class _Scaled(nn.Module):
    """x: batch on dim 0; bias: replicated; weight (kwarg): batch on dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, bias, weight=None):
        y = (self.lin(x) + bias) * weight.t()
        return {"y": y, "loss": (y**2).mean(), "width": y.shape[1]}


@pytest.mark.parametrize(
    "split_input",
    [
        ((TensorChunkSpec(0), _Replicate), {"weight": TensorChunkSpec(1)}),
        ((TensorChunkSpec(0), _Replicate()), {"weight": 1}),
        ((0, None), {"weight": TensorChunkSpec(1)}),
    ],
    ids=["class", "instance", "ints"],
)
def test_pipelining_split_and_merge_specs_equal_pytorch(two_devices, split_input):
    ref = _Scaled()
    merge = {"y": TensorChunkSpec(0), "loss": avg_reducer, "width": _Replicate}
    model = _rp(
        nn.Sequential(copy.deepcopy(ref)),
        num_microbatch=2,
        split_input=split_input,
        merge_output=merge,
    )
    x, bias, weight = torch.randn(6, 8), torch.randn(4), torch.randn(1, 6)
    out = model(x, bias, weight=weight)
    ref_out = ref(x, bias, weight=weight)
    assert_close(out["y"], ref_out["y"].detach(), "y")
    assert out["width"] == 4
    assert_close(out["loss"], ref_out["loss"].detach(), "avg_reducer loss")
    out["loss"].backward()
    ref_out["loss"].backward()
    for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad {name}")


def test_sum_reducer_and_prefix_specs(two_devices):
    ref = _Scaled()
    model = _rp(
        nn.Sequential(copy.deepcopy(ref)),
        num_microbatch=3,
        # (args_spec, kwargs_spec) with one spec leaf per side covering the whole subtree
        split_input=(TensorChunkSpec(0), None),
        merge_output={"y": TensorChunkSpec(0), "loss": sum_reducer, "width": None},
    )
    x, bias = torch.randn(6, 8), torch.randn(6, 4)  # a batched "bias": chunked with x
    weight = torch.randn(1, 1)  # kwargs: replicated
    out = model(x, bias, weight=weight)
    per_mb = [ref(xc, bc, weight=weight) for xc, bc in zip(x.tensor_split(3), bias.tensor_split(3))]
    assert_close(out["loss"], sum(o["loss"] for o in per_mb).detach(), "sum_reducer loss")
    assert_close(out["y"], torch.cat([o["y"] for o in per_mb]).detach(), "y")


def test_bad_specs_raise_typed_errors():
    with pytest.raises(TypeError, match="merge_output"):
        RoundPipeRunConfig(merge_output=("cat",))
    with pytest.raises(TypeError, match="split_input"):
        RoundPipeRunConfig(split_input={"x": "rows"})
    with pytest.raises(TypeError, match="split_label"):
        RoundPipeRunConfig(split_label=[sum_reducer])  # reducers merge, they do not split
    RoundPipeRunConfig(merge_output=_Replicate, split_input=_Replicate)  # a class, yet a spec
    with pytest.raises(ValueError, match=r"split_input.*\[1\]\['weight'\]"):
        Batch(
            (torch.ones(2, 2),),
            {"weight": torch.ones(2)},
            _cfg(split_input=((0,), {"weight": (0,)})),
        )
    with pytest.raises(ValueError, match="keys"):
        Batch((torch.ones(2, 2),), {"w": torch.ones(2)}, _cfg(split_input=((0,), {"v": 0})))
    with pytest.raises(ValueError, match="replicated but microbatch 1 differs"):
        merge_microbatches([torch.ones(1), torch.zeros(1)], spec=_Replicate())


def test_avg_reducer_refuses_interleaved_reductions():
    r = AvgReducer()
    v = r.reduce(None, torch.tensor(1.0))
    r.reduce(None, torch.tensor(5.0))  # a second reduction starts
    with pytest.raises(AssertionError, match="two reductions"):
        r.reduce(v, torch.tensor(3.0))


# -- 4. merge_output=False: per leaf ----------------------------------------------------------
class _TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h, h.sum(1, keepdim=True)


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, h, s):
        return self.lin(h) + s


def test_unmerged_output_is_packed_per_leaf_and_chains(two_devices):
    ref_a, ref_b = _TwoOut(), _Join()
    a = _rp(nn.Sequential(copy.deepcopy(ref_a)), num_microbatch=2, merge_output=False)
    b = _rp(nn.Sequential(copy.deepcopy(ref_b)), num_microbatch=2)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    packed = a(x)
    assert type(packed) is tuple and len(packed) == 2
    assert all(isinstance(p, RoundPipePackedData) and len(p) == 2 for p in packed)
    ref_h, ref_s = ref_a(x)
    for p, r in zip(packed, (ref_h, ref_s)):
        for mb, rc in zip(p, r.tensor_split(2)):
            assert_close(mb, rc.detach(), "packed microbatch value")
    loss = b.forward_backward(
        packed, label=y, loss_fn=lambda o, t: nn.functional.mse_loss(o, t) / 2
    )
    ref_loss = nn.functional.mse_loss(ref_b(ref_h, ref_s), y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "chained loss")
    params = list(a.model.parameters()) + list(b.model.parameters())
    for p, q in zip(params, list(ref_a.parameters()) + list(ref_b.parameters())):
        assert_close(p.grad, q.grad, "chained grads")


# -- 5. automatic split: packed batch size, replicated tensors --------------------------------
class _WithTable(nn.Module):
    """h: batch rows; table: (3, 1), not batched; rowscale: batch rows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, h, table, rowscale):
        return (self.lin(h) @ table) * rowscale[:, None]


def test_auto_split_uses_packed_rows_and_replicates_other_tensors(two_devices):
    torch.manual_seed(0)
    ref_a, ref_b = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), _WithTable()

    def uneven(args, kwargs, n):  # microbatches of 1 and 3 rows
        (x,) = args
        return [(x[:1],), (x[1:],)], [kwargs, kwargs]

    a = _rp(copy.deepcopy(ref_a), num_microbatch=2, split_input=uneven, merge_output=False)
    b = _rp(nn.Sequential(copy.deepcopy(ref_b)), num_microbatch=2)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    table, rowscale = torch.randn(3, 1), torch.randn(4)
    packed = a(x)
    assert [t.shape[0] for t in packed] == [1, 3]
    spec, bs = guess_split_spec((packed, table, rowscale))
    assert bs == 4 and isinstance(spec[1], _Replicate) and isinstance(spec[2], TensorChunkSpec)
    batch = Batch((packed, table, rowscale), {}, _cfg(num_microbatch=2))
    assert [leaves[2].shape[0] for leaves in batch.flatten_states] == [1, 3]
    assert all(leaves[1] is table for leaves in batch.flatten_states)
    loss = b.forward_backward(
        (packed, table, rowscale),
        label=y,
        loss_fn=lambda o, t: ((o - t) ** 2).sum() / 4,
    )
    ref_loss = ((ref_b(ref_a(x), table, rowscale) - y) ** 2).sum() / 4
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    params = list(a.model.parameters()) + list(b.model.parameters())
    for p, q in zip(params, list(ref_a.parameters()) + list(ref_b.parameters())):
        assert_close(p.grad, q.grad, "grads")


# -- 6. custom split functions ----------------------------------------------------------------
def test_split_function_returning_args_list_and_kwargs_list(two_devices):
    ref = _Scaled()
    bias, weight = torch.randn(4), torch.randn(1, 6)

    def split(args, kwargs, n):
        x, b = args
        xs, ws = x.tensor_split(n), kwargs["weight"].tensor_split(n, dim=1)
        return [(xc, b) for xc in xs], [{"weight": w} for w in ws]

    model = _rp(nn.Sequential(copy.deepcopy(ref)), num_microbatch=2, split_input=split)
    x = torch.randn(6, 8)
    out = model(x, bias, weight=weight)
    ref_out = ref(x, bias, weight=weight)
    assert_close(out["y"], ref_out["y"].detach(), "y")
    assert_close(out["loss"], ref_out["loss"].detach(), "loss")
    out["loss"].backward()
    ref_out["loss"].backward()
    for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad {name}")


@pytest.mark.parametrize(
    "ret, match",
    [
        ({"a": 1}, "args_list, kwargs_list"),
        ([], "args_list, kwargs_list"),
        ([(1, 2, 3)], "args_list, kwargs_list"),
        (([(1,), (2,)], [{}]), "2 args and 1 kwargs"),
        ([((1,), {}), ("x", {})], "microbatch 1"),
        ([((1,), {}), ((2,), [])], "microbatch 1"),
    ],
)
def test_malformed_split_function_returns_raise(ret, match):
    cfg = _cfg(num_microbatch=2, split_input=lambda a, k, n: ret)
    with pytest.raises(MicrobatchSplitError, match=match) as info:
        Batch((torch.ones(2, 2),), {}, cfg)
    assert isinstance(info.value, TypeError) and isinstance(info.value, AssertionError)


def test_malformed_split_label_returns_raise():
    cfg = _cfg(num_microbatch=2, split_label=lambda lab, n: lab)
    with pytest.raises(MicrobatchSplitError, match="split_label must return a list of 2"):
        Batch((torch.ones(2, 2),), {}, cfg, label=torch.ones(2))


# -- 7. GradScaler.update(is_async=...) -------------------------------------------------------
@pytest.mark.parametrize("step_async", [False, True], ids=["sync_step", "async_step"])
@pytest.mark.parametrize("update_async", [False, True], ids=["sync_update", "async_update"])
def test_grad_scaler_update_follows_torch(two_devices, step_async, update_async):
    """Overflowing steps back the scale off, growth_interval clean steps grow it: the scale
    after each update equals torch.amp.GradScaler's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 1))
    ref = copy.deepcopy(net)
    model = _rp(net, num_microbatch=2)
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    scaler = roundpipe.GradScaler(init_scale=2.0**4, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2)
    overflow = [False, False, False, True, True, False, False, False, True]
    for i, bad in enumerate(overflow):
        x, y = torch.randn(4, 4), torch.randn(4, 1)
        if bad:
            x[0, 0] = float("inf")
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=step_async)
        scaler.update(is_async=update_async)
        ref_scaler.scale(nn.functional.mse_loss(ref(x), y)).backward()
        used = ref_scaler.get_scale()  # the scale this step's loss was multiplied by
        ref_scaler.step(ref_opt)
        ref_opt.zero_grad()
        ref_scaler.update()
        if update_async:  # the finished step's scale until the pending one is asked for
            assert scaler.get_scale() == used, f"scale of step {i}"
            assert scaler.get_scale(up_to_date=True) == ref_scaler.get_scale()
        # is_async=False: the new scale is in place on return, with no other synchronization
        assert scaler.get_scale() == ref_scaler.get_scale(), f"scale after step {i}"
        if step_async:  # the next iteration runs on the updated parameters, as torch's does
            model.synchronize()
    model.synchronize()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p, q, "params with grad scaling")
    scaler.update(new_scale=3.0, is_async=False)
    assert scaler.get_scale() == 3.0
    with pytest.raises(TypeError, match="is_async"):
        scaler.update(is_async="no")


@pytest.mark.parametrize(
    "name", ["batch", "grad_scaler", "run_config", "runtime.split_spec", "seed_paths"]
)
def test_docstring_examples(two_devices, name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"roundpipe.{name}"))
    assert result.attempted > 0 and result.failed == 0

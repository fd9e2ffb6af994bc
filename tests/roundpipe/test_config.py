"""Run config, microbatching, planning and import hygiene."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe.batch import Batch, TensorChunkSpec, guess_split_spec, merge_microbatches
from roundpipe.devices.units import parse_bytes
from roundpipe.run_config import FullRoundPipeRunConfig
from roundpipe.scheduler import partition_layers


def test_import_touches_no_device():
    code = (
        "import roundpipe, roundpipe.device as d; import torch; "
        "assert not d.device_list; assert not torch.cuda.is_initialized(); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


@pytest.mark.parametrize(
    "kwargs, err",
    [
        (dict(num_microbatch=0), ValueError),
        (dict(num_microbatch=2.5), ValueError),
        (dict(recompute_grain="block"), ValueError),
        (dict(requires_grad="yes"), TypeError),
        (dict(output_device="nowhere"), ValueError),
        (dict(merge_output=3), TypeError),
        (dict(execute_plan=[range(0, 2)]), TypeError),
    ],
)
def test_bad_run_config_raises(kwargs, err):
    with pytest.raises(err, match=next(iter(kwargs))):
        RoundPipeRunConfig(**kwargs)


def test_full_config_merges_call_over_model(two_devices):
    full = FullRoundPipeRunConfig(
        RoundPipeRunConfig(num_microbatch=5),
        RoundPipeRunConfig(num_microbatch=2, recompute_grain="layer"),
    )
    assert (full.num_microbatch, full.recompute_grain, full.preserve_rng_state) == (
        5,
        "layer",
        True,
    )
    assert FullRoundPipeRunConfig(RoundPipeRunConfig(), RoundPipeRunConfig()).num_microbatch == 3


def test_guess_split_spec_and_split():
    data = ((torch.ones(6, 2), torch.ones(3)), {"mask": torch.ones(6), "flag": True})
    spec, bs = guess_split_spec(data)
    assert bs == 6
    assert isinstance(spec[0][0], TensorChunkSpec) and not isinstance(spec[0][1], TensorChunkSpec)
    cfg = FullRoundPipeRunConfig(RoundPipeRunConfig(num_microbatch=4), RoundPipeRunConfig())
    b = Batch(data[0], data[1], cfg)
    assert b.num_microbatch == 4
    sizes = [leaves[0].shape[0] for leaves in b.flatten_states]
    assert sizes == [2, 2, 1, 1]


def test_more_microbatches_than_samples_and_unbatched():
    cfg = FullRoundPipeRunConfig(RoundPipeRunConfig(num_microbatch=8), RoundPipeRunConfig())
    assert Batch((torch.ones(3, 2),), {}, cfg).num_microbatch == 3
    assert Batch((torch.tensor(1.0), "x"), {}, cfg).num_microbatch == 1


def test_custom_split_specs():
    cfg = FullRoundPipeRunConfig(
        RoundPipeRunConfig(
            num_microbatch=2, split_input=((1,), {}), split_label=lambda lab, n: list(lab.chunk(n))
        ),
        RoundPipeRunConfig(),
    )
    b = Batch((torch.arange(8).view(2, 4),), {}, cfg, label=torch.arange(4))
    assert b.flatten_states[0][0].tolist() == [[0, 1], [4, 5]]
    assert [x.tolist() for x in b.label_list] == [[0, 1], [2, 3]]
    bad = FullRoundPipeRunConfig(RoundPipeRunConfig(split_input=((1, 1),)), RoundPipeRunConfig())
    with pytest.raises(ValueError, match="split_input"):
        Batch((torch.ones(2, 2),), {}, bad)


def test_merge_microbatches_rules():
    outs = [
        {"y": torch.ones(2, 1), "loss": torch.tensor(1.0), "n": 3},
        {"y": torch.zeros(1, 1), "loss": torch.tensor(3.0), "n": 3},
    ]
    merged = merge_microbatches(outs)
    assert merged["y"].shape == (3, 1) and merged["loss"].item() == 2.0 and merged["n"] == 3


def test_partition_respects_time_and_memory():
    stages = partition_layers([1.0] * 8, [10.0] * 8, 2, 2.0, 1000)
    assert [len(s) for s in stages] == [2, 2, 2, 2]
    stages = partition_layers([1.0] * 8, [10.0] * 8, 2, 100.0, 25)
    assert all(len(s) <= 2 for s in stages)
    stages = partition_layers([1.0] * 4, [1.0] * 4, 4, 100.0, 1000)
    assert len(stages) == 4
    with pytest.raises(ValueError, match="model_memory_limit"):
        partition_layers([1.0], [100.0], 1, 1.1, 10)


def test_check_valid_rejects_bad_plans():
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 2), range(3, 4)]
    plan.bwd_plan = [range(2, 4), range(0, 2)]
    with pytest.raises(ValueError, match="contiguously"):
        plan.check_valid(4, "train")
    plan.fwd_plan = [range(0, 2), range(2, 4)]
    plan.check_valid(4, "train")
    plan.bwd_plan = [range(3, 4), range(0, 3)]
    with pytest.raises(ValueError, match="fused"):
        plan.check_valid(4, "fused")
    with pytest.raises(ValueError, match="covers"):
        plan.check_valid(5, "infer")
    with pytest.raises(ValueError, match="run_type"):
        plan.check_valid(4, "eval")


def test_auto_plan_is_valid(two_devices):
    model = RoundPipe(nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]), pin_model="off")
    for run_type in ("infer", "train", "fused"):
        plan = ModelExecutePlan.auto(run_type, model)
        plan.check_valid(6, run_type)
        assert len(plan.fwd_plan) >= 2


def test_bad_plan_in_config_raises_before_running(two_devices):
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 1)]
    model = RoundPipe(
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
        pin_model="off",
        model_run_config=RoundPipeRunConfig(execute_plan=plan),
    )
    with pytest.raises(ValueError, match="covers"), torch.no_grad():
        model(torch.ones(2, 2))


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(pin_model="yes"), ValueError, "pin_model"),
        (dict(layers=[nn.Linear(2, 2), "relu"]), TypeError, "layers"),
        (dict(layers=[]), ValueError, "layers"),
        (dict(model_run_config={}), TypeError, "model_run_config"),
    ],
)
def test_bad_wrapper_arguments(two_devices, kwargs, err, match):
    with pytest.raises(err, match=match):
        RoundPipe(nn.Sequential(nn.Linear(2, 2)), **kwargs)


def test_bad_device_settings():
    with pytest.raises(ValueError, match="num_virtual"):
        roundpipe.init_devices(num_virtual=0)
    with pytest.raises(ValueError, match="memory_limit"):
        roundpipe.init_devices(num_virtual=1, memory_limit="lots")
    assert parse_bytes("1.5KiB") == 1536


@pytest.mark.parametrize(
    "args, label, why",
    [
        ((torch.randn(2, 8),), torch.randn(2, 1), "only 2 rows"),
        ((torch.randn(3, 8),), torch.randn(3, 1), "only 3 rows"),
    ],
)
def test_forward_backward_refuses_fewer_microbatches_than_configured(two_devices, args, label, why):
    """num_microbatch=4 on a 2-row batch used to run 2 microbatches: a loss_fn dividing by
    4 then scaled every gradient by 2/4. It is an error now, raised before any gradient."""
    net = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    model = RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=4))
    with pytest.raises(ValueError, match=f"num_microbatch=4.*{why}.*at least 4 rows") as info:
        model.forward_backward(args, label=label, loss_fn=lambda o, y: ((o - y) ** 2).mean() / 4)
    assert f"num_microbatch={args[0].shape[0]}" in str(info.value)  # the way out
    assert all(p.grad is None for p in net.parameters())
    # the suggested per-call config works, and the result is the whole batch's mean loss
    n = args[0].shape[0]
    loss = model.forward_backward(
        args,
        label=label,
        loss_fn=lambda o, y: ((o - y) ** 2).mean() / n,
        run_config=RoundPipeRunConfig(num_microbatch=n),
    )
    torch.testing.assert_close(loss, ((net(args[0]) - label) ** 2).mean().detach())


def test_forward_still_runs_a_short_batch_in_fewer_microbatches(two_devices):
    """Plain forward merges the outputs, so the count does not matter there: no error."""
    net = nn.Sequential(nn.Linear(8, 1))
    model = RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=4))
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), net(x))


def test_uneven_microbatches_merge_scalar_losses_as_the_batch_mean(two_devices):
    """5 rows in 3 microbatches (2, 2, 1): a per-microbatch mean loss merges, weighted by
    rows, into the mean over the batch, and so do its gradients."""

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x, y):
            return ((self.lin(x) - y) ** 2).mean()

    torch.manual_seed(0)
    ref = WithLoss()
    net = WithLoss()
    net.load_state_dict(ref.state_dict())
    model = RoundPipe(
        nn.Sequential(net), pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    x, y = torch.randn(5, 8), torch.randn(5, 1)
    loss = model(x, y)
    loss.backward()
    ref_loss = ref(x, y)
    ref_loss.backward()
    # per-microbatch sums then a weighted mean: float32 rounding differs from one mean
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(net.lin.weight.grad, ref.lin.weight.grad)
    merged = merge_microbatches([torch.tensor(1.0), torch.tensor(4.0)], rows=[2, 1])
    assert merged.item() == 2.0


def test_wrapping_a_model_without_parameters_says_so(two_devices):
    with pytest.raises(ValueError, match=r"model \(Sequential\) has no layers"):
        roundpipe.wrap_model_to_roundpipe(nn.Sequential())
    with pytest.raises(ValueError, match="has no parameters or buffers"):
        roundpipe.wrap_model_to_roundpipe(nn.Sequential(nn.ReLU()))

"""Calibration of a device file on this machine (slapo.plan.calibrate).

No timing is asserted (the machine is shared): the tests check the file's structure, that the
counts behind each rate follow the step-time counter's conventions, that the link fit inverts
:meth:`Link.seconds`, and that bad arguments are named.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from slapo.exceptions import SlapoError
from slapo.plan import PRESETS, calibrate_device, write_calibration
from slapo.plan.calibrate import (
    _attention_flops,
    _fit_link,
    _ring,
    calibrate_collectives,
    calibrate_shapes,
)
from slapo.plan.hardware import OP_KINDS, DeviceSpecError, Link, load_device
from slapo.plan.step_time import StepCounter


@pytest.fixture(scope="module")
def cpu_file(tmp_path_factory):
    """One quick CPU calibration with two gloo processes, written to a device file."""
    path = tmp_path_factory.mktemp("calibrate") / "cpu.json"
    return path, write_calibration(path, device="cpu", quick=True, world=2)


@pytest.mark.distributed
def test_cpu_calibration_file_round_trips(cpu_file) -> None:
    path, spec = cpu_file
    data = json.loads(path.read_text())  # valid JSON, every field written
    assert set(data) == {f.name for f in dataclasses.fields(spec)}
    assert load_device(path) == spec
    assert [p.name for p in path.parent.iterdir()] == ["cpu.json"]  # atomic: no temporary left
    assert spec.name == "cpu-calibrated"


@pytest.mark.distributed
def test_cpu_calibration_states_measured_rates(cpu_file) -> None:
    _, spec = cpu_file
    assert set(spec.peak_tflops) == {"bf16"} and spec.peak_tflops["bf16"] > 0
    assert set(spec.efficiency) == set(OP_KINDS)
    assert all(0 < v <= 1 for v in spec.efficiency.values())
    # no datasheet: the measured rates are the peaks, attention relative to the matmul's
    assert {k: spec.efficiency[k] for k in ("matmul", "memory", "collective")} == {
        "matmul": 1.0, "memory": 1.0, "collective": 1.0,
    }  # fmt: skip
    assert spec.hbm_gbps > 0 and spec.intra_node.gbps > 0 and spec.intra_node.latency_us >= 0
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert spec.hbm_gib == pytest.approx(ram, rel=1e-3)
    assert spec.source.startswith("calibrated on ")
    assert f"torch {torch.__version__}" in spec.source
    assert "gloo x2" in spec.source and "sdpa causal" in spec.source
    # FSDP2's own work per unit and a pipeline's per microbatch, timed on the same two
    # processes; a transformer's op overhead, and its selective checkpoint's per op
    assert spec.engine_overhead_us["fsdp_unit"] > 0 and "FSDP2" in spec.source
    assert spec.engine_overhead_us["pipeline_microbatch"] > 0 and "1F1B" in spec.source
    assert spec.op_overhead_us > 0 and "per op" in spec.source
    assert spec.engine_overhead_us["sac_op"] > 0 and "selective checkpoint" in spec.source


@pytest.mark.distributed
def test_collective_calls_are_timed_in_groups_of_their_size() -> None:
    keys = ["all_reduce 8192B x2", "all_gather 4096B x2", "reduce_scatter 8192B x2"]
    base = PRESETS["h200"]
    spec = calibrate_collectives(base, keys, quick=True)
    assert sorted(spec.collective_us) == sorted(keys)
    assert all(us > 0 for us in spec.collective_us.values())
    assert dataclasses.replace(spec, collective_us={}) == base  # nothing else changes


@pytest.mark.parametrize(
    "keys, named",
    [
        (["all_reduce 8192 x2"], "cannot read collective key"),
        (["broadcast 8192B x2"], "cannot read collective key"),
        (["all_reduce 8192B x1"], "cannot read collective key"),
        (["all_reduce 8190B x2"], "cannot read collective key"),
    ],
)
def test_bad_collective_keys_are_named(keys, named: str) -> None:
    with pytest.raises(DeviceSpecError, match=named):
        calibrate_collectives(PRESETS["h200"], keys)


def test_a_world_that_splits_no_group_is_named() -> None:
    with pytest.raises(DeviceSpecError, match="multiple of every group size"):
        calibrate_collectives(PRESETS["h200"], ["all_reduce 64B x2"], world=3)


def test_shapes_are_measured_at_the_ranks_thread_count() -> None:
    keys = ["matmul fp32 64x48x32 nn", "matmul fp32 2x16x8x4 nt", "matmul fp32 64x48x32 tn",
            "attention fwd fp32 4x32x32x16 causal", "attention bwd fp32 4x32x32x16 causal"]  # fmt: skip
    base = PRESETS["h200"]
    spec = calibrate_shapes(base, keys, threads=1, quick=True)
    assert sorted(spec.op_tflops) == sorted(f"{k} @1t" for k in keys)
    assert all(rate > 0 for rate in spec.op_tflops.values())
    assert dataclasses.replace(spec, op_tflops={}) == base  # nothing else changes
    before = torch.get_num_threads()
    calibrate_shapes(base, keys[:1], threads=1, quick=True)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("keys", "threads", "named"),
    [
        (["matmul fp32 64x48"], None, "cannot read shape key"),
        (["conv fp32 1x2x3"], None, "cannot read shape key"),
        (["attention sideways fp32 1x2x3x4"], None, "cannot read shape key"),
        (["matmul fp32 8x8x8"], None, "cannot read shape key"),  # no operand layout
        (["matmul fp32 8x8x8 nx"], None, "cannot read shape key"),
        (["matmul fp32 8x8x8 nn"], 0, "threads"),
    ],
)
def test_bad_shape_keys_are_named(keys, threads, named: str) -> None:
    with pytest.raises(DeviceSpecError, match=named):
        calibrate_shapes(PRESETS["h200"], keys, threads=threads, quick=True)


def test_base_keeps_its_datasheet_and_takes_fractions() -> None:
    base = PRESETS["h200"]
    spec = calibrate_device("cpu", dtype="fp32", base=base, world=1, quick=True)
    assert spec.name == "h200-calibrated"
    assert spec.peak_tflops == base.peak_tflops and spec.hbm_gbps == base.hbm_gbps
    assert spec.hbm_gib == base.hbm_gib
    assert spec.intra_node == base.intra_node  # world=1: no collective timed, the base's link
    assert spec.efficiency["collective"] == base.efficiency["collective"]
    assert all(0 < v <= 1 for v in spec.efficiency.values())
    assert "collectives not timed" in spec.source and base.source in spec.source


def test_fp32_without_base_measures_bf16_too(monkeypatch) -> None:
    import slapo.plan.calibrate as cal

    seen = []
    monkeypatch.setattr(cal, "_matmul_tflops", lambda dev, dtype, plan: seen.append(dtype) or 2.0)
    monkeypatch.setattr(cal, "_collective_seconds", lambda world, backend, plan: {
        (op, n): Link(1.0, 10.0).seconds(_ring(op, n, world)[0], efficiency=1.0,
                                         messages=_ring(op, n, world)[1])
        for op in ("all_gather", "all_reduce") for n in plan.messages
    })  # fmt: skip
    spec = calibrate_device("cpu", dtype="fp32", quick=True, name="here")
    assert seen == [torch.float32, torch.bfloat16]
    assert spec.name == "here" and spec.peak_tflops == {"fp32": 2.0, "bf16": 2.0}
    assert spec.intra_node == Link(1.0, 10.0)


def test_a_fraction_above_one_is_clamped_with_a_warning() -> None:
    base = dataclasses.replace(PRESETS["h200"], peak_tflops={"bf16": 1e-9}, hbm_gbps=1e-9)
    with pytest.warns(UserWarning, match=r"efficiency\['matmul'\] clamped to 1\.0"):
        spec = calibrate_device("cpu", base=base, world=1, quick=True)
    assert spec.efficiency["matmul"] == spec.efficiency["memory"] == 1.0


@pytest.mark.parametrize("world", [2, 4, 8])
def test_link_fit_inverts_link_seconds(world: int) -> None:
    link = Link(37.5, 12.0)
    seconds = {}
    for op in ("all_gather", "all_reduce"):
        for nbytes in (4096, 2**26):
            sent, steps = _ring(op, nbytes, world)
            seconds[(op, nbytes)] = link.seconds(sent, efficiency=1.0, messages=steps)
    fit = _fit_link(seconds, world)
    assert fit.gbps == pytest.approx(link.gbps, rel=1e-3)
    assert fit.latency_us == pytest.approx(link.latency_us, rel=1e-3)


def test_attention_and_memory_counts_match_the_step_counter() -> None:
    b, h, s, d = 1, 2, 64, 16
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    with StepCounter() as counter:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
    counted = sum(n for (_, kind), n in counter.flops.items() if kind == "attention")
    assert _attention_flops(b, h, s, d) == counted
    a = torch.ones(1000)
    with StepCounter() as counter:
        torch.add(a, a)
    assert sum(counter.memory_bytes.values()) == 3 * a.numel() * a.element_size()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"device": "tpu"}, "device must be 'cpu' or 'cuda'"),
        ({"world": 0}, "world must be an int >= 1"),
        ({"world": True}, "world must be an int >= 1"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"base": "h200"}, "base must be a DeviceSpec"),
        ({"world": 1}, "base=PRESETS"),
        ({"quick": "yes"}, "quick must be True or False"),
        ({"name": ""}, "name must be a non-empty string"),
        ({"dtype": "fp16", "base": dataclasses.replace(PRESETS["h200"], peak_tflops={"bf16": 1.0})},
         r"no peak_tflops\['fp16'\]"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(kwargs, named: str) -> None:
    with pytest.raises(DeviceSpecError, match=named) as info:
        calibrate_device(**kwargs)
    assert isinstance(info.value, SlapoError)
    assert str(info.value).startswith("calibrate_device: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_named() -> None:
    with pytest.raises(DeviceSpecError, match="device='cuda' but torch sees no CUDA GPU"):
        calibrate_device("cuda", base=PRESETS["h200"], quick=True)

"""Device presets and device files (slapo.plan.hardware)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slapo.exceptions import SlapoError
from slapo.plan.hardware import PRESETS, ClusterSpec, DeviceSpecError, load_device, save_device
from slapo.throughput import PEAK_TFLOPS

#: preset -> the row of slapo.throughput's peak table it must agree with
_SAME_PEAKS = {
    "h100-sxm": "H100 SXM", "h200": "H200", "a100-80gb-sxm": "A100", "b200": "B200",
    "rtx-4090": "RTX 4090", "a800-80gb-sxm": "A800",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trips_through_a_file(tmp_path, name: str) -> None:
    path = save_device(PRESETS[name], tmp_path / f"{name}.json")
    assert load_device(path) == PRESETS[name]
    assert [p.name for p in tmp_path.iterdir()] == [f"{name}.json"]  # no temporary left
    assert PRESETS[name].source


@pytest.mark.parametrize(("name", "row"), sorted(_SAME_PEAKS.items()))
def test_preset_peaks_match_the_throughput_table(name: str, row: str) -> None:
    assert PRESETS[name].peak_tflops == PEAK_TFLOPS[row]


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("hbm_gbps", -1, "hbm_gbps"),
        ("peak_tflops", {"bf16": "fast"}, "peak_tflops.bf16"),
        ("efficiency", {"matmul": 1.5, "attention": 0.3, "memory": 0.8, "collective": 0.8},
         "efficiency.matmul"),
        ("intra_node", {"gbps": 0, "latency_us": 1}, "intra_node.gbps"),
        ("host_link", {"gbps": -2, "latency_us": 1}, "host_link.gbps"),
        ("host_link", {"gbps": 2}, "host_link"),
        ("op_overhead_us", -1, "op_overhead_us"),
        ("overlap_slowdown", 2, "overlap_slowdown"),
        ("op_tflops", {"matmul fp32 8x8x8": 0}, "op_tflops.matmul fp32 8x8x8"),
        ("op_tflops", [1.0], "op_tflops"),
        ("engine_overhead_us", {"fsdp_unit": -1}, "engine_overhead_us.fsdp_unit"),
        ("collective_us", {"all_reduce 64B x2": 0}, "collective_us.all_reduce 64B x2"),
    ],
)  # fmt: skip
def test_a_bad_field_is_named(tmp_path, field: str, value, named: str) -> None:
    data = dataclasses.asdict(PRESETS["h100-sxm"])
    data[field] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DeviceSpecError, match=named.replace(".", r"\.")) as info:
        load_device(path)
    assert isinstance(info.value, SlapoError)


def test_missing_field_and_not_json(tmp_path) -> None:
    data = dataclasses.asdict(PRESETS["h200"])
    del data["hbm_gib"]
    (tmp_path / "a.json").write_text(json.dumps(data))
    with pytest.raises(DeviceSpecError, match="'hbm_gib' is missing"):
        load_device(tmp_path / "a.json")
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(DeviceSpecError, match="not JSON"):
        load_device(tmp_path / "b.json")


def test_cluster_picks_the_link_a_group_crosses() -> None:
    h100 = PRESETS["h100-sxm"]
    cluster = ClusterSpec(h100, gpus_per_node=8, inter_node_gbps=50.0)
    assert cluster.link_for(8) == h100.intra_node
    assert cluster.link_for(9).gbps == 50.0
    with pytest.raises(DeviceSpecError, match="gpus_per_node"):
        ClusterSpec(h100, gpus_per_node=0)


def test_a_file_written_before_host_links_still_loads(tmp_path) -> None:
    # device files from before host_link/op_overhead_us/overlap_slowdown take their defaults
    data = dataclasses.asdict(PRESETS["a100-80gb-sxm"])
    for field in ("host_link", "op_overhead_us", "overlap_slowdown", "op_tflops",
                  "engine_overhead_us"):  # fmt: skip
        del data[field]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_device(tmp_path / "old.json")
    assert old.host_link.gbps == 32.0 and old.op_overhead_us == 0.0
    assert old.overlap_slowdown == PRESETS["a100-80gb-sxm"].overlap_slowdown
    assert old.op_tflops == {} and old.engine_overhead_us == {}


def test_measured_tables_round_trip(tmp_path) -> None:
    spec = dataclasses.replace(
        PRESETS["h200"], op_tflops={"matmul bf16 1024x384x128": 312.5},
        engine_overhead_us={"fsdp_unit": 40.0, "sac_op": 11.0, "pipeline_microbatch": 400.0},
        collective_us={"all_reduce 262144B x2": 1400.0},
    )  # fmt: skip
    assert load_device(save_device(spec, tmp_path / "d.json")) == spec


def test_ranks_sharing_cores_split_threads_and_host_work() -> None:
    cpu = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, shared_cores=2)
    # one thread per rank: a core each up to two ranks, a quarter of one at eight
    assert [cpu.thread_share(n) for n in (1, 2, 8)] == [1.0, 1.0, 0.25]
    assert [cpu.host_slowdown(n) for n in (1, 2, 8)] == [1.0, 1.0, 4.0]
    both = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=1, shared_cores=2, threads_per_rank=2)
    assert both.thread_share(1) == 1.0 and both.rank_share(1) == 1.0
    gpus = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8)  # a device per rank
    assert gpus.thread_share(8) == 1.0 and gpus.host_slowdown(8) == 1.0


def test_ranks_beyond_the_cores_take_turns() -> None:
    cpu = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, shared_cores=2)
    assert [cpu.oversubscription(n) for n in (1, 2, 8)] == [1.0, 1.0, 4.0]
    two = dataclasses.replace(cpu, threads_per_rank=2)
    assert two.oversubscription(1) == 1.0 and two.oversubscription(2) == 2.0
    # each rank on cores of its own: a core's share, its host work at full speed
    alone = dataclasses.replace(cpu, time_shared=False)
    assert alone.rank_share(8) == cpu.rank_share(2) == 0.5
    assert alone.thread_share(8) == 1.0 and alone.host_slowdown(8) == 1.0
    gpus = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8)
    assert gpus.oversubscription(8) == 1.0
    with pytest.raises(DeviceSpecError, match="time_shared"):
        ClusterSpec(PRESETS["h100-sxm"], time_shared="no")


def test_a_cpu_device_file_shares_its_cores_by_default(tmp_path) -> None:
    # a calibrated CPU's rates are those of the cores it ran on: a node's ranks share them,
    # one thread each as torchrun starts them, all of them for a lone process
    cpu = dataclasses.replace(PRESETS["h100-sxm"], host_cores=2)
    assert load_device(save_device(cpu, tmp_path / "cpu.json")) == cpu
    cluster = ClusterSpec(cpu, gpus_per_node=8)
    assert cluster.shared_cores == 2
    assert [cluster.threads(n) for n in (1, 2, 8)] == [2, 1, 1]
    assert [cluster.rank_share(n) for n in (1, 2, 8)] == [1.0, 0.5, 0.125]
    assert cluster.oversubscription(8) == 4.0
    # said explicitly, as before
    assert ClusterSpec(cpu, shared_cores=0).rank_share(8) == 1.0
    assert ClusterSpec(cpu, threads_per_rank=1).threads(1) == 1
    gpu = ClusterSpec(PRESETS["h100-sxm"])  # a GPU: host_cores 0, a device per rank
    assert gpu.shared_cores == 0 and gpu.threads(1) == 1 and gpu.rank_share(8) == 1.0
    data = dataclasses.asdict(cpu)
    data["host_cores"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(DeviceSpecError, match="host_cores"):
        load_device(tmp_path / "bad.json")

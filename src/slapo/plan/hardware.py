"""Devices and clusters as the step-time model sees them: peaks, achievable fractions, links.

A :class:`DeviceSpec` is one accelerator: its dense peak TFLOPS per dtype, its memory (size and
bandwidth), the fraction of those peaks each kind of op reaches (``matmul``, ``attention``,
``memory`` for the memory-bound elementwise/norm/optimizer ops, ``collective`` for the fraction
of a link's bandwidth NCCL-style rings reach), and its intra-node link. A :class:`ClusterSpec`
is a device, how many share a node, and the network between nodes (per GPU).

The peaks are the vendors' datasheets (dense, no 2:4 sparsity; the same figures as
:data:`slapo.throughput.PEAK_TFLOPS`). The achievable fractions are *not* measured on these
machines: :data:`DEFAULT_EFFICIENCY` states where each comes from; a device file written by a
calibration run replaces them (:func:`save_device`, :func:`load_device`).

Example:
    >>> from slapo.plan.hardware import PRESETS, ClusterSpec
    >>> h100 = PRESETS["h100-sxm"]
    >>> h100.peak_tflops["bf16"], h100.hbm_gib
    (989.5, 80.0)
    >>> cluster = ClusterSpec(h100, gpus_per_node=8, inter_node_gbps=50.0)
    >>> cluster.link_for(16) == cluster.inter_node
    True
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..exceptions import SlapoError

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEFAULT_HOST_GBPS",
    "DEFAULT_HOST_GIB",
    "DEFAULT_OVERLAP_SLOWDOWN",
    "OP_KINDS",
    "PRESETS",
    "ClusterSpec",
    "DeviceSpec",
    "DeviceSpecError",
    "Link",
    "load_device",
    "save_device",
    "write_text_atomic",
]

#: The op kinds a step's time is split into.
OP_KINDS = ("matmul", "attention", "memory", "collective")

#: Achievable fractions of the peaks, until a calibration measures them (assumptions, stated):
#:
#: * matmul 0.70: large bf16 GEMMs (thousands wide, as a transformer's projections at 16k
#:   tokens) through cuBLAS on Hopper/Ampere reach about 70-80% of the dense datasheet peak at
#:   full power in public benchmarks; the low end is taken.
#: * attention 0.35: the FlashAttention-2 kernels (what ``scaled_dot_product_attention``'s
#:   flash backend runs) on an H100 SXM reach about 35% of the bf16 peak at head dim 128, causal,
#:   long sequences (the FlashAttention-3 paper, Shah et al. 2024, FA2 baseline figures).
#: * memory 0.80: a streaming copy reaches about 80% of the datasheet HBM bandwidth.
#: * collective 0.80: NCCL ring all-gather/reduce-scatter bus bandwidth over NVLink and over
#:   400 Gb/s InfiniBand/RoCE reaches about 80% of the link's per-direction rate (nccl-tests
#:   figures NVIDIA publishes for DGX/HGX systems).
DEFAULT_EFFICIENCY: dict[str, float] = {
    "matmul": 0.70, "attention": 0.35, "memory": 0.80, "collective": 0.80,
}  # fmt: skip

#: How much slower compute runs while a collective overlaps it, as a fraction of the collective's
#: time (an assumption until calibrated): NCCL's ring kernels run on the GPU's own SMs, one
#: thread block per channel, and use 16 to 32 channels on NVLink/InfiniBand H100 systems, 12-24%
#: of the 132 SMs; the low half is taken (the GEMMs beside them are not always SM-bound).
DEFAULT_OVERLAP_SLOWDOWN = 0.10

#: The host memory bandwidth (GB/s) a node's CPU optimizer step streams at (RoundPipe's Adam):
#: an assumption, about half the DDR5 bandwidth of one socket of a current GPU server (8
#: channels x 4800 MT/s x 8 bytes = 307 GB/s).
DEFAULT_HOST_GBPS = 150.0
#: Host memory per node (GiB) RoundPipe may fill with the model state: an assumption (8-GPU
#: servers ship with 1-2 TiB); ``slapo plan --host-gib`` says what a node has.
DEFAULT_HOST_GIB = 1024.0


class DeviceSpecError(SlapoError, ValueError):
    """A device or cluster description is malformed (the message names the field)."""


@dataclass(frozen=True)
class Link:
    """A link one GPU sends over: per-direction bandwidth (GB/s, 1e9 bytes) and latency (us).

    Example:
        >>> Link(450.0, 3.0).seconds(9e9, efficiency=1.0)   # 9 GB at 450 GB/s, one message
        0.020003
    """

    gbps: float
    latency_us: float

    def seconds(self, nbytes: float, *, efficiency: float, messages: int = 1) -> float:
        """Seconds to move ``nbytes`` in ``messages`` sequential steps."""
        return nbytes / (self.gbps * 1e9 * efficiency) + messages * self.latency_us * 1e-6


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (see the module doc).

    Attributes:
        name: the preset's or file's name.
        peak_tflops: dense peak TFLOPS by dtype: ``bf16``, ``fp16``, ``fp8``, ``tf32``, ``fp32``
            (a dtype the device lacks is left out).
        hbm_gib: device memory (GiB, as ``torch.cuda`` reports it).
        hbm_gbps: memory bandwidth (GB/s).
        efficiency: achievable fraction per op kind (:data:`OP_KINDS`).
        intra_node: the link to the other GPUs of a node (NVLink, or PCIe).
        overlap_slowdown: seconds of compute lost per second of a collective running beside it
            (:data:`DEFAULT_OVERLAP_SLOWDOWN`).
        host_link: the link to the host's memory (PCIe, per direction): what RoundPipe streams
            the layers and their gradients over.
        op_overhead_us: host time each op costs beside its work (dispatch, launch), where it
            adds to the step: a CPU runs it on the cores that compute. A GPU's launches overlap
            the kernels queued before them while the step is large: 0 for the GPU presets.
        op_tflops: rates measured at given op shapes (:func:`slapo.plan.calibrate.
            calibrate_shapes`), keyed by :func:`slapo.plan.step_time.shape_key`'s strings (a
            CPU's with `` @<threads>t``): an op of a measured shape runs at its own rate, not at
            ``efficiency``'s (small GEMMs and narrow attention heads reach less of the peak).
        engine_overhead_us: time an engine adds per unit of its work at nothing to compute or
            move, where it adds to the step: ``fsdp_unit`` (FSDP2's hooks, copy-in/out and
            casts around one unit's two all-gathers and reduce-scatter, and their latency: the
            model then charges those collectives their bytes only); ``pipeline_microbatch``
            (``torch.distributed.pipelining``'s actions and sends of one microbatch slot, their
            latency included: the sends are then charged their bytes only); ``sac_op`` (a
            selective checkpoint's Python dispatch mode, per op it passes on, uncompiled).
            Calibrated on a CPU; absent for the GPU presets, whose host work runs ahead of the
            kernels.
        collective_us: microseconds one collective call of a given kind, size and group takes
            in a step (:func:`slapo.plan.calibrate.calibrate_collectives`: issued after
            compute, as a step issues it), keyed by :func:`slapo.plan.step_time.
            collective_key`'s strings: such a call costs that, not the link's figure.
        host_cores: the CPU cores a CPU device was calibrated on, whose rates are theirs
            together (:func:`slapo.plan.calibrate.calibrate_device` writes it): the cores a
            host's ranks then share (:attr:`ClusterSpec.shared_cores`). 0 for an accelerator.
        source: where the numbers come from.

    Example:
        >>> dev = PRESETS["a100-80gb-sxm"]
        >>> dev.achievable_tflops("matmul", "bf16")  # 0.70 x 312
        218.4
    """

    name: str
    peak_tflops: dict[str, float]
    hbm_gib: float
    hbm_gbps: float
    intra_node: Link
    efficiency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    source: str = ""
    overlap_slowdown: float = DEFAULT_OVERLAP_SLOWDOWN
    op_overhead_us: float = 0.0
    host_link: Link = Link(32.0, 10.0)  # PCIe 4.0 x16 where a device says nothing else
    op_tflops: dict[str, float] = field(default_factory=dict)
    engine_overhead_us: dict[str, float] = field(default_factory=dict)
    collective_us: dict[str, float] = field(default_factory=dict)
    host_cores: int = 0

    def __post_init__(self) -> None:
        _check_device(dataclasses.asdict(self), where=f"DeviceSpec {self.name!r}")

    def achievable_tflops(self, kind: str, dtype: str = "bf16") -> float:
        """The TFLOPS an op of ``kind`` (matmul, attention) reaches in ``dtype``."""
        if dtype not in self.peak_tflops:
            raise DeviceSpecError(
                f"DeviceSpec {self.name!r}: no peak_tflops[{dtype!r}] (it has "
                f"{sorted(self.peak_tflops)}); add it to the device file or pick another dtype"
            )
        return round(self.peak_tflops[dtype] * self.efficiency[kind], 6)


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs of one kind, ``gpus_per_node`` to a node, nodes joined by a network of
    ``inter_node_gbps`` (GB/s per GPU and direction) with ``inter_node_latency_us``.

    A CPU host runs its ranks (``gpus_per_node`` processes) on the ``shared_cores`` its device
    file was calibrated on (by default the device's ``host_cores``: 0 for a GPU, every rank a
    device of its own), ``threads_per_rank`` threads each (by default torchrun's: one per
    process, all the cores for a lone one; :meth:`threads`): they compute at a share of the
    device's rates (:meth:`rank_share`). Where the ranks' threads outnumber the cores they
    take turns (``time_shared``): :func:`slapo.plan.step_time.time_step` then predicts a
    rank's path as if its threads had cores of their own (``time_shared=False``) and the step
    as at least the node's ranks' work over its cores.

    Example:
        >>> c = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, inter_node_gbps=50.0)
        >>> c.link_for(8).gbps, c.link_for(128).gbps
        (450.0, 50.0)
    """

    device: DeviceSpec
    gpus_per_node: int = 8
    inter_node_gbps: float = 50.0
    inter_node_latency_us: float = 10.0
    shared_cores: int | None = None
    threads_per_rank: int | None = None
    host_gbps: float = DEFAULT_HOST_GBPS
    host_gib: float = DEFAULT_HOST_GIB
    time_shared: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.time_shared, bool):
            raise DeviceSpecError(
                f"ClusterSpec.time_shared must be True or False, got {self.time_shared!r}"
            )
        for name in ("gpus_per_node", "threads_per_rank"):
            value = getattr(self, name)
            if value is None and name == "threads_per_rank":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DeviceSpecError(f"ClusterSpec.{name} must be a positive int, got {value!r}")
        if self.shared_cores is None:  # the cores the device was calibrated on (0: a GPU)
            object.__setattr__(self, "shared_cores", getattr(self.device, "host_cores", 0))
        if (
            isinstance(self.shared_cores, bool)
            or not isinstance(self.shared_cores, int)
            or (self.shared_cores < 0)
        ):
            raise DeviceSpecError(
                f"ClusterSpec.shared_cores must be an int >= 0 (0: a device per rank), got "
                f"{self.shared_cores!r}"
            )
        for name in ("inter_node_gbps", "inter_node_latency_us", "host_gbps", "host_gib"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise DeviceSpecError(f"ClusterSpec.{name} must be a number >= 0, got {value!r}")

    @property
    def inter_node(self) -> Link:
        return Link(self.inter_node_gbps, self.inter_node_latency_us)

    def threads(self, ranks: int) -> int:
        """The threads each of ``ranks`` ranks on a node computes with: ``threads_per_rank``,
        or by default torchrun's (``OMP_NUM_THREADS=1`` for each of several processes) and
        torch's (all the ``shared_cores`` for a lone process; 1 on a GPU).

        Example:
            >>> cpu = ClusterSpec(dataclasses.replace(PRESETS["h100-sxm"], host_cores=2))
            >>> cpu.shared_cores, cpu.threads(1), cpu.threads(2)
            (2, 2, 1)
        """
        if self.threads_per_rank is not None:
            return self.threads_per_rank
        return max(1, self.shared_cores or 1) if ranks <= 1 else 1

    def rank_share(self, ranks: int) -> float:
        """The share of the device's rates one of ``ranks`` ranks computing at once on a node
        gets: 1.0 with a device per rank (``shared_cores`` 0, GPUs); on a host whose
        ``shared_cores`` the device was calibrated on (a CPU), each rank's :meth:`threads` at
        most, the cores split evenly when there are more threads.

        Example:
            >>> cpu = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, shared_cores=2)
            >>> cpu.rank_share(1), cpu.rank_share(2), cpu.rank_share(8)  # one: both cores
            (1.0, 0.5, 0.125)
        """
        if self.shared_cores == 0:
            return 1.0
        computing = self._computing(ranks)
        return min(self.threads(ranks), self.shared_cores / computing) / self.shared_cores

    def oversubscription(self, ranks: int) -> float:
        """How many times the threads of ``ranks`` ranks outnumber the ``shared_cores`` (1.0
        while they fit, or with a device per rank): the ranks then take turns on the cores.

        Example:
            >>> cpu = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, shared_cores=2)
            >>> cpu.oversubscription(2), cpu.oversubscription(8)
            (1.0, 4.0)
        """
        if self.shared_cores == 0:
            return 1.0
        return max(1.0, ranks * self.threads(ranks) / self.shared_cores)

    def _computing(self, ranks: int) -> int:
        """The ranks computing at once: all of them, but as many as the cores hold at most
        where each has its threads' cores alone (``time_shared=False``)."""
        ranks = max(1, ranks)
        if not self.time_shared:
            ranks = min(ranks, max(1, self.shared_cores // self.threads(ranks)))
        return ranks

    def thread_share(self, ranks: int) -> float:
        """The share of its own ``threads_per_rank`` threads one of ``ranks`` ranks gets (1.0
        unless the ranks' threads outnumber ``shared_cores``): what scales a rate measured at
        those threads (:attr:`DeviceSpec.op_tflops`).

        Example:
            >>> cpu = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, shared_cores=2)
            >>> cpu.thread_share(2), cpu.thread_share(8)
            (1.0, 0.25)
        """
        if self.shared_cores == 0:
            return 1.0
        cores = self.shared_cores / self._computing(ranks)
        return min(self.threads(ranks), cores) / self.threads(ranks)

    def host_slowdown(self, ranks: int) -> float:
        """How much longer one rank's host work (op dispatch, an engine's hooks: one thread)
        takes when ``ranks`` ranks share ``shared_cores`` cores: 1.0 while each has a core.

        Example:
            >>> cpu = ClusterSpec(PRESETS["h100-sxm"], gpus_per_node=8, shared_cores=2)
            >>> cpu.host_slowdown(2), cpu.host_slowdown(8)
            (1.0, 4.0)
        """
        if self.shared_cores == 0:
            return 1.0
        return max(1.0, self._computing(ranks) / self.shared_cores)

    def link_for(self, group_span: int) -> Link:
        """The slowest link a group spanning ``group_span`` consecutive ranks crosses: the
        node's own within a node, the network beyond it."""
        return self.device.intra_node if group_span <= self.gpus_per_node else self.inter_node


def _number(value: Any, where: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DeviceSpecError(f"{where} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise DeviceSpecError(f"{where} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _check_device(data: Any, where: str) -> None:
    """Raise :class:`DeviceSpecError` naming the first bad field of a device's dict."""
    if not isinstance(data, dict):
        raise DeviceSpecError(f"{where}: a device is a JSON object, got {type(data).__name__}")
    for key in ("name", "peak_tflops", "hbm_gib", "hbm_gbps", "intra_node"):
        if key not in data:
            raise DeviceSpecError(f"{where}: field {key!r} is missing")
    if not isinstance(data["name"], str) or not data["name"]:
        raise DeviceSpecError(f"{where}: field 'name' must be a non-empty string")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or "bf16" not in peaks:
        raise DeviceSpecError(
            f"{where}: field 'peak_tflops' must map dtypes to TFLOPS, bf16 included"
        )
    for dtype, value in peaks.items():
        _number(value, f"{where}: field 'peak_tflops.{dtype}'")
    _number(data["hbm_gib"], f"{where}: field 'hbm_gib'")
    _number(data["hbm_gbps"], f"{where}: field 'hbm_gbps'")
    link = data["intra_node"]
    if not isinstance(link, dict) or set(link) != {"gbps", "latency_us"}:
        raise DeviceSpecError(
            f"{where}: field 'intra_node' must be {{'gbps': .., 'latency_us': ..}}"
        )
    _number(link["gbps"], f"{where}: field 'intra_node.gbps'")
    _number(link["latency_us"], f"{where}: field 'intra_node.latency_us'", positive=False)
    host = data.get("host_link", {"gbps": 32.0, "latency_us": 10.0})
    if not isinstance(host, dict) or set(host) != {"gbps", "latency_us"}:
        raise DeviceSpecError(
            f"{where}: field 'host_link' must be {{'gbps': .., 'latency_us': ..}}"
        )
    _number(host["gbps"], f"{where}: field 'host_link.gbps'")
    _number(host["latency_us"], f"{where}: field 'host_link.latency_us'", positive=False)
    eff = data.get("efficiency", DEFAULT_EFFICIENCY)
    if not isinstance(eff, dict) or set(eff) != set(OP_KINDS):
        raise DeviceSpecError(f"{where}: field 'efficiency' must give each of {OP_KINDS}")
    _number(data.get("op_overhead_us", 0.0), f"{where}: field 'op_overhead_us'", positive=False)
    cores = data.get("host_cores", 0)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
        raise DeviceSpecError(f"{where}: field 'host_cores' must be an int >= 0, got {cores!r}")
    slowdown = data.get("overlap_slowdown", DEFAULT_OVERLAP_SLOWDOWN)
    if _number(slowdown, f"{where}: field 'overlap_slowdown'", positive=False) > 1:
        raise DeviceSpecError(f"{where}: field 'overlap_slowdown' is a fraction <= 1")
    for name in ("op_tflops", "engine_overhead_us", "collective_us"):
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise DeviceSpecError(f"{where}: field {name!r} must map names to numbers")
        for key, value in table.items():
            _number(value, f"{where}: field '{name}.{key}'", positive=name != "engine_overhead_us")
    for kind, value in eff.items():
        if _number(value, f"{where}: field 'efficiency.{kind}'") > 1:
            raise DeviceSpecError(
                f"{where}: field 'efficiency.{kind}' is a fraction <= 1, got {value!r}"
            )


def _h(bf16: float, fp8: float | None, tf32: float, fp32: float) -> dict[str, float]:
    peaks = {"bf16": bf16, "fp16": bf16, "tf32": tf32, "fp32": fp32}
    return {**peaks, "fp8": fp8} if fp8 else peaks


#: The shipped devices. Links are per GPU and direction (datasheets print NVLink both ways).
PRESETS: dict[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec(
        "h100-sxm",
        _h(989.5, 1979.0, 494.5, 67.0),
        hbm_gib=80.0,
        hbm_gbps=3350.0,
        intra_node=Link(450.0, 3.0),  # NVLink 4: 900 GB/s both ways (H100 datasheet)
        host_link=Link(64.0, 5.0),  # PCIe 5.0 x16, per direction
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB: peaks, HBM3 3.35 TB/s)",
    ),
    # The H100 torchtitan's Llama 3.1 results ran on (Meta's Grand Teton hosts): 96 GB of HBM2e,
    # power capped at 500 W. No NVIDIA datasheet: its compute is the GH100 of the SXM part
    # (torchtitan's MFU counts 989 TFLOPS for it); its HBM2e bandwidth is taken as the H100
    # PCIe's (HBM2e, 2.0 TB/s, H100 datasheet). The 500 W cap (the SXM part is rated 700 W)
    # lowers sustained clocks by an amount no source states: not modelled (see step_time).
    "h100-96gb-hbm2e-500w": DeviceSpec(
        "h100-96gb-hbm2e-500w",
        _h(989.5, 1979.0, 494.5, 67.0),
        hbm_gib=96.0,
        hbm_gbps=2000.0,
        intra_node=Link(450.0, 3.0),  # NVLink 4 (H100 datasheet)
        host_link=Link(64.0, 5.0),  # PCIe 5.0 x16, per direction
        source="H100 datasheet (SXM5 compute, PCIe HBM2e bandwidth); torchtitan docs/performance.md",
    ),
    "h200": DeviceSpec(
        "h200",
        _h(989.5, 1979.0, 494.5, 67.0),
        hbm_gib=141.0 * 1e9 / 2**30,
        hbm_gbps=4800.0,
        intra_node=Link(450.0, 3.0),  # NVLink 4: 900 GB/s both ways
        host_link=Link(64.0, 5.0),  # PCIe 5.0 x16, per direction
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e at 4.8 TB/s)",
    ),
    "a100-80gb-sxm": DeviceSpec(
        "a100-80gb-sxm",
        _h(312.0, None, 156.0, 19.5),
        hbm_gib=80.0,
        hbm_gbps=2039.0,
        intra_node=Link(300.0, 3.0),  # NVLink 3: 600 GB/s both ways
        host_link=Link(32.0, 5.0),  # PCIe 4.0 x16, per direction
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: HBM2e 2,039 GB/s)",
    ),
    "b200": DeviceSpec(
        "b200",
        _h(2250.0, 4500.0, 1125.0, 75.0),
        hbm_gib=180.0,
        hbm_gbps=8000.0,
        intra_node=Link(900.0, 3.0),  # NVLink 5: 1.8 TB/s both ways
        host_link=Link(64.0, 5.0),  # PCIe 5.0 x16, per direction
        source="NVIDIA HGX B200 specifications (8-GPU figures / 8: 1,440 GB, 64 TB/s)",
    ),
    "rtx-4090": DeviceSpec(
        "rtx-4090",
        _h(165.2, 330.3, 82.6, 82.6),
        hbm_gib=24.0,
        hbm_gbps=1008.0,
        intra_node=Link(32.0, 10.0),  # no NVLink: PCIe 4.0 x16, 64 GB/s both ways
        host_link=Link(32.0, 5.0),  # PCIe 4.0 x16, per direction
        source="NVIDIA Ada Lovelace GPU architecture whitepaper, appendix A (GDDR6X 1,008 GB/s)",
    ),
    "a800-80gb-sxm": DeviceSpec(
        "a800-80gb-sxm",
        _h(312.0, None, 156.0, 19.5),
        hbm_gib=80.0,
        hbm_gbps=2039.0,
        intra_node=Link(200.0, 3.0),  # NVLink: 400 GB/s both ways (the A800's export limit)
        host_link=Link(32.0, 5.0),  # PCIe 4.0 x16, per direction
        source="NVIDIA A800 datasheet (the A100's compute and HBM2e; NVLink 400 GB/s)",
    ),
}


def device_from_dict(data: Any, where: str = "device") -> DeviceSpec:
    """A :class:`DeviceSpec` from its JSON dict (``dataclasses.asdict`` of one), checked."""
    _check_device(data, where)
    known = {f.name for f in dataclasses.fields(DeviceSpec)}
    extra = set(data) - known
    if extra:
        raise DeviceSpecError(f"{where}: unknown field(s) {sorted(extra)}; known: {sorted(known)}")
    links = {"intra_node": Link(**data["intra_node"])}
    if "host_link" in data:
        links["host_link"] = Link(**data["host_link"])
    return DeviceSpec(**{**data, **links})


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    r"""Write ``text`` to ``path`` atomically: a temporary file beside it, flushed to disk, then
    renamed over it (a reader sees the old file or the new one, never a part).

    Example:
        >>> write_text_atomic("notes.json", "{}\n")
        PosixPath('notes.json')
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_device(device: DeviceSpec, path: str | os.PathLike) -> Path:
    """Write ``device`` as JSON to ``path`` atomically (:func:`write_text_atomic`).

    Example:
        >>> save_device(PRESETS["h200"], "h200.json")
        PosixPath('h200.json')
    """
    text = json.dumps(dataclasses.asdict(device), indent=2, sort_keys=True) + "\n"
    return write_text_atomic(path, text)


def load_device(path: str | os.PathLike) -> DeviceSpec:
    """Read a device file :func:`save_device` wrote (or one written by hand).

    Raises:
        DeviceSpecError: the file is not JSON, or a field is missing or malformed (named).

    Example:
        >>> load_device("h200.json") == PRESETS["h200"]
        True
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise DeviceSpecError(f"device file {str(path)!r} is not JSON: {exc}") from exc
    return device_from_dict(data, where=f"device file {str(path)!r}")

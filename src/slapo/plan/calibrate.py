"""Calibration: measure the rates a :class:`~slapo.plan.hardware.DeviceSpec` states, here.

:func:`calibrate_device` times, on the machine at hand (the CPU, or the current CUDA GPU):

* ``matmul``: square-ish GEMMs the width of a transformer's projections, ``2 m n k`` FLOPs each;
* ``attention``: ``scaled_dot_product_attention``, causal, forward and backward, FLOPs counted as
  :class:`~slapo.plan.step_time.StepCounter` counts them (``4 b h s_q s_k d`` forward, halved when
  causal, backward 2.5x the forward), so a fraction measured here means what the counter assumes;
* ``memory``: an out-of-place add over tensors larger than the caches, counted as the counter
  counts memory-bound ops (bytes of the inputs and the output);
* ``collective``: ``world`` processes on this host (gloo on 127.0.0.1 for the CPU, NCCL with two
  or more GPUs) all-gather and all-reduce a small and a large message. The bytes one rank sends
  as a ring (all-gather ``(n-1)`` x the input, all-reduce ``2 (n-1)/n`` x it) and the ring's
  steps (``n-1``, ``2 (n-1)``) put the times in :meth:`Link.seconds`'s convention: the slope
  from the small to the large message is the bandwidth, what the small one takes beyond its
  bytes is the latency (per step);
* ``fsdp_unit`` (a CPU, :attr:`DeviceSpec.engine_overhead_us`): the same processes train a
  stack of FSDP2 units too narrow to compute or move anything (16 wide) at two depths; the
  step's growth per unit is FSDP2's own host work and its three collectives' latency (measured
  together: a small message's latency alone is the noisiest figure here, and the engine pays
  it inside its own waits);
* ``pipeline_microbatch`` (a CPU): the same processes, a stage each, run 1F1B steps of
  ``torch.distributed.pipelining`` through stages too narrow to compute at two microbatch
  counts; the growth per microbatch is the runtime's actions and sends (their latency);
* the op overhead and ``sac_op`` (a CPU): a 16-wide Llama's training step per op, and what the
  same step under a selective checkpoint (``save_matmuls``, uncompiled) costs beyond it per
  op the checkpoint's Python dispatch mode passes on.

:func:`calibrate_shapes` then measures the matmuls and attention kernels of one model at their
own shapes (the keys :func:`slapo.plan.step_time.shape_key` gives; a CPU's at the thread count
its ranks run with; the caches flushed before each call, as a step's operands come from
memory): a transformer 128 wide multiplies far below a 2048-wide GEMM's rate.
:func:`calibrate_collectives` times a model's collective calls at their sizes
(:func:`slapo.plan.step_time.collective_key`), each after a burst of compute, as a step issues
them.

Each time is the median of repeats after a warmup (CUDA events on a GPU). With a ``base`` (a
datasheet preset) the peaks stay the datasheet's and each measurement becomes a fraction of them
(``efficiency``); without one (the CPU has no datasheet here) the measured rates are the peaks,
matmul, memory and collective fractions are 1.0 and attention's is its rate over the matmul's.
``source`` records the host, date, torch version and what was measured.

Example:
    >>> from slapo.plan.calibrate import calibrate_device, write_calibration
    >>> from slapo.plan.hardware import PRESETS
    >>> # illustration: measuring takes seconds and times collectives in 2 worker processes;
    >>> # the last line needs a GPU
    >>> cpu = calibrate_device("cpu", quick=True)  # doctest: +SKIP
    >>> cpu.efficiency["matmul"], 0 < cpu.efficiency["attention"] <= 1  # doctest: +SKIP
    (1.0, True)
    >>> gpu = write_calibration("h200-here.json", device="cuda", base=PRESETS["h200"], world=1)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import socket
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .hardware import DeviceSpec, DeviceSpecError, Link, save_device

__all__ = ["calibrate_collectives", "calibrate_device", "calibrate_shapes", "write_calibration"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Seconds the collective workers may take in all (start-up included) before they are killed.
COLLECTIVE_DEADLINE_S = 180.0
#: Seconds one collective may block in a worker (a dead peer fails the others, never hangs).
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class _Plan:
    """What one calibration runs (sizes by device and ``quick``)."""

    gemms: tuple[tuple[int, int, int], ...]  # (m, n, k)
    attention: tuple[int, int, int, int]  # (batch, heads, seq, head dim)
    memory_elems: int  # elements of each of the add's three tensors
    messages: tuple[int, int]  # collective message bytes: small (latency), large (bandwidth)
    warmup: int
    repeats: int


def _plan(device: str, quick: bool) -> _Plan:
    # CPU: GEMMs of 1-2k (a second or so each dtype); tensors past a typical L3 for the add.
    # GPU: projections of an 8k-wide model, FlashAttention at 4k tokens, 512 MiB+ tensors.
    if device == "cpu":
        if quick:
            return _Plan(((1024, 1024, 1024),), (1, 4, 512, 64), 2**24, (4096, 2**23), 1, 3)
        gemms = ((2048, 2048, 2048), (2048, 1024, 2048))
        return _Plan(gemms, (1, 8, 1024, 64), 2**25, (4096, 2**26), 2, 7)
    if quick:
        return _Plan(((4096, 4096, 4096),), (2, 16, 2048, 128), 2**26, (4096, 2**26), 2, 5)
    gemms = ((8192, 8192, 8192), (8192, 4096, 8192))
    return _Plan(gemms, (4, 32, 4096, 128), 2**28, (4096, 2**28), 3, 10)


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (device files stay readable)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def _median_seconds(
    fn: Callable[[], Any],
    device: torch.device,
    warmup: int,
    repeats: int,
    before: Callable[[], Any] | None = None,
) -> float:
    """Median wall seconds of ``fn`` after ``warmup`` calls (CUDA events on a GPU); ``before``
    runs ahead of each call, untimed."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            if before is not None:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: Bytes written between the timed calls of a shape (:func:`calibrate_shapes`), more than the
#: caches hold: in a training step an op's operands were made by other ops long before, so
#: they come from memory, not from the cache a repeated call would find them in (the main
#: job's GEMMs ran 8-10% slower in its step than repeated; ``do_bench`` flushes a GPU's L2 so).
CACHE_FLUSH_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}


def _cache_flusher(device: torch.device) -> Callable[[], Any]:
    """A call that evicts the caches of ``device`` (writes :data:`CACHE_FLUSH_BYTES`)."""
    buffer = torch.empty(CACHE_FLUSH_BYTES[device.type] // 4, device=device)
    return buffer.zero_


def _matmul_tflops(device: torch.device, dtype: torch.dtype, plan: _Plan) -> float:
    flops = seconds = 0.0
    for m, n, k in plan.gemms:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        gemm = functools.partial(torch.mm, a, b, out=out)
        seconds += _median_seconds(gemm, device, plan.warmup, plan.repeats)
        flops += 2 * m * n * k
    return flops / seconds / 1e12


def _attention_flops(batch: int, heads: int, seq: int, dim: int) -> int:
    """Forward + backward FLOPs of causal attention, as ``step_time``'s counter counts them."""
    forward = 4 * batch * heads * seq * seq * dim // 2
    return forward + int(forward * 2.5)


def _attention_tflops(device: torch.device, dtype: torch.dtype, plan: _Plan) -> float:
    b, h, s, d = plan.attention
    q, k, v = (
        torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)

    def step() -> None:
        q.grad = k.grad = v.grad = None  # fresh gradients: no accumulation adds in the timing
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    seconds = _median_seconds(step, device, plan.warmup, plan.repeats)
    return _attention_flops(b, h, s, d) / seconds / 1e12


def _host_overheads_us(device: torch.device, plan: _Plan) -> tuple[float, float]:
    """Microseconds of host work (op overhead, selective checkpoint per op) on ``device``.

    * op overhead: what one op of a transformer's training step costs on the host beside its
      work (Python module code, dispatch, autograd's record and its backward node, the
      optimizer's loop): a Hugging Face Llama too narrow to compute anything (16 wide, 16
      tokens) trains one step with AdamW, on one thread (its ops are too small for more), per
      aten op :class:`~slapo.plan.step_time.StepCounter` counts. Without transformers: a chain
      of 16-element multiplies and its backward (the dispatch alone, about half of it);
    * ``sac_op``: the same step with every block under a selective checkpoint
      (``save_matmuls``, uncompiled): its time beyond its ops at the plain step's cost per op,
      per op the checkpoint's dispatch mode passed on (``StepCounter.selective_ops``: torch's
      caching and replaying modes are Python, about three times an op's own host cost).
    """
    from .step_time import StepCounter

    def per_op(policy: str | None) -> tuple[float, int, int]:
        step = _tiny_transformer_step(device, policy) or _multiply_chain_step(device, policy)
        with StepCounter() as counter:
            step()
        seconds = _median_seconds(step, device, plan.warmup + 1, plan.repeats)
        return seconds, sum(counter.ops.values()), sum(counter.selective_ops.values())

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain, plain_ops, _ = per_op(None)
        selective, ops, through_mode = per_op("save_matmuls")
    finally:
        torch.set_num_threads(before)
    op_us = plain / max(1, plain_ops) * 1e6
    sac_us = max(0.0, selective * 1e6 - ops * op_us) / max(1, through_mode)
    return op_us, sac_us


def _checkpointed(forward: Callable[..., Any], policy: str | None) -> Callable[..., Any]:
    """``forward`` under a selective checkpoint of ``policy`` (itself where ``policy`` is None)."""
    if policy is None:
        return forward
    from ..random import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, policy=policy, **kwargs)

    return run


def _tiny_transformer_step(
    device: torch.device, policy: str | None = None
) -> Callable[[], None] | None:
    try:
        import transformers
    except ImportError:
        return None
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(device).train()
    for layer in model.model.layers:
        layer.forward = _checkpointed(layer.forward, policy)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.arange(16, device=device).reshape(2, 8) % 64

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _multiply_chain_step(device: torch.device, policy: str | None = None) -> Callable[[], None]:
    x = torch.ones(16, device=device, requires_grad=True)

    def chain(y: torch.Tensor) -> torch.Tensor:
        for _ in range(100):
            y = y * 1.0001
        return y

    run = _checkpointed(chain, policy)

    def step() -> None:
        run(x).sum().backward()
        x.grad = None

    return step


def _memory_gbps(device: torch.device, dtype: torch.dtype, plan: _Plan) -> float:
    a, b, out = (torch.ones(plan.memory_elems, device=device, dtype=dtype) for _ in range(3))
    seconds = _median_seconds(lambda: torch.add(a, b, out=out), device, plan.warmup, plan.repeats)
    return 3 * a.numel() * a.element_size() / seconds / 1e9  # two read, one written


# --- collectives: `world` processes on this host ---------------------------------------------

_OPS = ("all_gather", "all_reduce")


def _ring(op: str, nbytes: int, world: int) -> tuple[float, int]:
    """(bytes one rank sends, sequential steps) of a ring ``op``, as ``step_time`` counts them."""
    if op == "all_gather":
        return float((world - 1) * nbytes), world - 1
    return 2.0 * (world - 1) * nbytes / world, 2 * (world - 1)


def _timed_collective(op: str, x: torch.Tensor, outs: list[torch.Tensor]) -> float:
    """Seconds of one ``op`` on ``x``, every rank starting together (after a barrier)."""
    import torch.distributed as dist

    dist.barrier()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    if op == "all_gather":
        dist.all_gather(outs, x)
    else:
        dist.all_reduce(x)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - t0


def _collective_worker(
    rank: int, world: int, port: int, backend: str, plan: _Plan, out_dir: str
) -> None:
    """One rank: time each op and message size; rank 0 writes the slowest rank's medians."""
    import torch.distributed as dist

    import slapo.env

    result: dict[str, Any]
    try:
        if backend == "gloo":
            torch.set_num_threads(1)  # the ranks share this host's cores
        slapo.env.setup(rank, world, backend, master_port=port, timeout=COLLECTIVE_TIMEOUT_S)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        device = device or torch.device("cpu")
        medians = []
        for op in _OPS:
            for nbytes in plan.messages:
                x = torch.zeros(nbytes // 4, device=device)
                outs = [torch.empty_like(x) for _ in range(world)]
                for _ in range(plan.warmup):
                    _timed_collective(op, x, outs)
                times = [_timed_collective(op, x, outs) for _ in range(plan.repeats)]
                medians.append(statistics.median(times))
        if backend == "gloo":  # the engines' host work (module doc); GPUs run ahead of it
            medians.append(_fsdp_unit_seconds(plan))
            medians.append(_pipeline_microbatch_seconds(plan))
        slowest = torch.tensor(medians, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends when its last rank does
        result = {"ok": True, "seconds": slowest.tolist()}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": traceback.format_exc()}
    _finish_worker(out_dir, rank, result)


#: FSDP2 units of the two stacks :func:`_fsdp_unit_seconds` times, and their width.
FSDP_DEPTHS = (2, 8)
FSDP_WIDTH = 16


def _fsdp_unit_seconds(plan: _Plan) -> float:
    """Seconds one FSDP2 unit adds to a training step (forward, backward, AdamW) on this
    process group: the slope between stacks of :data:`FSDP_DEPTHS` units (each one narrow
    ``Linear``, every unit and the root sharded), whose compute is nothing."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    times = []
    for depth in FSDP_DEPTHS:
        model = torch.nn.Sequential(
            *(torch.nn.Sequential(torch.nn.Linear(FSDP_WIDTH, FSDP_WIDTH)) for _ in range(depth))
        )
        for unit in model:
            fully_shard(unit)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        x = torch.ones(4, FSDP_WIDTH)

        def step(model: torch.nn.Module = model, optimizer: Any = optimizer, x: Any = x) -> None:
            dist.barrier()  # the ranks start together (both stacks pay it: the slope cancels it)
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        times.append(_median_seconds(step, torch.device("cpu"), plan.warmup + 2, plan.repeats))
    return max(0.0, (times[1] - times[0]) / (FSDP_DEPTHS[1] - FSDP_DEPTHS[0]))


#: Microbatches of the two pipeline steps :func:`_pipeline_microbatch_seconds` times, per stage
#: (1F1B needs at least a microbatch per stage).
PIPELINE_MICROBATCHES = (1, 4)


def _pipeline_microbatch_seconds(plan: _Plan) -> float:
    """Seconds one microbatch adds to a pipeline's step (1F1B, ``torch.distributed.pipelining``,
    a stage per rank of this group): the slope between steps of :data:`PIPELINE_MICROBATCHES`
    microbatches per stage through stages too narrow to compute (one 16-wide ``Linear`` each). Each one
    more is a slot more on the critical path: its forward and backward actions and the
    sends and receives between them (their latency included)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    times = []
    for microbatches in (world * n for n in PIPELINE_MICROBATCHES):
        module = torch.nn.Linear(FSDP_WIDTH, FSDP_WIDTH)
        x = torch.ones(4 * microbatches, FSDP_WIDTH)
        # the shapes given (no run-time inference); a stage past the first sends its input's
        # gradient back, every stage's output has one
        given = torch.empty(4, FSDP_WIDTH, device="meta").requires_grad_(rank > 0)
        made = torch.empty(4, FSDP_WIDTH, device="meta").requires_grad_(True)
        stage = PipelineStage(
            module, rank, world, torch.device("cpu"), input_args=(given,), output_args=(made,)
        )
        schedule = Schedule1F1B(
            stage, n_microbatches=microbatches, loss_fn=lambda out, _: out.sum()
        )  # fmt: skip

        def step(schedule: Any = schedule, x: Any = x, module: Any = module) -> None:
            dist.barrier()  # the ranks start together (both steps pay it: the slope cancels it)
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=x)
            else:
                schedule.step()
            module.zero_grad()

        times.append(_median_seconds(step, torch.device("cpu"), plan.warmup + 2, plan.repeats))
    extra = world * (PIPELINE_MICROBATCHES[1] - PIPELINE_MICROBATCHES[0])
    return max(0.0, (times[1] - times[0]) / extra)


def _write_result(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    """A worker's result for the parent, as JSON (written whole, then renamed)."""
    path = Path(out_dir) / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").replace(path)


def _finish_worker(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    """A worker's last act: its result for the parent, then its process group torn down."""
    import slapo.env

    _write_result(out_dir, rank, result)
    try:
        slapo.env.teardown()
    except Exception:  # noqa: BLE001, S110 - a group a failing peer already broke
        pass


def _check_measured(caller: str, spec: Any, device: Any) -> None:
    """The ``spec`` and ``device`` arguments of ``caller`` (``calibrate_shapes``, ...)."""
    if not isinstance(spec, DeviceSpec):
        raise DeviceSpecError(f"{caller}: spec must be a DeviceSpec, got {spec!r}")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise DeviceSpecError(
            f"{caller}: device must be 'cpu' or an available 'cuda', got {device!r}"
        )


def _run_workers(worker: Callable[..., None], world: int, *args: Any) -> list[dict[str, Any]]:
    """Each rank's result of ``worker(rank, world, port, *args, out_dir)`` in ``world`` spawned
    processes; killed past :data:`COLLECTIVE_DEADLINE_S` (never hangs). Raises
    :class:`DeviceSpecError` naming the ranks that failed."""
    import torch.multiprocessing as mp

    from ..tune.launch import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="slapo-calibrate-") as tmp:
        procs = [
            ctx.Process(target=worker, args=(r, world, port, *args, tmp)) for r in range(world)
        ]
        for p in procs:
            p.start()
        end = time.monotonic() + COLLECTIVE_DEADLINE_S
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        errors = []
        results = []
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                errors.append(f"rank {rank}: still running after {COLLECTIVE_DEADLINE_S}s, killed")
                continue
            path = Path(tmp) / f"rank{rank}.json"
            if not path.exists():
                errors.append(f"rank {rank}: exited with code {p.exitcode} and no result")
                continue
            res = json.loads(path.read_text())
            if not res["ok"]:
                errors.append(f"rank {rank}:\n{res['error']}")
            results.append(res)
    if errors:
        raise DeviceSpecError(
            f"calibrate: timing collectives on {world} processes failed; fix the cause below, "
            "or pass world=1 with a base to keep its link:\n" + "\n".join(errors)
        )
    return results


def _collective_seconds(world: int, backend: str, plan: _Plan) -> dict[tuple[str, int], float]:
    """``{(op, message bytes): seconds}`` timed by ``world`` spawned processes (never hangs)."""
    results = _run_workers(_collective_worker, world, backend, plan)
    keys: list[Any] = [(op, nbytes) for op in _OPS for nbytes in plan.messages]
    if backend == "gloo":
        keys += [("fsdp_unit", 0), ("pipeline_microbatch", 0)]
    return dict(zip(keys, results[0]["seconds"], strict=True))


def _fit_link(seconds: dict[tuple[str, int], float], world: int) -> Link:
    """A :class:`Link` in :meth:`Link.seconds`'s convention from small/large message times:
    per op, bandwidth = the slope between them; latency = what the small one takes beyond its
    bytes, per ring step (never below 0). The ops' figures are averaged."""
    small, large = sorted({nbytes for op, nbytes in seconds if op in _OPS})
    bandwidths, latencies = [], []
    for op in _OPS:
        sent_s, steps = _ring(op, small, world)
        sent_l, _ = _ring(op, large, world)
        t_s, t_l = seconds[(op, small)], seconds[(op, large)]
        # a large message no slower than the small one (noise): bandwidth from the large alone
        bandwidths.append((sent_l - sent_s) / (t_l - t_s) if t_l > t_s else sent_l / t_l)
    bandwidth = statistics.fmean(bandwidths)
    for op in _OPS:
        sent_s, steps = _ring(op, small, world)
        latencies.append(max(0.0, seconds[(op, small)] - sent_s / bandwidth) / steps)
    return Link(_sig(bandwidth / 1e9), _sig(statistics.fmean(latencies) * 1e6))


# --- the device spec --------------------------------------------------------------------------


def _ram_gib() -> float:
    """This host's total RAM (GiB): ``os.sysconf``, else psutil, else ``/proc/meminfo``."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):
        pass
    try:
        import psutil

        return psutil.virtual_memory().total / 2**30
    except ImportError:
        pass
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024 / 2**30
    raise DeviceSpecError("calibrate_device: cannot read this host's RAM size; use a base")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _check_args(device: Any, dtype: Any, name: Any, base: Any, world: Any, quick: Any) -> None:
    if device not in ("cpu", "cuda"):
        raise DeviceSpecError(f"calibrate_device: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceSpecError(
            "calibrate_device: device='cuda' but torch sees no CUDA GPU; calibrate device='cpu'"
        )
    if dtype not in _DTYPES:
        raise DeviceSpecError(
            f"calibrate_device: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}"
        )
    if name is not None and (not isinstance(name, str) or not name):
        raise DeviceSpecError(f"calibrate_device: name must be a non-empty string, got {name!r}")
    if base is not None and not isinstance(base, DeviceSpec):
        raise DeviceSpecError(
            f"calibrate_device: base must be a DeviceSpec (e.g. PRESETS['h200']), got "
            f"{type(base).__name__}"
        )
    if base is not None and dtype not in base.peak_tflops:
        raise DeviceSpecError(
            f"calibrate_device: base {base.name!r} has no peak_tflops[{dtype!r}] to take the "
            f"dtype's fraction of; pick dtype from {sorted(base.peak_tflops)}"
        )
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise DeviceSpecError(
            f"calibrate_device: world must be an int >= 1 (processes timing the collectives; "
            f"1 skips them), got {world!r}"
        )
    if not isinstance(quick, bool):
        raise DeviceSpecError(f"calibrate_device: quick must be True or False, got {quick!r}")


def _fraction(kind: str, measured: float, peak: float) -> float:
    """``measured / peak`` as an efficiency; above 1 (the peak is not one here) it is clamped."""
    value = _sig(measured / peak)
    if value > 1.0:
        warnings.warn(
            f"calibrate_device: the measured {kind} rate ({measured:.4g}) exceeds the base's "
            f"peak ({peak:.4g}); efficiency[{kind!r}] clamped to 1.0 (check the base matches "
            "this device)",
            stacklevel=3,
        )
        return 1.0
    return value


def calibrate_device(
    device: str = "cpu",
    *,
    dtype: str = "bf16",
    name: str | None = None,
    base: DeviceSpec | None = None,
    world: int = 2,
    quick: bool = False,
) -> DeviceSpec:
    """Measure this machine's matmul, attention, memory and collective rates (module doc).

    Args:
        device: ``"cpu"`` or ``"cuda"`` (the current GPU).
        dtype: the dtype of the GEMMs, attention and add (``bf16``, ``fp16``, ``fp32``). On a
            device without ``base`` bf16 GEMMs are timed too (a device file needs its peak).
        name: the device's name (default: the base's or the device's, ``-calibrated`` added).
        base: a datasheet :class:`DeviceSpec` of this device: its peaks, memory size and link
            bandwidth are kept and the measurements become ``efficiency`` fractions of them.
        world: processes timing the collectives (gloo for the CPU, NCCL on GPUs); ``1`` skips
            them and keeps ``base``'s link (as does CUDA with a single GPU).
        quick: smaller sizes and fewer repeats (seconds on a CPU; for tests and smoke runs).

    Raises:
        DeviceSpecError: a bad argument (named), no GPU for ``device="cuda"``, no ``base`` where
            the link cannot be measured, or the collective processes failed or timed out.

    Example:
        >>> from slapo.plan.hardware import PRESETS
        >>> # illustration: measuring takes seconds and times collectives in 2 worker processes;
        >>> # the h200 lines need a GPU
        >>> spec = calibrate_device("cpu", dtype="fp32", world=2, quick=True)  # doctest: +SKIP
        >>> sorted(spec.peak_tflops), spec.efficiency["memory"]  # doctest: +SKIP
        (['bf16', 'fp32'], 1.0)
        >>> h200 = calibrate_device("cuda", base=PRESETS["h200"], world=1)  # doctest: +SKIP
        >>> 0 < h200.efficiency["matmul"] <= 1  # doctest: +SKIP
        True
    """
    _check_args(device, dtype, name, base, world, quick)
    plan = _plan(device, quick)
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if device == "cuda"
        else torch.device("cpu")
    )
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda" and world > 1:
        gpus = torch.cuda.device_count()
        if gpus < 2:
            world = 1  # one GPU: nothing to time collectives between
        elif world > gpus:
            raise DeviceSpecError(
                f"calibrate_device: world={world} needs as many GPUs, this host has {gpus}"
            )
    if world == 1 and base is None:
        raise DeviceSpecError(
            "calibrate_device: no collective is timed (world=1, or a single GPU), so the link "
            "must come from a base: pass base=PRESETS[...] or world >= 2"
        )

    matmul_dtypes = [dtype] if base is not None or dtype == "bf16" else [dtype, "bf16"]
    matmul = {dt: _matmul_tflops(dev, _DTYPES[dt], plan) for dt in matmul_dtypes}
    attention = _attention_tflops(dev, _DTYPES[dtype], plan)
    memory = _memory_gbps(dev, _DTYPES[dtype], plan)
    # a CPU dispatches each op on the cores that compute; a GPU's launches overlap its kernels
    overhead = selective = None
    if device == "cpu":
        overhead, selective = (_sig(us) for us in _host_overheads_us(dev, plan))
    timed = _collective_seconds(world, backend, plan) if world > 1 else {}
    link = _fit_link(timed, world) if timed else None
    engine: dict[str, float] = {}
    if selective is not None:
        engine["sac_op"] = selective
    for unit in ("fsdp_unit", "pipeline_microbatch"):  # latency included (DeviceSpec doc)
        if (unit, 0) in timed:
            engine[unit] = _sig(timed[(unit, 0)] * 1e6)

    if base is not None:
        peak = base.peak_tflops[dtype]
        peaks, hbm_gib, hbm_gbps = dict(base.peak_tflops), base.hbm_gib, base.hbm_gbps
        efficiency = {
            "matmul": _fraction("matmul", matmul[dtype], peak),
            "attention": _fraction("attention", attention, peak),
            "memory": _fraction("memory", memory, base.hbm_gbps),
            "collective": base.efficiency["collective"],
        }
        intra = base.intra_node
        if link is not None:  # the datasheet bandwidth stays; the latency is measured
            efficiency["collective"] = _fraction("collective", link.gbps, base.intra_node.gbps)
            intra = Link(base.intra_node.gbps, link.latency_us)
    else:
        assert link is not None  # checked above: no base means collectives are timed
        peaks = {dt: _sig(rate) for dt, rate in matmul.items()}
        if device == "cuda":
            hbm_gib = _sig(torch.cuda.get_device_properties(dev).total_memory / 2**30)
        else:
            hbm_gib = _sig(_ram_gib())
        hbm_gbps, intra = _sig(memory), link
        efficiency = {
            "matmul": 1.0,
            "attention": _fraction("attention", attention, matmul[dtype]),
            "memory": 1.0,
            "collective": 1.0,
        }

    hardware = torch.cuda.get_device_name(dev) if device == "cuda" else f"cpu {_cpu_name()}"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    b, h, s, d = plan.attention
    measured = [
        "matmul "
        + ", ".join(f"{dt} {_sig(r)} TFLOPS" for dt, r in matmul.items())
        + f" (GEMMs m,n,k {', '.join('x'.join(map(str, g)) for g in plan.gemms)})",
        f"attention {_sig(attention)} TFLOPS (sdpa causal fwd+bwd b={b} h={h} s={s} d={d})",
        f"memory {_sig(memory)} GB/s (add of {plan.memory_elems} elements)",
    ]
    if overhead is not None:
        measured.append(
            f"op overhead {overhead} us (a 16-wide Llama's training step, per op), "
            f"{selective} us more per op through a selective checkpoint (save_matmuls)"
        )
    if link is not None:
        measured.append(
            f"collectives {link.gbps} GB/s, {link.latency_us} us ({backend} x{world}, "
            f"all_gather/all_reduce of {plan.messages[0]} and {plan.messages[1]} bytes)"
        )
    else:
        measured.append("collectives not timed (one process)")
    if "fsdp_unit" in engine:
        measured.append(
            f"FSDP2 {engine['fsdp_unit']} us per unit, its collectives' latency included "
            f"(stacks of {' and '.join(map(str, FSDP_DEPTHS))} units {FSDP_WIDTH} wide)"
        )
    if "pipeline_microbatch" in engine:
        measured.append(
            f"pipeline {engine['pipeline_microbatch']} us per microbatch, its sends' latency "
            f"included (1F1B of {' and '.join(str(world * n) for n in PIPELINE_MICROBATCHES)} "
            f"microbatches through {world} stages {FSDP_WIDTH} wide)"
        )
    source = (
        f"calibrated on {socket.gethostname()} ({hardware}, {torch.get_num_threads()} threads), "
        f"{date}, torch {torch.__version__}, {dtype}{', quick' if quick else ''}: "
        + "; ".join(measured)
        + "; median of "
        + f"{plan.repeats} after {plan.warmup} warmup"
    )
    if base is not None:
        source += (
            f". Peaks, memory size and bandwidth, link bandwidth from {base.name}: {base.source}"
        )
    fields = {
        "name": name or f"{base.name if base is not None else device}-calibrated",
        "peak_tflops": peaks,
        "hbm_gib": hbm_gib,
        "hbm_gbps": hbm_gbps,
        "intra_node": intra,
        "efficiency": efficiency,
        "source": source,
    }
    if overhead is not None:
        fields["op_overhead_us"] = overhead
    if engine:
        fields["engine_overhead_us"] = engine
    if device == "cpu":
        # a CPU's collectives run on threads that take the very cores computing: what overlaps
        # compute slows it by as much
        fields["overlap_slowdown"] = 1.0
        fields["host_cores"] = torch.get_num_threads()  # the cores its rates are measured on
    # a base's fields this does not measure stay the base's; without one, the defaults
    return dataclasses.replace(base, **fields) if base is not None else DeviceSpec(**fields)


def _parse_shape(key: str) -> tuple[str, str, torch.dtype, list[int], bool]:
    """(kind, direction or operand layout, dtype, dims, causal) of a
    :func:`~slapo.plan.step_time.shape_key`."""
    words = key.split()
    try:
        kind = words[0]
        way = words[1] if kind == "attention" else ""
        dtype = _DTYPES[words[2] if way else words[1]]
        dims = [int(d) for d in words[3 if way else 2].split("x")]
        layout = words[3] if kind == "matmul" else ""
        ok = (
            kind == "matmul"
            and len(dims) in (3, 4)
            and len(words) == 4
            and set(layout) <= {"n", "t"}
            and len(layout) == 2
        ) or (kind == "attention" and way in ("fwd", "bwd") and len(dims) == 4)
    except (IndexError, KeyError, ValueError):
        ok = False
    if not ok:
        raise DeviceSpecError(
            f"calibrate_shapes: cannot read shape key {key!r}; keys are what "
            "slapo.plan.step_time.shape_key gives, e.g. 'matmul fp32 1024x384x128 nt'"
        )
    return kind, way or layout, dtype, dims, words[-1] == "causal"


def _shape_tflops(key: str, device: torch.device, plan: _Plan) -> float:
    """The rate of the op ``key`` names, at its shape, FLOPs counted as the counter counts."""
    kind, way, dtype, dims, causal = _parse_shape(key)
    if kind == "matmul":
        *batch, m, n, k = dims

        def operand(rows: int, cols: int, transposed: bool) -> torch.Tensor:
            if transposed:  # stored the other way round, used as a transposed view
                return torch.randn(*batch, cols, rows, device=device, dtype=dtype).transpose(-1, -2)
            return torch.randn(*batch, rows, cols, device=device, dtype=dtype)

        a, b = operand(m, k, way[0] == "t"), operand(k, n, way[1] == "t")
        flush = _cache_flusher(device)
        seconds = _median_seconds(
            lambda: torch.matmul(a, b), device, plan.warmup, plan.repeats, before=flush
        )  # fmt: skip
        return 2 * math.prod(dims) / seconds / 1e12
    bh, s_q, s_k, d = dims
    q = torch.randn(1, bh, s_q, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(1, bh, s_k, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2)
    )
    grad = torch.randn(1, bh, s_q, d, device=device, dtype=dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward() -> torch.Tensor:
        return sdpa(q, k, v, is_causal=causal)

    def both() -> None:
        q.grad = k.grad = v.grad = None
        forward().backward(grad)

    flush = _cache_flusher(device)
    with torch.no_grad():
        fwd = _median_seconds(forward, device, plan.warmup, plan.repeats, before=flush)
    flops = 4 * bh * s_q * s_k * d // (2 if causal else 1)
    if way == "fwd":
        return flops / fwd / 1e12
    bwd = max(1e-9, _median_seconds(both, device, plan.warmup, plan.repeats, before=flush) - fwd)
    return flops * 2.5 / bwd / 1e12


def calibrate_shapes(
    spec: DeviceSpec,
    keys: list[str] | tuple[str, ...],
    *,
    device: str = "cpu",
    threads: int | None = None,
    quick: bool = False,
) -> DeviceSpec:
    """``spec`` with the rate of each op shape in ``keys`` measured here (module doc), in its
    ``op_tflops``: a CPU's keyed `` @<threads>t`` (the thread count a rank computes with:
    torchrun gives each process one), a GPU's as they are.

    Args:
        spec: the device (from :func:`calibrate_device`, a preset or a file).
        keys: shape keys (:func:`slapo.plan.step_time.shape_key`): a prediction's
            ``counts["shapes"]``, or :meth:`StepCounts.shapes`.
        device: ``"cpu"`` or ``"cuda"`` (the current GPU).
        threads: the CPU threads to measure with (default: torch's current count).
        quick: fewer repeats.

    Raises:
        DeviceSpecError: a key that is not a shape key, or a bad argument.

    Example:
        >>> # illustration: calibrate_device measures for seconds in 2 worker processes
        >>> cpu = calibrate_device("cpu", quick=True)  # doctest: +SKIP
        >>> cpu = calibrate_shapes(cpu, ["matmul fp32 1024x384x128 nt"], threads=1, quick=True)  # doctest: +SKIP
        >>> sorted(cpu.op_tflops)  # doctest: +SKIP
        ['matmul fp32 1024x384x128 nt @1t']
    """
    _check_measured("calibrate_shapes", spec, device)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):  # fmt: skip
        raise DeviceSpecError(f"calibrate_shapes: threads must be an int >= 1, got {threads!r}")
    plan = dataclasses.replace(_plan(device, quick=True), repeats=3 if quick else 9)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
    dev = dev or torch.device("cpu")
    before = torch.get_num_threads()
    count = threads or before
    suffix = f" @{count}t" if device == "cpu" else ""
    table = dict(spec.op_tflops)
    try:
        torch.set_num_threads(count)
        for key in keys:
            table[key + suffix] = _sig(_shape_tflops(key, dev, plan))
    finally:
        torch.set_num_threads(before)
    return dataclasses.replace(spec, op_tflops=table)


def _parse_collective(key: str) -> tuple[str, int, int]:
    """(kind, bytes a rank contributes, group size) of a
    :func:`~slapo.plan.step_time.collective_key`."""
    words = key.split()
    try:
        kind, nbytes, group = words
        ok = (
            kind in ("all_reduce", "all_gather", "reduce_scatter")
            and nbytes.endswith("B") and group.startswith("x")
        )  # fmt: skip
        size, ranks = int(nbytes[:-1]), int(group[1:])
        ok = ok and size > 0 and ranks >= 2 and size % 4 == 0
    except ValueError:
        ok = False
    if not ok:
        raise DeviceSpecError(
            f"calibrate_collectives: cannot read collective key {key!r}; keys are what "
            "slapo.plan.step_time.collective_key gives, e.g. 'all_reduce 262144B x2'"
        )
    return kind, size, ranks


def _collective_call(kind: str, x: torch.Tensor, group: Any, ranks: int) -> Callable[[], Any]:
    import torch.distributed as dist

    if kind == "all_reduce":
        return functools.partial(dist.all_reduce, x, group=group)
    from ..sharding.collectives import gather_into, scatter_into

    if kind == "all_gather":
        return functools.partial(gather_into, x.new_empty(x.numel() * ranks), x, group)
    return functools.partial(scatter_into, x.new_empty(x.numel() // ranks), x, group)


#: The compute each rank runs before each timed collective call (:func:`calibrate_collectives`):
#: a GEMM of this size, about a millisecond on one CPU core.
BURST_GEMM = 256


def _collective_calls_worker(
    rank: int, world: int, port: int, backend: str, keys: list[str], repeats: int, out_dir: str
) -> None:
    """One rank: each key's call, in groups of its size over consecutive ranks (all groups at
    once), after a burst of compute; the slowest rank's mean seconds (rank 0 writes)."""
    import torch.distributed as dist

    import slapo.env

    result: dict[str, Any]
    try:
        if backend == "gloo":
            torch.set_num_threads(1)  # the ranks share this host's cores, as torchrun's do
        slapo.env.setup(rank, world, backend, master_port=port, timeout=COLLECTIVE_TIMEOUT_S)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        device = device or torch.device("cpu")
        burst = BURST_GEMM if device.type == "cpu" else 16 * BURST_GEMM
        a = torch.randn(burst, burst, device=device)
        groups: dict[int, Any] = {}
        means = []
        for key in keys:
            kind, nbytes, ranks = _parse_collective(key)
            if ranks not in groups:  # every rank makes every group (new_group's contract)
                made = [dist.new_group(list(range(g, g + ranks))) for g in range(0, world, ranks)]
                groups[ranks] = made[rank // ranks]
            call = _collective_call(kind, torch.ones(nbytes // 4, device=device), groups[ranks],
                                    ranks)  # fmt: skip
            dist.barrier()  # the ranks start each key together; then compute, as a step does
            times = []
            for i in range(repeats + 2):
                a @ a  # noqa: B018 - the compute a step runs before its collective
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 2:  # the first two warm the buffers
                    times.append(time.perf_counter() - t0)
            # the mean: a call's time is bimodal here (it waits on its peer's compute, or
            # not), and a step pays the sum of its calls
            means.append(statistics.fmean(times))
        slowest = torch.tensor(means, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        result = {"ok": True, "seconds": slowest.tolist()}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": traceback.format_exc()}
    _finish_worker(out_dir, rank, result)


def calibrate_collectives(
    spec: DeviceSpec,
    keys: list[str] | tuple[str, ...],
    *,
    device: str = "cpu",
    world: int | None = None,
    quick: bool = False,
) -> DeviceSpec:
    """``spec`` with the time of each collective call in ``keys`` measured here, in its
    ``collective_us``: processes on this host (gloo on the CPU, a GPU each with NCCL) run each
    call in groups of its size, every call after a burst of compute as a step issues it. A
    call issued after compute costs more than the same call back to back (on 2 CPU cores, a
    256 KiB gloo all-reduce took 1.7 ms after a GEMM, 0.4 ms back to back), and a tight loop
    of one size is what the link's fit (:func:`calibrate_device`) comes from.

    Args:
        spec: the device (from :func:`calibrate_device`, a preset or a file).
        keys: collective keys (:func:`slapo.plan.step_time.collective_key`): a prediction's
            ``counts["collective_keys"]``, or :meth:`StepCounts.collective_keys`.
        device: ``"cpu"`` or ``"cuda"``.
        world: processes (default: the largest group of ``keys``); a multiple of each group.
        quick: fewer repeats.

    Raises:
        DeviceSpecError: a key that is not a collective key, a bad argument, or the processes
            failed.

    Example:
        >>> # illustration: times the calls in 2 worker processes, seconds
        >>> cpu = calibrate_device("cpu", quick=True)  # doctest: +SKIP
        >>> cpu = calibrate_collectives(cpu, ["all_reduce 262144B x2"], quick=True)  # doctest: +SKIP
        >>> sorted(cpu.collective_us)  # doctest: +SKIP
        ['all_reduce 262144B x2']
    """
    _check_measured("calibrate_collectives", spec, device)
    keys = list(keys)
    sizes = [_parse_collective(k)[2] for k in keys]
    if not keys:
        return spec
    world = world or max(sizes)
    if isinstance(world, bool) or not isinstance(world, int) or any(world % g for g in sizes):
        raise DeviceSpecError(
            f"calibrate_collectives: world must be an int, a multiple of every group size "
            f"{sorted(set(sizes))}, got {world!r}"
        )
    if device == "cuda" and world > torch.cuda.device_count():
        raise DeviceSpecError(
            f"calibrate_collectives: world={world} needs as many GPUs, this host has "
            f"{torch.cuda.device_count()}"
        )
    backend = "nccl" if device == "cuda" else "gloo"
    results = _run_workers(
        _collective_calls_worker, world, backend, keys, 5 if quick else 40
    )  # fmt: skip
    table = dict(spec.collective_us)
    for key, seconds in zip(keys, results[0]["seconds"], strict=True):
        table[key] = _sig(seconds * 1e6)
    return dataclasses.replace(spec, collective_us=table)


def write_calibration(path: str | os.PathLike, **kwargs: Any) -> DeviceSpec:
    """:func:`calibrate_device` (``kwargs`` are its arguments), written to ``path`` atomically
    as a device file :func:`~slapo.plan.hardware.load_device` reads.

    Example:
        >>> from slapo.plan.hardware import load_device
        >>> # illustration: measuring takes seconds and times collectives in 2 worker processes
        >>> spec = write_calibration("cpu.json", device="cpu", quick=True)  # doctest: +SKIP
        >>> load_device("cpu.json") == spec  # doctest: +SKIP
        True
    """
    spec = calibrate_device(**kwargs)
    save_device(spec, path)
    return spec

"""The planner's predicted step time of the main job beside the measured one, on this CPU.

For each layout of the main job (``slapo train``'s defaults: Llama ``tiny``, batch 8 per
replica, 128 tokens, fp32 on the CPU): eager (one process), ddp and fsdp (2 processes), a
pipeline (``--pp 2``) and dp2 x pp2 x tp2 (8 processes),

1. the prediction: :func:`slapo.plan.search.predict_config` of the very ``TrainConfig`` the run
   uses (its model a config-only directory of the same model), on a ``ClusterSpec`` of this host:
   the device calibrated here (:func:`slapo.plan.calibrate.calibrate_device`, fp32), every rank
   on the cores the device was calibrated on (``host_cores``), one thread per torchrun process
   and all the cores for the single process (``ClusterSpec.threads``). The cores are shared
   with whatever else runs here, and a calibration on all of them halves (or worse) when one
   core is busy elsewhere (an op on two threads waits for its slowest one), so one calibration
   runs before each measured run and each rate is the best of them (:func:`best_of`): the
   host's own rates. ``--device-file`` caches that device (read if it exists);
2. the measurement: the real ``slapo train`` (``torchrun --nproc-per-node N -m slapo train``
   beyond one process) for ``--steps`` steps; its seconds per step are the median of the steps
   after the first ``1 + MEMORY_SAMPLE_STEPS`` (the first compiles and warms up, the next ones
   count saved bytes with hooks), from rank 0's ``metrics.json``.

Then each layout's GEMM and attention shapes (the prediction's ``counts["shapes"]``) are measured
at the thread count its ranks run with (:func:`slapo.plan.calibrate.calibrate_shapes`) and the
layout predicted again with those rates.

Printed: the layout, predicted and measured seconds per step (the fastest steady step too), their
ratios and the prediction's largest terms. It exits non-zero only when a run or a prediction
fails; it asserts nothing about timings. About two minutes on 2 cores.

    .venv/bin/python benchmarks/plan_step_time.py [--steps 24] [--device-file cpu.json]
        [--layouts eager,ddp,fsdp,pipeline,dp2-pp2-tp2] [--json out.json]

Measured here (2 vCPUs, AMD EPYC, torch 2.13, the machine otherwise idle; 28 November 2026):
the stop-43 model (its own idle run that day) and this model, two idle runs (pred/meas each):

    layout       procs  measured (run 1, 2)   stop 43  run 1  run 2
    eager            1   0.044  0.038           0.99   1.15   1.19
    ddp              2   0.100  0.100           0.75   1.03   1.02
    fsdp             2   0.131  0.135           0.66   0.92   0.89
    pipeline         2   0.091  0.095           0.60   0.94   0.89
    dp2-pp2-tp2      8   0.366  0.336           0.56   0.81   0.83

Every host term is measured here and none is fitted to these runs:

* the rate of every GEMM and attention kernel at its own shape and operand layout, at the ranks'
  thread count, its operands cold (``calibrate_shapes``; the uncompiled step's GEMMs ran 4%
  slower than predicted cold, 10% faster than repeated hot);
* each op's host cost, measured on a 16-wide Llama's training step (3.6-4 us);
* a selective checkpoint's dispatch, uncompiled: every op of a ``save_matmuls`` block passes
  through torch's caching and replaying Python modes, 10-14 us more per op (about 580 ops a
  step: 7 ms). The fake step counts those ops from the Python frames above its counter;
* FSDP2's cost per unit with its collectives' latency (3-6 ms on gloo), and a pipeline's per
  microbatch (torch.distributed.pipelining's actions and sends: 0.3-0.6 ms);
* each tensor-parallel all-reduce at its own size, issued after compute as a step issues it
  (``calibrate_collectives``): a 256 KiB all-reduce takes 1.3-1.8 ms so, 0.4 ms back to back,
  which is what the link fitted to a tight loop says;
* eight processes on two cores take turns: the step is at least every rank's busy time (all but
  the bubble) over the cores (``ClusterSpec.time_shared``); on the real run the eight ranks
  used 1.9 of the 2 cores (0.76 CPU-seconds per 0.40 s step).

What still moves the figures: the other processes on these cores, and this host's memory
bandwidth, which measures 45-50 or 78-85 GB/s from one calibration to the next (the median of
the calibrations is taken). On a loaded machine (load 5-10) the ratios moved 2-4x between runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slapo.plan.calibrate import calibrate_collectives, calibrate_device, calibrate_shapes
from slapo.plan.hardware import ClusterSpec, DeviceSpec, Link, load_device, save_device
from slapo.plan.search import predict_config
from slapo.plan.step_time import StepPrediction
from slapo.train.config import TrainConfig
from slapo.train.loop import MEMORY_SAMPLE_STEPS

# name: (processes, slapo train flags)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "eager": (1, []),
    "ddp": (2, ["--target", "ddp"]),
    "fsdp": (2, ["--target", "fsdp"]),
    "pipeline": (2, ["--pp", "2"]),
    "dp2-pp2-tp2": (8, ["--tp", "2", "--pp", "2"]),
}
#: Steps left out of the measured figure: the first (compilation, warm-up) and those whose saved
#: bytes are counted by hooks (slapo.train.loop.MEMORY_SAMPLE_STEPS).
SKIPPED_STEPS = 1 + MEMORY_SAMPLE_STEPS


def run_config(flags: list[str]) -> TrainConfig:
    """The ``TrainConfig`` ``slapo train --device cpu <flags>`` runs (its own parser)."""
    from slapo.cli import build_parser
    from slapo.train.train_cli import config_from_args

    args = build_parser().parse_args(["train", "--device", "cpu", *flags])
    return config_from_args(args)


def model_directory(cfg: TrainConfig, root: Path) -> Path:
    """A config-only directory of ``cfg``'s model (what ``predict_config`` reads)."""
    from slapo.initialization import init_empty_weights
    from slapo.train.presets import build_model

    with init_empty_weights():
        model = build_model(cfg, weights=False)
    path = root / "model"
    model.config.save_pretrained(path)
    return path


def best_of(runs: list[DeviceSpec]) -> DeviceSpec:
    """The fastest rate of each kind over ``runs`` (calibrations of one host): other processes
    on these cores only ever slow a measurement (an op on all the cores waits for its slowest
    thread, so one busy core can halve it), so the best of a few is the host's own rate. The
    memory bandwidth is their median: it comes out high now and then (85 GB/s among 45-50)."""
    fp32 = max(r.peak_tflops["fp32"] for r in runs)
    attention = max(r.achievable_tflops("attention", "fp32") for r in runs)
    link = Link(max(r.intra_node.gbps for r in runs), min(r.intra_node.latency_us for r in runs))
    best = runs[0]
    engine = {k: min(r.engine_overhead_us.get(k, v) for r in runs)
              for k, v in best.engine_overhead_us.items()}  # fmt: skip
    return dataclasses.replace(
        best,
        op_overhead_us=min(r.op_overhead_us for r in runs),
        engine_overhead_us=engine,
        peak_tflops={dt: max(r.peak_tflops[dt] for r in runs) for dt in best.peak_tflops},
        hbm_gbps=statistics.median(r.hbm_gbps for r in runs),
        efficiency={**best.efficiency, "attention": min(1.0, round(attention / fp32, 4))},
        intra_node=link,
        source=f"best of {len(runs)} calibrations, each rate its own best; the first: "
        + best.source,
    )


def calibrate(quick: bool) -> DeviceSpec:
    """This CPU calibrated once in fp32 (the main job's precision here), its rates printed."""
    r = calibrate_device("cpu", dtype="fp32", world=2, quick=quick)
    print(f"calibrated (load {os.getloadavg()[0]:.1f}): fp32 {r.peak_tflops['fp32']:.4g} TFLOPS, "
          f"attention {r.achievable_tflops('attention', 'fp32'):.4g} TFLOPS, memory "
          f"{r.hbm_gbps} GB/s, gloo {r.intra_node.gbps} GB/s {r.intra_node.latency_us} us",
          flush=True)  # fmt: skip
    return r


def cluster_for(dev: DeviceSpec, processes: int) -> ClusterSpec:
    """This host running ``processes`` ranks on the cores ``dev`` was calibrated on
    (``host_cores``), as ``slapo plan --device-file`` describes it: torchrun gives each of
    several processes one thread (``OMP_NUM_THREADS`` where set), a lone process has them all.
    The collectives at the link calibrated between two processes, a core each: more ranks than
    cores take turns (``ClusterSpec.time_shared``), which the model adds itself."""
    threads = os.environ.get("OMP_NUM_THREADS") if processes > 1 else None
    return ClusterSpec(
        dev, gpus_per_node=processes, threads_per_rank=int(threads) if threads else None
    )  # fmt: skip


def predict(cfg: TrainConfig, model_dir: Path, dev: DeviceSpec, processes: int) -> StepPrediction:
    """The planner's prediction of ``cfg`` on ``processes`` ranks of this host, its matmuls and
    attention at the rates of their own shapes (measured here at the ranks' thread count, once
    per shape: :func:`calibrate_shapes`)."""
    dp = processes // (cfg.tp * cfg.pp * cfg.cp)
    planned = dataclasses.replace(cfg, model=str(model_dir))
    cluster = cluster_for(dev, processes)
    first = predict_config(planned, cluster, dp=dp)
    threads = cluster.threads(processes)
    suffix = f" @{threads}t"
    missing = [k for k in first.counts["shapes"] if k + suffix not in SHAPE_RATES]
    if missing:
        SHAPE_RATES.update(calibrate_shapes(dev, missing, threads=threads).op_tflops)
    calls = [k for k in first.counts["collective_keys"] if k not in CALL_TIMES]
    if calls:
        CALL_TIMES.update(calibrate_collectives(dev, calls).collective_us)
    shaped = dataclasses.replace(
        cluster.device, op_tflops=dict(SHAPE_RATES), collective_us=dict(CALL_TIMES)
    )  # fmt: skip
    return predict_config(planned, dataclasses.replace(cluster, device=shaped), dp=dp)


#: The op shapes measured so far (``DeviceSpec.op_tflops`` keys and rates), shared by layouts.
SHAPE_RATES: dict[str, float] = {}
#: The collective calls measured so far (``DeviceSpec.collective_us``), shared by layouts.
CALL_TIMES: dict[str, float] = {}


def measure(processes: int, flags: list[str], out: Path, steps: int) -> dict[str, float]:
    """Seconds per step of the real run: median and fastest of the steady steps."""
    train = ["-m", "slapo", "train", "--device", "cpu", "--steps", str(steps), "--no-progress",
             "--no-sample", "--no-tensorboard", "--baseline-steps", "0", *flags,
             "--output-dir", str(out)]  # fmt: skip
    launch = [sys.executable]
    if processes > 1:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
    t0 = time.perf_counter()
    done = subprocess.run([*launch, *train], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{' '.join(launch + train)} failed:\n{done.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    tokens = metrics["config"]["batch_size"] * metrics["config"]["seq_len"]
    tokens *= processes // (metrics["config"]["tp"] * metrics["config"]["pp"])
    seconds = [tokens / tps for tps in metrics["step_tokens_per_s"][SKIPPED_STEPS:]]
    return {"median": statistics.median(seconds), "fastest": min(seconds), "wall": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--device-file", help="the CPU's calibration (read if it exists, else "
                        "calibrated before each run and the best rates written there)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="quick calibrations")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--json", help="write the table as JSON here")
    args = parser.parse_args()
    if args.steps <= SKIPPED_STEPS:
        parser.error(f"--steps must exceed the {SKIPPED_STEPS} warm-up steps left out")
    names = args.layouts.split(",")
    unknown = set(names) - set(LAYOUTS)
    if unknown:
        parser.error(f"--layouts: unknown {sorted(unknown)}; choose from {list(LAYOUTS)}")
    started = time.perf_counter()
    known = args.device_file and Path(args.device_file).exists()
    calibrations = [load_device(args.device_file)] if known else []
    measured: dict[str, dict[str, float]] = {}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="plan-step-time-") as tmp:
        root = Path(tmp)
        # measure first, a calibration before each run: the best rates of the whole window
        for name in names:
            if not known:
                calibrations.append(calibrate(args.quick))
            processes, flags = LAYOUTS[name]
            measured[name] = got = measure(processes, flags, root / name, args.steps)
            print(f"{name} (load {os.getloadavg()[0]:.1f}): {got['median']:.3f} s/step "
                  f"(fastest {got['fastest']:.3f} s), run {got['wall']:.0f} s", flush=True)  # fmt: skip
        dev = calibrations[0] if known else best_of(calibrations)
        if args.device_file and not known:
            save_device(dev, args.device_file)
        print(f"\ndevice: {dev.source}")
        model_dir = model_directory(run_config([]), root)
        for name in names:
            processes, flags = LAYOUTS[name]
            pred = predict(run_config(flags), model_dir, dev, processes)
            got = measured[name]
            rows.append({
                "layout": name, "processes": processes, "predicted_s": pred.seconds,
                "measured_s": got["median"], "fastest_s": got["fastest"],
                "ratio": pred.seconds / got["median"],
                "ratio_fastest": pred.seconds / got["fastest"], "run_wall_s": got["wall"],
                "terms": dict(pred.top_terms(8)),
            })  # fmt: skip
    print(f"\n{'layout':<12} {'procs':>5} {'predicted':>9} {'measured':>9} {'fastest':>8} "
          f"{'pred/meas':>9} {'pred/fast':>9}  top terms (s)")  # fmt: skip
    for r in rows:
        terms = ", ".join(f"{k} {v:.3f}" for k, v in list(r["terms"].items())[:5])
        print(f"{r['layout']:<12} {r['processes']:>5} {r['predicted_s']:>9.3f} "
              f"{r['measured_s']:>9.3f} {r['fastest_s']:>8.3f} {r['ratio']:>9.2f} "
              f"{r['ratio_fastest']:>9.2f}  {terms}")  # fmt: skip
    within = sum(abs(r["ratio"] - 1) <= 0.25 for r in rows)
    fast = sum(abs(r["ratio_fastest"] - 1) <= 0.25 for r in rows)
    print(
        f"\n{within}/{len(rows)} layouts within 25% of the median step ({fast} of the fastest); "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev.source, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The main job on one GPU, item by item, and the one summary table (``scripts/gpu-check.sh``).

1. ``main``: ``python -m slapo train`` on a Llama of 1.1B parameters (hidden 2048, 16 layers, 32
   heads, 8 key/value heads, MLP 8192, vocabulary 32000; random weights in a model directory this
   script writes) in bf16 on CUDA: the recommended schedule beside the unscheduled baseline:
   tokens/s, MFU (:mod:`slapo.throughput`, computed here from ``metrics.json``), peak memory
   against the estimate made before the run, and how far the two runs' losses are apart over the
   baseline's steps (same weights, same batches).
2. ``roundpipe``: the same model and batch on ``--target roundpipe``.
3. ``ours``/``peer``: RoundPipe's own training loop (``wrap_model_to_roundpipe``,
   ``forward_backward``, the C++ Adam stepping asynchronously) on the same model and batch, with
   this project's ``roundpipe`` and with the published one (``scripts/fetch-peer-roundpipe.sh``
   unpacks it into ``third_party/peer-roundpipe``). Each runs in a subprocess whose
   ``PYTHONPATH`` puts its package first; the peer's process imports nothing of ``src/``.
4. ``bulk``: ``compile(rng="bulk")`` against eager training (tiny GPT-2, float32, a few AdamW
   steps): with dropout off the losses must agree (and equal ``compile(rng="eager")``'s); with
   dropout on the masks differ from eager's by design, so the differences are reported only.

Every item runs in a subprocess with a timeout (its budget, cut to what is left before
``--deadline``); ``results.json`` in ``--out`` is rewritten after each, and ``--summary`` prints
the table from it, with the CUDA tests' JUnit XML and ``benchmarks/roundpipe_cuda.py``'s log.

    python benchmarks/gpu_main_job.py --device cuda --out gpu-check-out/main-job
    python benchmarks/gpu_main_job.py --device cpu --small     # the logic, end to end, on a CPU
    python benchmarks/gpu_main_job.py --summary --out DIR [--tests-xml F --tests-rc N] ...
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Top-level imports are the standard library's only: the peer's worker process runs this file
# without ``src/`` on its path, and the orchestrator never initializes CUDA itself.

ROOT = Path(__file__).resolve().parent.parent
PEER_DIR = ROOT / "third_party" / "peer-roundpipe"
RESULT = "RESULT "  # a worker's last line: RESULT {json}

#: The model of each mode: LlamaConfig fields.
SHAPES: dict[str, dict[str, int]] = {
    "1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=32000, max_position_embeddings=4096,
    ),
    "small": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, max_position_embeddings=256,
    ),
}  # fmt: skip


@dataclass
class Plan:
    """Sizes, steps and per-item budgets (seconds) of a mode."""

    shape: str
    batch: int
    seq: int
    steps: int  # the scheduled run of the main job
    baseline_steps: int
    roundpipe_steps: int
    loop_steps: int  # timed steps of ours/peer, after 2 warm-up steps
    bulk_steps: int
    microbatches: int
    budgets: dict[str, int] = field(default_factory=dict)


PLANS = {
    # ~8k tokens a step: about 40 GiB at the eager baseline's peak on an 80 GB H100
    "cuda": Plan("1b", 4, 2048, 20, 8, 6, 4, 5, 2,
                 dict(model=60, main=200, bulk=120, roundpipe=120, ours=90, peer=120)),
    "cpu": Plan("small", 2, 64, 3, 3, 3, 3, 3, 2,
                dict(model=60, main=240, bulk=400, roundpipe=180, ours=120, peer=60)),
}  # fmt: skip

#: The items' names in the summary.
LABELS = {
    "model": "model directory", "main": "main job", "bulk": "compile(rng=bulk)",
    "roundpipe": "roundpipe target", "ours": "ours", "peer": "peer",
}  # fmt: skip

#: Dropout off: compiled (bulk) and eager losses within this (float32; a real mask bug moves the
#: loss by about 1e-2 or more).
BULK_TOLERANCE = 1e-3


@dataclass
class Row:
    """One line of the summary: an item, ``ok``/``FAIL``/``skip``, its figures (text) and the
    numbers behind them."""

    item: str
    status: str
    figures: str
    values: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- subprocesses and the budget


class Budget:
    """Per-item timeouts cut to what is left before a deadline (``time.time()`` seconds)."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def timeout(self, wanted: int) -> float:
        """Seconds the next item may run: its budget, or what is left when that is less; 0 (not
        started: skipped) when under half of its budget is left.

        Example:
            >>> Budget(time.time() + 100).timeout(60), Budget(time.time() + 20).timeout(60)
            (60.0, 0.0)
        """
        if self.deadline is None:
            return float(wanted)
        left = self.deadline - time.time()
        return min(float(wanted), left) if left >= wanted / 2 else 0.0


def run_logged(cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None):
    """Run ``cmd``, its output streamed to stdout and ``log``; returns ``(exit status, output)``.

    At ``timeout`` the whole process group (inductor's compile workers too) gets SIGTERM, then
    SIGKILL; the status is then 124, as coreutils' ``timeout`` says.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append(line)
                sink.write(line)
                sys.stdout.write("  | " + line)
                sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = 124
        except BaseException:  # interrupted (SIGTERM: see main): the item's processes go too
            _kill_group(proc)
            raise
        reader.join(timeout=10)
    return rc, "".join(lines)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group ``proc`` leads, SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def worker_result(output: str) -> dict[str, Any] | None:
    """The JSON of a worker's ``RESULT`` line (the last one), or None.

    Example:
        >>> worker_result('noise\\nRESULT {"tokens_per_s": 5.0}\\n')
        {'tokens_per_s': 5.0}
    """
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    return None


def python_env(first: list[Path], **extra: str) -> dict[str, str]:
    """The environment of a subprocess whose ``PYTHONPATH`` starts with ``first``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in first] + [env.get("PYTHONPATH", "")])
    return env


def failure(item: str, rc: int, timeout: float) -> Row:
    """The row of an item whose process failed (or ran out of time)."""
    why = f"timed out after {timeout:.0f} s" if rc == 124 else f"exit status {rc}"
    return Row(LABELS.get(item, item), "FAIL", why)


# ---------------------------------------------------------------- the figures


def memory(mib: float | None) -> str:
    """MiB as text: GiB from 1 GiB up.

    Example:
        >>> memory(40960.0), memory(1.6), memory(None)
        ('40.00 GiB', '1.6 MiB', 'n/a')
    """
    if mib is None:
        return "n/a"
    return f"{mib / 1024:.2f} GiB" if mib >= 1024 else f"{mib:.1f} MiB"


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def run_figures(run: dict[str, Any], flops_per_token: int, peak: float | None) -> Row:
    """A ``slapo train`` run's row (one entry of ``metrics.json``): tokens/s, MFU, peak memory
    against the estimate.

    Example:
        >>> run = {"label": "scheduled", "tokens_per_s": 2000.0, "peak_memory_mb": 1536.0,
        ...        "estimated_peak_mb": 1024.0}
        >>> run_figures(run, 7_000_000_000, 70.0).figures
        '2,000 tokens/s, MFU 20.0%, peak 1.50 GiB vs estimate 1.00 GiB (-33%)'
    """
    from slapo.throughput import mfu

    tps, peak_mb, est_mb = run["tokens_per_s"], run["peak_memory_mb"], run["estimated_peak_mb"]
    used = mfu(tps, flops_per_token, peak, num_devices=run.get("world_size", 1))
    off = f" ({(est_mb - peak_mb) / peak_mb:+.0%})" if est_mb and peak_mb else ""
    text = f"{tps:,.0f} tokens/s, MFU {pct(used)}, peak {memory(peak_mb)} vs estimate {memory(est_mb)}{off}"
    values = {"tokens_per_s": tps, "mfu": used, "peak_gib": peak_mb / 1024, "estimate_gib": None}
    if est_mb is not None:
        values["estimate_gib"] = est_mb / 1024
    return Row(run.get("label", "run"), "ok", text, values)


def loss_gap(a: list[float], b: list[float]) -> float:
    """The largest difference of two loss curves over their common steps (NaN when either has
    a non-finite loss there).

    Example:
        >>> loss_gap([5.0, 4.0, 3.0], [5.0, 4.5]), loss_gap([float("nan")], [1.0])
        (0.5, nan)
    """
    gaps = [abs(x - y) for x, y in zip(a, b)]
    if not gaps or any(g != g or g == float("inf") for g in gaps):
        return float("nan")
    return max(gaps)


# ---------------------------------------------------------------- the items


class Job:
    """The items of one run, sharing the model directory, the plan and the budget."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # the 1.1B model on the GPU; the tiny one with --small, and always on the CPU
        self.plan = PLANS["cpu" if args.small or args.device == "cpu" else "cuda"]
        self.out = Path(args.out).resolve()
        self.budget = Budget(args.deadline)
        self.model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "slapo-gpu-main-job")
        self.model_dir = self.model_dir.resolve() / f"llama-{self.plan.shape}"
        self.rows: list[Row] = []
        self.device_name = "cpu"
        self.precision = "bf16" if args.device == "cuda" else "fp32"
        self.flops_per_token = 0
        self.peak: float | None = None

    def save(self) -> None:
        """Write ``results.json`` (after every item: a crash keeps what was measured)."""
        self.out.mkdir(parents=True, exist_ok=True)
        data = {"device": self.device_name, "precision": self.precision, "peak_tflops": self.peak,
                "model": str(self.model_dir), "rows": [asdict(r) for r in self.rows]}  # fmt: skip
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.out / "results.json")

    def add(self, *rows: Row) -> None:
        self.rows.extend(rows)
        self.save()

    def no_time(self, item: str) -> Row:
        """The row of an item left out: under half of its budget was left before the deadline."""
        wanted = self.plan.budgets[item]
        return Row(LABELS[item], "skip", f"not run: under half of its {wanted} s budget left")

    def worker(self, item: str, args: list[str], env: dict[str, str] | None = None):
        """Run this file as a worker for ``item``; returns ``(status, output, timeout)``, or
        None when no time is left for it (the caller's row says so)."""
        timeout = self.budget.timeout(self.plan.budgets[item])
        if timeout <= 0:
            return None
        print(f"\n--- {item} (up to {timeout:.0f} s)", flush=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *args]
        rc, output = run_logged(cmd, timeout, self.out / f"{item}.log", env)
        return rc, output, timeout

    def common(self) -> list[str]:
        p = self.plan
        return ["--device", self.args.device, "--model-dir", str(self.model_dir),
                "--batch", str(p.batch), "--seq", str(p.seq)]  # fmt: skip

    # 0. the model directory (and the device's name, for the peak)
    def write_model(self) -> bool:
        args = ["model", *self.common(), "--shape", self.plan.shape]
        ran = self.worker("model", args, python_env([ROOT / "src"]))
        if ran is None:
            self.add(self.no_time("model"))
            return False
        rc, output, timeout = ran
        result = worker_result(output)
        if rc != 0 or result is None:
            self.add(failure("model", rc, timeout))
            return False
        self.device_name = result["device_name"]
        self.flops_per_token = result["flops_per_token"]
        from slapo.throughput import peak_tflops_of

        self.peak = self.args.peak_tflops
        if self.peak is None and self.args.device == "cuda":
            self.peak = peak_tflops_of(self.device_name, self.precision)
        self.save()
        return True

    # 1. and 2. slapo train
    def train(self, item: str, extra: list[str]) -> dict[str, Any] | None:
        """Run ``slapo train`` on the model; its ``metrics.json``, or None (row added)."""
        timeout = self.budget.timeout(self.plan.budgets[item])
        if timeout <= 0:
            self.add(self.no_time(item))
            return None
        out = self.out / item
        p = self.plan
        cmd = [sys.executable, "-m", "slapo", "train", "--model", str(self.model_dir),
               "--batch-size", str(p.batch), "--seq-len", str(p.seq), "--lr", "3e-4",
               "--output-dir", str(out), "--no-progress", "--no-sample", "--no-tensorboard",
               *self.device_flags, *extra]  # fmt: skip
        print(f"\n--- {item} (up to {timeout:.0f} s): {' '.join(cmd[1:])}", flush=True)
        rc, _ = run_logged(cmd, timeout, self.out / f"{item}.log", python_env([ROOT / "src"]))
        metrics = out / "metrics.json"
        if rc != 0 or not metrics.exists():
            self.add(failure(item, rc, timeout))
            return None
        return json.loads(metrics.read_text())

    @functools.cached_property
    def device_flags(self) -> list[str]:
        """``--device``/``--precision`` where ``slapo train`` has them (they are new)."""
        text = subprocess.run(
            [sys.executable, "-m", "slapo", "train", "--help"], cwd=ROOT, capture_output=True,
            text=True, env=python_env([ROOT / "src"]), check=False,
        ).stdout  # fmt: skip
        flags = []
        if "--device" in text:
            flags += ["--device", self.args.device]
        if "--precision" in text:
            flags += ["--precision", self.precision]
        return flags

    def main_job(self) -> None:
        p = self.plan
        steps = ["--steps", str(p.steps), "--baseline-steps", str(p.baseline_steps)]
        metrics = self.train("main", steps)
        if metrics is None:
            return
        rows = []
        for run, name in ((metrics.get("baseline"), "unscheduled"), (metrics, "scheduled")):
            if run is None:
                rows.append(Row(f"main job {name}", "FAIL", "no baseline in metrics.json"))
                continue
            row = run_figures({**run, "world_size": metrics.get("world_size", 1)},
                              self.flops_per_token, self.peak)  # fmt: skip
            row.item = f"main job {name}"
            rows.append(row)
        base, sched = metrics.get("baseline"), metrics
        if base is not None and base["tokens_per_s"]:
            gap = loss_gap(base["losses"], sched["losses"])
            ratio = sched["tokens_per_s"] / base["tokens_per_s"]
            mem_ratio = sched["peak_memory_mb"] / base["peak_memory_mb"]
            rows.append(Row(
                "main job scheduled/unscheduled", "ok",
                f"{ratio:.2f}x tokens/s, {mem_ratio:.2f}x peak memory; loss gap over the first "
                f"{len(base['losses'])} steps {gap:.4f} (final {base['final_loss']:.3f} vs "
                f"{sched['final_loss']:.3f})",
                {"speedup": ratio, "memory": mem_ratio, "loss_gap": gap},
            ))  # fmt: skip
        self.add(*rows)

    def roundpipe_target(self) -> None:
        steps = ["--steps", str(self.plan.roundpipe_steps), "--baseline-steps", "0"]
        metrics = self.train("roundpipe", ["--target", "roundpipe", *steps])
        if metrics is None:
            return
        row = run_figures(metrics, self.flops_per_token, self.peak)
        row.item = "roundpipe target"
        self.add(row)

    # 3. RoundPipe's own loop: ours and the peer
    def loop_args(self) -> list[str]:
        p = self.plan
        return ["loop", *self.common(), "--steps", str(p.loop_steps),
                "--microbatches", str(p.microbatches)]  # fmt: skip

    def ours_and_peer(self) -> None:
        ours = self.loop("ours", python_env([ROOT / "src"]))
        peer_dir = Path(self.args.peer_dir).resolve()
        if not (peer_dir / "roundpipe" / "__init__.py").exists():
            peer = Row("peer", "skip", f"not fetched: no {peer_dir}/roundpipe (run "
                       "scripts/fetch-peer-roundpipe.sh, carry third_party/peer-roundpipe)")  # fmt: skip
        else:
            # the peer builds its C++ Adam under its own name; apart from ours all the same
            ext = self.model_dir.parent / "peer-torch-extensions"  # beside the model, not in --out
            peer = self.loop("peer", python_env([peer_dir], TORCH_EXTENSIONS_DIR=str(ext)),
                             expect=peer_dir)  # fmt: skip
        self.add(ours, peer, self.side_by_side(ours, peer))

    def loop(self, item: str, env: dict[str, str], expect: Path | None = None) -> Row:
        args = self.loop_args()
        if expect is not None:
            args += ["--expect-package", str(expect)]
        if item == "peer" and self.args.device != "cuda":
            args += ["--import-only"]  # the peer's devices are CUDA devices
        ran = self.worker(item, args, env)
        if ran is None:
            return self.no_time(item)
        rc, output, timeout = ran
        result = worker_result(output)
        if rc != 0 or result is None:
            return failure(item, rc, timeout)
        version = f" {result['version']}" if result["version"] else ""
        where = f"roundpipe{version} from {_short(result['package'])}"
        if result.get("tokens_per_s") is None:
            return Row(item, "skip", f"{where}: {result['note']}", result)
        from slapo.throughput import mfu

        result["mfu"] = mfu(result["tokens_per_s"], self.flops_per_token, self.peak)
        peak = memory(result["peak_gib"] * 1024) if result["peak_gib"] is not None else "n/a"
        text = (f"{result['tokens_per_s']:,.0f} tokens/s, MFU {pct(result['mfu'])}, "
                f"{result['step_s']:.3f} s/step, device peak {peak} ({where})")  # fmt: skip
        return Row(item, "ok", text, result)

    def side_by_side(self, ours: Row, peer: Row) -> Row:
        a, b = ours.values.get("tokens_per_s"), peer.values.get("tokens_per_s")
        if not a or not b:
            return Row("ours vs peer", "skip", "needs both runs")
        gap = abs(ours.values["losses"][0] - peer.values["losses"][0])
        return Row(
            "ours vs peer", "ok",
            f"ours {a:,.0f} vs peer {b:,.0f} tokens/s: {a / b:.2f}x; first losses "
            f"{ours.values['losses'][0]:.4f} vs {peer.values['losses'][0]:.4f} (gap {gap:.1e})",
            {"ratio": a / b, "first_loss_gap": gap},
        )  # fmt: skip

    # 4. compile(rng="bulk")
    def bulk(self) -> None:
        args = ["bulk", "--device", self.args.device, "--steps", str(self.plan.bulk_steps)]
        ran = self.worker("bulk", args, python_env([ROOT / "src"]))
        if ran is None:
            self.add(self.no_time("bulk"))
            return
        rc, output, timeout = ran
        result = worker_result(output)
        if rc != 0 or result is None:
            self.add(failure("bulk", rc, timeout))
            return
        self.add(*bulk_rows(result))


def bulk_rows(result: dict[str, Any]) -> list[Row]:
    """The bulk check's rows: dropout off must agree with eager; dropout on is reported.

    Example:
        >>> off = {"eager": [5.0, 4.0], "bulk": [5.0, 4.0001], "rng_eager": [5.0, 4.0001]}
        >>> on = {"eager": [5.1, 4.2], "bulk": [5.2, 4.1], "eager_bulk_masks": [5.2, 4.1]}
        >>> [r.status for r in bulk_rows({"off": off, "on": on})]
        ['ok', 'ok']
    """
    off, on = result["off"], result["on"]
    gap = loss_gap(off["eager"], off["bulk"])
    same = loss_gap(off["rng_eager"], off["bulk"])
    ok = gap <= BULK_TOLERANCE  # False for NaN too
    rows = [Row(
        "compile(rng=bulk), dropout off", "ok" if ok else "FAIL",
        f"max |loss - eager's| {gap:.1e} (tolerance {BULK_TOLERANCE:.0e}) over "
        f"{len(off['eager'])} steps; vs compile(rng=eager) {same:.1e}",
        {"gap": gap, "vs_rng_eager": same},
    )]  # fmt: skip
    masks = loss_gap(on["eager_bulk_masks"], on["bulk"])
    rows.append(Row(
        "compile(rng=bulk), dropout on", "ok",
        f"max |loss - eager's| {loss_gap(on['eager'], on['bulk']):.1e} (other masks, by "
        f"design); vs eager with bulk masks {masks:.1e} (informational)",
        {"gap": loss_gap(on["eager"], on["bulk"]), "vs_bulk_masks": masks},
    ))  # fmt: skip
    bf16 = result.get("off_bf16")
    if bf16:
        gap, same = loss_gap(bf16["eager"], bf16["bulk"]), loss_gap(bf16["rng_eager"], bf16["bulk"])
        rows.append(Row(
            "compile(rng=bulk), dropout off, bf16", "ok",
            f"max |loss - eager's| {gap:.1e} (compiled rounding, informational); vs "
            f"compile(rng=eager) {same:.1e}",
            {"gap": gap, "vs_rng_eager": same},
        ))  # fmt: skip
    return rows


def _short(path: str) -> str:
    with contextlib.suppress(ValueError):
        return str(Path(path).resolve().relative_to(ROOT))
    return path


# ---------------------------------------------------------------- workers (subprocesses)


def worker_model(args: argparse.Namespace) -> dict[str, Any]:
    """Write the model directory (kept when its config matches) and say the device's name."""
    import torch
    import transformers as tf

    from slapo.throughput import model_flops_per_token

    shape = SHAPES[args.shape]
    config = tf.LlamaConfig(**shape, use_cache=False, tie_word_embeddings=False)
    path = Path(args.model_dir)
    stamp = path / "shape.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == shape):
        device = "cuda" if args.device == "cuda" else "cpu"
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # loaded as float32
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.device(device):  # random weights drawn on the GPU: seconds, not a minute
            model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
        tmp = path.with_name(path.name + ".tmp")
        model.save_pretrained(tmp)
        stamp_tmp = tmp / "shape.json"
        stamp_tmp.write_text(json.dumps(shape))
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
        params = sum(p.numel() for p in model.parameters())
        print(f"wrote {path}: {params / 1e9:.3f}B parameters in {time.perf_counter() - t0:.1f} s")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    return {"device_name": name, "flops_per_token": model_flops_per_token(config, args.seq)}


def worker_loop(args: argparse.Namespace) -> dict[str, Any]:
    """RoundPipe's training loop, as its user guide writes it, with whichever ``roundpipe`` is
    first on the path: tokens/s over ``--steps`` steps after two warm-up ones."""
    import importlib.util

    spec = importlib.util.find_spec("roundpipe")
    package = str(Path(spec.origin).resolve().parent) if spec and spec.origin else "?"
    if args.expect_package and not package.startswith(str(Path(args.expect_package).resolve())):
        raise SystemExit(f"roundpipe resolves to {package}, not to {args.expect_package}")
    found = {"package": package, "version": _dist_version(Path(package))}
    if args.import_only:
        try:  # the peer creates its devices when imported: one per CUDA GPU
            import roundpipe  # noqa: F401
        except Exception as exc:  # noqa: BLE001  (reported, not raised: there is no GPU here)
            return {**found, "tokens_per_s": None,
                    "note": f"importing it needs a GPU ({type(exc).__name__}: {exc})"}  # fmt: skip
        return {**found, "tokens_per_s": None, "note": "training needs CUDA"}
    import torch
    import transformers as tf

    from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
    from roundpipe.optim import Adam

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = tf.AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=dtype, use_cache=False, attn_implementation="sdpa"
    )
    vocab = model.config.vocab_size
    model = wrap_model_to_roundpipe(
        model, use_sequential_preset=True, optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches),
    )  # fmt: skip
    optimizer = Adam(model.optim_parameters(), lr=1e-5)
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq))
    n_mb = args.microbatches

    def loss_fn(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
        shifted = labels[:, 1:].to(logits.device)
        return (
            torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), shifted.flatten()
            )
            / n_mb
        )

    def step() -> torch.Tensor:  # the loss stays a tensor: no wait for the device here
        loss = model.forward_backward(input_kwargs={"input_ids": ids}, label=ids, loss_fn=loss_fn)
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=True)
        return loss.detach()

    losses = [step() for _ in range(2)]  # warm-up: the C++ Adam's build, allocator growth
    model.synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses += [step() for _ in range(args.steps)]
    model.synchronize()
    seconds = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if args.expect_package and "slapo" in sys.modules:
        raise SystemExit("the peer's process imported slapo")
    return {**found, "tokens_per_s": args.batch * args.seq / seconds, "step_s": seconds,
            "peak_gib": peak, "losses": [float(x) for x in losses], "microbatches": n_mb}  # fmt: skip


def _dist_version(package: Path) -> str | None:
    """The version in the wheel's ``roundpipe-X.dist-info`` beside ``package``; None for ours
    (part of the ``slapo`` distribution)."""
    for info in sorted(package.parent.glob("roundpipe-*.dist-info")):
        return info.name[len("roundpipe-") : -len(".dist-info")]
    return None


def worker_bulk(args: argparse.Namespace) -> dict[str, Any]:
    """Losses of a few AdamW steps of a tiny GPT-2: eager, ``compile(rng="bulk")`` and the
    references, with dropout off and on (float32), and with dropout off in bf16 autocast."""
    import torch
    import transformers as tf

    import slapo
    from slapo.op.dropout import bulk_dropout_masks

    device = torch.device(args.device)
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (4, 64), device=device)

    def make(dropout: float) -> torch.nn.Module:
        cfg = tf.GPT2Config(
            vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, use_cache=False,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        )  # fmt: skip
        torch.manual_seed(0)
        return tf.GPT2LMHeadModel(cfg).to(device).train()

    def losses(
        dropout: float, rng: str | None = None, masks: bool = False, bf16: bool = False
    ) -> list[float]:
        model = make(dropout)
        if rng is not None:
            sch = slapo.create_schedule(model)
            sch.compile(rng=rng)
            model, _ = slapo.build(sch, init_weights=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for step in range(args.steps):
            torch.manual_seed(100 + step)  # the CUDA generator too
            autocast = torch.autocast(device.type, torch.bfloat16, enabled=bf16)
            with autocast, bulk_dropout_masks() if masks else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        print(f"dropout {dropout}, rng {rng}, bulk masks {masks}, bf16 {bf16}: {out}", flush=True)
        return out

    off = {"eager": losses(0.0), "bulk": losses(0.0, "bulk"), "rng_eager": losses(0.0, "eager")}
    on = {"eager": losses(0.1), "bulk": losses(0.1, "bulk"),
          "eager_bulk_masks": losses(0.1, masks=True)}  # fmt: skip
    # the main job's precision: compiled code rounds otherwise than eager's (informational)
    bf16 = {"eager": losses(0.0, bf16=True), "bulk": losses(0.0, "bulk", bf16=True),
            "rng_eager": losses(0.0, "eager", bf16=True)}  # fmt: skip
    return {"off": off, "on": on, "off_bf16": bf16}


WORKERS = {"model": worker_model, "loop": worker_loop, "bulk": worker_bulk}


# ---------------------------------------------------------------- the summary table


def test_rows(xml_path: Path | None, rc: int | None) -> list[Row]:
    """The CUDA tests' row from their JUnit XML: counts, and the modules that failed."""
    if xml_path is None:
        return []
    counts: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    try:
        for case in ET.parse(xml_path).iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = tag
            counts[outcome] += 1
            if outcome in ("failure", "error"):
                failed[case.get("classname", "?").rsplit(".", 1)[-1]] += 1
    except (OSError, ET.ParseError) as exc:
        return [Row("tests/cuda", "FAIL", f"no test report ({exc}); exit status {rc}")]
    text = (f"{counts['passed']} passed, {counts['failure']} failed, {counts['error']} errors, "
            f"{counts['skipped']} skipped")  # fmt: skip
    if failed:
        text += " (" + ", ".join(f"{m}: {n}" for m, n in sorted(failed.items())) + ")"
    if rc == 124:
        text += "; timed out"
    bad = failed or rc not in (0, None)
    return [Row("tests/cuda", "FAIL" if bad else "ok", text, dict(counts))]


def bench_rows(log: Path | None, rc: int | None) -> list[Row]:
    """``benchmarks/roundpipe_cuda.py``'s row: its ratios (``name / name  value`` lines); an
    exit status of -1 means it was not started."""
    if log is None:
        return []
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return [Row("roundpipe_cuda.py", "FAIL", f"no log; exit status {rc}")]
    if rc == -1:  # gpu-check.sh did not start it
        return [Row("roundpipe_cuda.py", "skip", lines[-1] if lines else "not run")]
    ratios = []
    for line in lines:
        name, _, value = line.strip().rpartition(" ")
        if line.startswith("  ") and " / " in name:
            ratios.append(f"{name.strip()} {float(value):.2f}x")
    status = "ok" if rc == 0 else "FAIL"
    why = "" if rc == 0 else ("; timed out" if rc == 124 else f"; exit status {rc}")
    return [Row("roundpipe_cuda.py", status, ("; ".join(ratios) or "no figures") + why)]


def format_table(rows: list[Row], header: str) -> str:
    """The summary: one line per item.

    Example:
        >>> print(format_table([Row("tests/cuda", "ok", "3 passed")], "on cpu"))
        on cpu
        item        status  figures
        ------------------------------------------
        tests/cuda  ok      3 passed
    """
    width = max([len("item"), *(len(r.item) for r in rows)]) + 2
    lines = [header, f"{'item':<{width}}{'status':<8}figures", "-" * (width + 30)]
    lines += [f"{r.item:<{width}}{r.status:<8}{r.figures}" for r in rows]
    return "\n".join(lines)


def summary(args: argparse.Namespace) -> int:
    """Print the table of ``--out``'s results (and the tests' and benchmark's); the exit status
    is 1 when an item failed."""
    out = Path(args.out)
    data: dict[str, Any] = {"rows": [], "device": "?", "precision": "?"}
    with contextlib.suppress(OSError, json.JSONDecodeError):
        data = json.loads((out / "results.json").read_text())
    rows = test_rows(_path(args.tests_xml), args.tests_rc)
    rows += [Row(**r) for r in data["rows"]]
    if not data["rows"]:
        rows.append(Row("main job", "FAIL", f"no results in {out / 'results.json'}"))
    rows += bench_rows(_path(args.bench_log), args.bench_rc)
    failed = [r.item for r in rows if r.status == "FAIL"]
    took = f", {args.elapsed} s in all" if args.elapsed is not None else ""
    peak = data.get("peak_tflops")
    peak_text = f"peak {peak:g} TFLOPS" if peak else "peak unknown: no MFU"
    header = f"summary: {data['device']} ({peak_text}), main job in {data['precision']}{took}"
    print("\n" + format_table(rows, header))
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all items ok'} "
          f"(figures in {out / 'results.json'})")  # fmt: skip
    return 1 if failed else 0


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None


# ---------------------------------------------------------------- the command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny model, 3 steps: the logic")
    parser.add_argument("--out", default="gpu-check-out/main-job", help="results and logs")
    parser.add_argument("--model-dir", help="where the model is written (default: a temp dir)")
    parser.add_argument("--peer-dir", default=str(PEER_DIR), help="the unpacked peer package")
    parser.add_argument("--deadline", type=float, help="time.time() by which all items end")
    parser.add_argument(
        "--peak-tflops", type=float, help="the device's peak for MFU (default: slapo.throughput's "
        "table by the GPU's name; none on the CPU)",
    )  # fmt: skip
    parser.add_argument("--items", default="main,bulk,roundpipe,peer", help="which, in order")
    parser.add_argument("--no-summary", action="store_true", help="leave the table to --summary")
    parser.add_argument("--summary", action="store_true", help="print the table of --out only")
    parser.add_argument("--tests-xml")
    parser.add_argument("--tests-rc", type=int)
    parser.add_argument("--bench-log")
    parser.add_argument("--bench-rc", type=int)
    parser.add_argument("--elapsed", type=int, help="seconds the whole check took (the header)")
    # a worker's own arguments (``--worker NAME``: run in a subprocess by the items above)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    for flag, kind in (("--batch", int), ("--seq", int), ("--steps", int),
                       ("--microbatches", int), ("--shape", str), ("--expect-package", str)):  # fmt: skip
        parser.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    parser.add_argument("--import-only", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        result = WORKERS[args.worker](args)
        print(RESULT + json.dumps(result), flush=True)
        return 0
    sys.path.insert(0, str(ROOT / "src"))  # slapo.throughput, installed or not
    if args.summary:
        return summary(args)
    # an outer timeout's SIGTERM ends the running item's process group too (run_logged)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    job = Job(args)
    job.save()
    print(f"model: {job.model_dir}; results: {job.out / 'results.json'}", flush=True)
    if job.write_model():
        steps = {"main": job.main_job, "bulk": job.bulk, "roundpipe": job.roundpipe_target,
                 "peer": job.ours_and_peer}  # fmt: skip
        for item in args.items.split(","):
            steps[item]()
    if args.no_summary:
        return 0
    return summary(args)


if __name__ == "__main__":
    sys.exit(main())

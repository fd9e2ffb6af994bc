"""`slapo train --data` on a large text file: peak resident memory against the file's size.

Generates a text file of ``--size`` (default 1 GiB) in a temporary directory, then runs ``slapo
train --data FILE`` as a child process three times: on a tiny file of the same text (the
baseline: the interpreter, torch, the model), on the large file with no token cache (tokenized
once with the byte tokenizer and written to the memory-mapped cache beside it), and on the large
file again (the cache hit). Each run trains a few steps of the tiny Llama. Printed per run: the
child's peak resident set size (``ru_maxrss`` of that child alone, from ``os.wait4``), its growth
over the tiny run against the file's size, the wall time and the start time (the wall time less
the training steps: import, tokenizing or mapping, building).

    .venv/bin/python benchmarks/train_streaming.py [--size 1GiB] [--steps 5] [--keep DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
         "g": 1 << 30, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}  # fmt: skip
WORDS = (
    "def return import class self lambda yield tensor model data token stream memory cache "
    "batch window step loss layer block train value index file text line word shard rank"
).split()


def parse_size(text: str) -> int:
    """Bytes of a size such as ``1GiB``, ``64MiB``, ``100MB`` or ``4096``.

    Example:
        >>> parse_size("64MiB"), parse_size("1gb")
        (67108864, 1000000000)
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 64MiB, 100MB)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def write_text(path: Path, size: int, seed: int = 0) -> int:
    """Write about ``size`` bytes of ASCII text lines to ``path`` (blocks of 1 MiB, each made
    distinct by its number); returns the bytes written.

    Example:
        >>> write_text(Path("/tmp/corpus.txt"), 1 << 20)
        1048576
    """
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(2048)]
    block = ("\n".join(lines) + "\n").encode()
    written = 0
    with path.open("wb") as f:
        number = 0
        while written < size:
            head = f"# block {number}\n".encode()
            chunk = (head + block)[: size - written]
            f.write(chunk)
            written += len(chunk)
            number += 1
    return written


def train_command(data: Path, out: Path, steps: int) -> list[str]:
    """The ``slapo train`` child: the tiny Llama on ``data`` (byte tokens), no extras."""
    return [sys.executable, "-m", "slapo", "train", "--data", str(data), "--steps", str(steps),
            "--seq-len", "64", "--batch-size", "4", "--baseline-steps", "0", "--no-sample",
            "--no-progress", "--no-tensorboard", "--compile-model", "false",
            "--output-dir", str(out)]  # fmt: skip


def run_child(cmd: list[str], timeout: float = 900.0) -> dict[str, Any]:
    """Run ``cmd``; returns its wall time (s) and peak resident set size (bytes: ``ru_maxrss``
    of this child alone, as ``os.wait4`` reports it)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = start + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            raise TimeoutError(f"{' '.join(cmd)} ran past {timeout:.0f} s")
        time.sleep(0.05)
    wall = time.perf_counter() - start
    output = proc.stdout.read() if proc.stdout is not None else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
    return {"wall_s": wall, "peak_rss": usage.ru_maxrss * 1024, "output": output}


def measure(size: int, steps: int, root: Path) -> dict[str, Any]:
    """The three runs in ``root``: tiny file, large file (tokenized), large file (cached)."""
    tiny, large = root / "tiny" / "corpus.txt", root / "large" / "corpus.txt"
    tiny.parent.mkdir(parents=True)
    large.parent.mkdir(parents=True)
    write_text(tiny, 256 << 10)
    t0 = time.perf_counter()
    written = write_text(large, size)
    generate_s = time.perf_counter() - t0
    runs = {}
    for name, data in (("tiny", tiny), ("tokenize", large), ("cached", large)):
        out = root / f"run-{name}"
        run = run_child(train_command(data, out, steps))
        metrics = json.loads((out / "metrics.json").read_text())
        run.pop("output")
        run.update(
            start_s=run["wall_s"] - metrics["seconds"], from_cache=metrics.get("from_cache"),
            tokens=metrics.get("tokens"), final_loss=metrics["final_loss"],
        )  # fmt: skip
        runs[name] = run
    cache = sum(p.stat().st_size for p in (large.parent / ".slapo-cache").glob("*.tokens"))
    base = runs["tiny"]["peak_rss"]
    for run in runs.values():
        run["rss_growth"] = run["peak_rss"] - base
        run["growth_per_file_byte"] = run["rss_growth"] / written
    return {"file_bytes": written, "cache_bytes": cache, "generate_s": generate_s, "runs": runs}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30, help="e.g. 1GiB, 64MiB")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep the files")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="slapo-streaming-"))
    try:
        result = measure(args.size, args.steps, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return
    print(f"text file: {_mib(result['file_bytes'])} (generated in {result['generate_s']:.1f} s), "
          f"token cache: {_mib(result['cache_bytes'])}")  # fmt: skip
    print(f"{'run':<10} {'peak RSS':>10} {'growth':>10} {'growth/file':>12} {'wall':>8} "
          f"{'start':>8}  cache")  # fmt: skip
    for name, run in result["runs"].items():
        print(f"{name:<10} {_mib(run['peak_rss']):>10} {_mib(run['rss_growth']):>10} "
              f"{run['growth_per_file_byte']:>12.3f} {run['wall_s']:>7.1f}s "
              f"{run['start_s']:>7.1f}s  {run['from_cache']}")  # fmt: skip


if __name__ == "__main__":
    main()

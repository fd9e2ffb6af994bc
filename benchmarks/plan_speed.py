"""How long ``slapo plan`` takes for a large model on a large cluster (issue 37: under a minute).

Runs ``slapo plan --model llama --size 70b --gpus 256 --gpu h100 --seq-len 8192`` in a fresh
process (imports included, as a user runs it) and prints its wall time, the number of layouts
predicted and the best one. A timing is printed, never asserted.

Usage:
    python benchmarks/plan_speed.py [--size 70b] [--gpus 256] [--global-batch 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--size", default="70b")
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "slapo", "plan", "--model", args.model, "--size", args.size,
            "--config-dir", f"{tmp}/{args.model}-{args.size}", "--gpus", str(args.gpus),
            "--gpu", args.gpu, "--seq-len", str(args.seq_len),
            "--global-batch", str(args.global_batch), "--json",
        ]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        print(done.stderr, file=sys.stderr)
        return done.returncode
    rows = json.loads(done.stdout)
    fitting = [r for r in rows if r["fits"]]
    print(f"slapo plan {args.model} {args.size} on {args.gpus} x {args.gpu}: {seconds:.1f} s wall "
          f"(imports included), {len(rows)} layouts predicted, {len(fitting)} fit")  # fmt: skip
    if fitting:
        best = fitting[0]
        print(f"best: {best['layout']}: {best['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
              f"MFU {best['mfu']:.1%}, {best['memory_gib']} GiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

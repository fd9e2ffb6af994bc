"""`slapo train` on data x pipeline x tensor parallel layouts beside one process, side by side.

Each layout runs under ``torchrun --nproc-per-node N`` with ``--batch-size B`` per replica; the
reference is one process with the global batch (``B`` x dp). Printed per layout: the first and
final losses of both, the largest difference over the whole curve, tokens/s, and per rank the
parameters held, the measured peak and the estimate made before the run.

    .venv/bin/python benchmarks/parallel_layouts.py [--steps 30] [--seq-len 32] [--batch-size 8]
        [--layouts dp2-pp2-tp2,dp2-tp2,dp2-pp2,pp2-tp2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# name: (processes, flags)
LAYOUTS = {
    "dp2-pp2-tp2": (8, ["--tp", "2", "--pp", "2"]),
    "dp2-pp2-tp2-fsdp": (8, ["--tp", "2", "--pp", "2", "--target", "fsdp"]),
    "dp2-tp2": (4, ["--tp", "2"]),
    "dp2-pp2": (4, ["--pp", "2"]),
    "pp2-tp2": (4, ["--tp", "2", "--pp", "2"]),
}


def _metrics(cmd: list[str], out: Path) -> dict:
    done = subprocess.run([*cmd, "--output-dir", str(out)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "metrics.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    run = ["--steps", str(args.steps), "--seq-len", str(args.seq_len), "--no-progress",
           "--no-sample", "--baseline-steps", "0"]  # fmt: skip
    one: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.layouts.split(",")):
            nproc, flags = LAYOUTS[name]
            tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
            pp = int(flags[flags.index("--pp") + 1]) if "--pp" in flags else 1
            dp = nproc // (tp * pp)
            batch = args.batch_size * dp
            if batch not in one:
                one[batch] = _metrics(
                    [sys.executable, "-m", "slapo", "train", *run, "--batch-size", str(batch),
                     "--compile-model", "false"], Path(tmp) / f"one{batch}",
                )  # fmt: skip
            got = _metrics(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-port", str(29700 + i), "-m", "slapo", "train", *run, *flags,
                 "--batch-size", str(args.batch_size)], Path(tmp) / name,
            )  # fmt: skip
            ref = one[batch]
            diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
            print(f"\n{name}: {got['layout']}, global batch {batch}")
            print(f"  loss first {got['losses'][0]:.4f} (one process {ref['losses'][0]:.4f}), "
                  f"final {got['losses'][-1]:.4f} ({ref['losses'][-1]:.4f}); "
                  f"largest difference over {args.steps} steps {diff:.2e}")  # fmt: skip
            print(f"  tokens/s {got['tokens_per_s']:,.0f} (one process {ref['tokens_per_s']:,.0f})")
            for r in got["ranks"]:
                est = r["estimated_peak_mb"]
                print(f"  rank {r['rank']}: {r['parameters']:,} parameters, peak "
                      f"{r['peak_memory_mb']:.1f} MiB, estimate "
                      f"{'n/a' if est is None else f'{est:.1f} MiB'}")  # fmt: skip


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Runs everything that needs a GPU, on a machine with one CUDA GPU and no internet access where
# torch (with CUDA), transformers and peft are already installed: the tests in tests/cuda/ and the
# CUDA benchmarks, then prints a summary table. Budget: under 8 minutes on one H100.
#
#   bash scripts/gpu-check.sh            # logs and JUnit XML go to ${GPU_CHECK_OUT:-gpu-check-out}
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-gpu-check-out}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
start=$(date +%s)

section() { printf '\n=== %s ===\n' "$*"; }

section "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| GPUs', torch.cuda.device_count())"
"$PYTHON" -c "import peft; print('peft', peft.__version__)" 2>/dev/null || echo "peft: not installed (LoRA tests skip)"

section "install (no dependencies: they are already there)"
"$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING" || true
"$PYTHON" -c "import slapo, roundpipe" || { echo "install failed"; exit 1; }

section "C++ Adam build"
"$PYTHON" -c "
import time; t = time.perf_counter()
from roundpipe.optim_builder import get_optim_function
get_optim_function('adam'); print(f'C++ Adam built and loaded in {time.perf_counter() - t:.1f} s')
" 2>&1 | tail -3

section "tests/cuda"
timeout 300 "$PYTHON" -m pytest tests/cuda -q -p no:cacheprovider -ra --junitxml="$OUT_DIR/cuda-tests.xml" 2>&1 | tee "$OUT_DIR/cuda-tests.log"
test_rc=${PIPESTATUS[0]}

section "benchmarks/roundpipe_cuda.py"
timeout 240 "$PYTHON" benchmarks/roundpipe_cuda.py --steps 4 2>&1 | tee "$OUT_DIR/bench.log"
bench_rc=${PIPESTATUS[0]}

section "summary"
"$PYTHON" - "$OUT_DIR/cuda-tests.xml" "$OUT_DIR/bench.log" "$test_rc" "$bench_rc" "$(( $(date +%s) - start ))" <<'PY'
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

xml_path, bench_log, test_rc, bench_rc, seconds = sys.argv[1:]
per_file = defaultdict(Counter)
try:
    for case in ET.parse(xml_path).iter("testcase"):
        where = case.get("classname", "?").rsplit(".", 1)[-1]
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        per_file[where][outcome] += 1
except (OSError, ET.ParseError) as exc:
    print(f"no test report ({exc})")
print(f"{'test module':<28}{'passed':>8}{'failed':>8}{'error':>8}{'skipped':>9}")
total = Counter()
for where, c in sorted(per_file.items()):
    total.update(c)
    print(f"{where:<28}{c['passed']:>8}{c['failed']:>8}{c['error']:>8}{c['skipped']:>9}")
print(f"{'total':<28}{total['passed']:>8}{total['failed']:>8}{total['error']:>8}{total['skipped']:>9}")
print("\nbenchmark figures:")
try:
    for line in open(bench_log):
        if line.startswith(("[", "  ", "device")):
            print("  " + line.rstrip())
except OSError:
    print("  (no benchmark log)")
print(f"\ntests exit {test_rc}, benchmark exit {bench_rc}, {seconds} s in all")
PY
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]

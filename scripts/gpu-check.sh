#!/usr/bin/env bash
# Runs everything that needs a GPU, on a machine with one CUDA GPU and no internet access where
# torch (with CUDA), transformers and peft are already installed, then prints one summary table
# (exit status 1 when an item failed). Budget: GPU_CHECK_BUDGET seconds (default 470, under 8
# minutes on one H100); every stage has a timeout, cut to what is left of it:
#
#   setup (install, C++ Adam build)                 ~30 s (timeouts 60 + 90)
#   tests/cuda                                       up to 150 s
#   benchmarks/gpu_main_job.py, until 50 s before the end, item by item (its budgets):
#     model directory (1.1B Llama, random weights)   60 s
#     main job: slapo train, scheduled + baseline   200 s
#     compile(rng="bulk") against eager             120 s
#     slapo train --target roundpipe                120 s
#     RoundPipe's loop: ours, then the peer          90 s + 120 s
#   benchmarks/roundpipe_cuda.py --part overhead     up to 40 s (its Llama part, RoundPipe
#     against FSDP2 with CPU offload: GPU_CHECK_BENCH_PART=all GPU_CHECK_BENCH_S=240, with a
#     GPU_CHECK_BUDGET to match)
#
# The items add up to more than what is left after the tests: an item with under half of its
# budget left is not started (its row says so): the last ones (the peer) are the first to go. The peer
# (the published roundpipe package) is read from third_party/peer-roundpipe/, which
# scripts/fetch-peer-roundpipe.sh fills on a machine with internet access; without it, its
# row is skipped.
#
#   bash scripts/gpu-check.sh            # logs, JUnit XML and results to ${GPU_CHECK_OUT:-gpu-check-out}
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-gpu-check-out}
BUDGET=${GPU_CHECK_BUDGET:-470}
BENCH_PART=${GPU_CHECK_BENCH_PART:-overhead}  # "all" adds the 1.1B Llama against FSDP2-offload
BENCH_S=${GPU_CHECK_BENCH_S:-40}
ITEMS=${GPU_CHECK_ITEMS:-main,bulk,roundpipe,peer}  # gpu_main_job.py's items, in this order
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
start=$(date +%s)
deadline=$((start + BUDGET))

section() { printf '\n=== %s (%d s in) ===\n' "$*" "$(($(date +%s) - start))"; }
# seconds a stage may run: its own budget, or what is left before the deadline (at least 1)
cap() {
    local left=$((deadline - $(date +%s)))
    ((left < $1)) && echo $((left > 1 ? left : 1)) || echo "$1"
}

section "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| GPUs', torch.cuda.device_count())"
"$PYTHON" -c "import peft; print('peft', peft.__version__)" 2>/dev/null || echo "peft: not installed (LoRA tests skip)"

section "install (no dependencies: they are already there)"
timeout 60 "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING" || true
"$PYTHON" -c "import slapo, roundpipe" || { echo "install failed"; exit 1; }

section "C++ Adam build"
timeout 90 "$PYTHON" -c "
import time; t = time.perf_counter()
from roundpipe.optim_builder import get_optim_function
get_optim_function('adam'); print(f'C++ Adam built and loaded in {time.perf_counter() - t:.1f} s')
" 2>&1 | tail -3

section "tests/cuda"
timeout "$(cap 150)" "$PYTHON" -m pytest tests/cuda -q -p no:cacheprovider -ra \
    --junitxml="$OUT_DIR/cuda-tests.xml" 2>&1 | tee "$OUT_DIR/cuda-tests.log"
test_rc=${PIPESTATUS[0]}

section "benchmarks/gpu_main_job.py: the main job, the roundpipe target, ours vs peer, compile(rng=bulk)"
job_end=$((deadline - BENCH_S - 10))  # leaves roundpipe_cuda.py and the summary their time
job_cap=$((job_end - $(date +%s) + 30))
timeout $((job_cap > 1 ? job_cap : 1)) "$PYTHON" benchmarks/gpu_main_job.py --device cuda \
    --out "$OUT_DIR/main-job" --deadline "$job_end" --items "$ITEMS" --no-summary 2>&1 |
    tee "$OUT_DIR/main-job.log"

section "benchmarks/roundpipe_cuda.py --part $BENCH_PART"
if ((deadline - $(date +%s) >= 25)); then
    timeout "$(cap "$BENCH_S")" "$PYTHON" benchmarks/roundpipe_cuda.py --part "$BENCH_PART" --steps 3 2>&1 | tee "$OUT_DIR/bench.log"
    bench_rc=${PIPESTATUS[0]}
else
    echo "not run: under 25 s left of the budget" | tee "$OUT_DIR/bench.log"
    bench_rc=-1  # the summary's row says: not run
fi

section "summary"
"$PYTHON" benchmarks/gpu_main_job.py --summary --out "$OUT_DIR/main-job" \
    --tests-xml "$OUT_DIR/cuda-tests.xml" --tests-rc "$test_rc" \
    --bench-log "$OUT_DIR/bench.log" --bench-rc "$bench_rc" \
    --elapsed "$(($(date +%s) - start))"

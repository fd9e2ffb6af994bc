#!/usr/bin/env bash
# Sets up .venv with everything the project needs, on a fresh machine or an old one.
# torch goes in first, pinned to the CPU wheel that lies on this machine's disk: with no
# torch present, a looser requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip_quiet() { python -m pip install -q --disable-pip-version-check "$@"; }
python -c "import torch" 2>/dev/null || pip_quiet "torch==2.13.0"
pip_quiet -e ".[dev]"
python -c "import torch, slapo, roundpipe" || { echo "setup failed: slapo did not install" >&2; exit 1; }

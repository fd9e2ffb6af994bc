#!/usr/bin/env bash
# Fetches the published `roundpipe` package from PyPI (the peer that src/roundpipe re-implements)
# into third_party/peer-roundpipe/ (git-ignored), for benchmarks/gpu_main_job.py's "ours vs peer"
# row. Run it on a machine with internet access; the GPU machine has none, so the folder travels
# with the working tree (carry it).
#
# Wheels are unpacked, not installed: our package is also called `roundpipe`, so the peer is
# imported only by a process whose PYTHONPATH puts this folder first. Beside it go the pure-Python
# packages it imports that a CUDA machine with torch may lack (beartype, py-cpuinfo); typing-
# extensions and ninja come with torch and with this project.
#
#   bash scripts/fetch-peer-roundpipe.sh          # PEER_ROUNDPIPE_VERSION=0.1.1 by default
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
PYTHON=${PYTHON:-.venv/bin/python}
VERSION=${PEER_ROUNDPIPE_VERSION:-0.1.1}
DEST=third_party/peer-roundpipe

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PIP" download --quiet --no-deps --only-binary=:all: --dest "$tmp" \
    "roundpipe==$VERSION" beartype py-cpuinfo
rm -rf "$DEST"
mkdir -p "$DEST"
for wheel in "$tmp"/*.whl; do
    "$PYTHON" -m zipfile -e "$wheel" "$DEST"
    basename "$wheel" >> "$DEST/WHEELS"
done
echo "unpacked into $DEST:"
sed 's/^/  /' "$DEST/WHEELS"
du -sh "$DEST" | cut -f1 | sed 's/^/  size: /'

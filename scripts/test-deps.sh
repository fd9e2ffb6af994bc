#!/usr/bin/env bash
# The guard against dependency drift: runs the test suite in throwaway virtual environments with
# the OLDEST and the NEWEST versions pyproject.toml allows of the libraries whose internals slapo
# follows (transformers, peft, deepspeed, accelerate). CI installs what a user gets that day (the
# newest); this checks that the declared lower bounds still hold, and that the newest release on
# the registry passes before a user meets it.
#
#   bash scripts/test-deps.sh                      # oldest, then newest: the whole suite in each
#   bash scripts/test-deps.sh oldest               # one side only
#   bash scripts/test-deps.sh newest -- tests/schedule # pytest arguments after --
#   KEEP_VENV=1 bash scripts/test-deps.sh oldest   # keep the venv (path printed) for a rerun
#
# Run it before you change a bound in pyproject.toml, when one of those libraries releases, and
# before a release of ours. The whole suite twice takes about 35 minutes on 2 cores. Each venv
# gets torch==2.13.0 first (the CPU wheel; a looser requirement would pull a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}

sides=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case "$1" in
        oldest|newest) sides+=("$1") ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "test-deps: unknown side '$1' (oldest, newest)" >&2; exit 2 ;;
    esac
    shift
done
[ "${1:-}" = "--" ] && shift
[ ${#sides[@]} -gt 0 ] || sides=(oldest newest)
pytest_args=("$@")
[ ${#pytest_args[@]} -gt 0 ] || pytest_args=(-q)

# The pins of one side: the lower bound of each guarded library as the dev extra declares it
# (oldest), or the newest version below its upper bound (newest: pip's ordinary choice).
pins() {
    "$PYTHON" - "$1" <<'PY'
import re
import sys
import tomllib

GUARDED = ("transformers", "peft", "deepspeed", "accelerate")
with open("pyproject.toml", "rb") as f:
    dev = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
for req in dev:
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
    if name not in GUARDED:
        continue
    if sys.argv[1] == "oldest":
        low = re.search(r">=\s*([0-9][^,;\s]*)", req)
        if low is None:
            sys.exit(f"test-deps: {req!r} in the dev extra has no lower bound to test")
        print(f"{name}=={low.group(1)}")
    else:
        print(req.replace(" ", ""))
PY
}

summary=()
for side in "${sides[@]}"; do
    venv=$(mktemp -d "${TMPDIR:-/tmp}/slapo-deps-$side.XXXX")
    [ -n "${KEEP_VENV:-}" ] || trap 'rm -rf "$venv"' EXIT
    mapfile -t wanted < <(pins "$side")
    echo "=== $side: ${wanted[*]} (venv $venv)"
    "$PYTHON" -m venv "$venv"
    pip_quiet() { "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
    pip_quiet "torch==2.13.0"
    # One resolve for the project and the pins, so that pip picks the other dependencies
    # (huggingface_hub, tokenizers, ...) that the pinned versions need.
    if [ "$side" = newest ]; then
        pip_quiet --upgrade -e "$ROOT[dev]" "${wanted[@]}"
    else
        pip_quiet -e "$ROOT[dev]" "${wanted[@]}"
    fi
    "$venv/bin/python" - <<'PY'
import importlib.metadata as md
print("installed:", ", ".join(
    f"{n} {md.version(n)}" for n in ("torch", "transformers", "peft", "deepspeed", "accelerate")))
PY
    set +e
    "$venv/bin/python" -m pytest -p no:cacheprovider "${pytest_args[@]}" 2>&1 | tee "$venv.log"
    rc=${PIPESTATUS[0]}
    set -e
    summary+=("$side: exit $rc, $(tail -n 1 "$venv.log")")
    rm -f "$venv.log"
    if [ -z "${KEEP_VENV:-}" ]; then rm -rf "$venv"; trap - EXIT; fi
done

echo
echo "=== summary"
printf '%s\n' "${summary[@]}"
for line in "${summary[@]}"; do
    case "$line" in *": exit 0,"*) ;; *) exit 1 ;; esac
done

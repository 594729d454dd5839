#!/usr/bin/env bash
# The one command that checks the whole GPU path (scripts/gpu_check.py says what it runs and reports).
#
#   scripts/gpu_check.sh --out "$OUT"          a GPU machine: full-size OpenVLA-OFT in bf16 on CUDA
#   scripts/gpu_check.sh --cpu --out /tmp/gc   the same steps with the tiny preset on the CPU (CI runs this)
#
# On a lent GPU machine (Python 3.12, torch+CUDA and transformers preinstalled, no network, no Ray, no simulators)
# the packages it lacks travel as wheels: `scripts/gpu_wheels.sh` downloads them here into .whl/ (git-ignored;
# name .whl in the run's carry list), and this script installs them into /tmp/site before anything imports.
# A tree sent without .git records EMBODIRL_COMMIT (set it in the run's command) as the report's commit.
# EMBODIRL_PYTHON picks the interpreter (default: .venv/bin/python when set up, else python3); WHEELS the wheel folder.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${EMBODIRL_PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
WHEELS="${WHEELS:-$ROOT/.whl}"
if [[ " $* " != *" --cpu "* ]] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"

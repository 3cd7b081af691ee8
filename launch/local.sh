#!/usr/bin/env bash
# One node: run a colocate job with a Ray of its own, started and stopped by colocate.
#
#   bash launch/local.sh [CONFIG] [key=value ...]            # e.g. bash launch/local.sh algo.num_steps=20
#
# Uses the repository's virtual environment when it has one (VENV, default .venv beside launch/), else the
# `colocate` on PATH. It does not change directory: a CONFIG path and task modules resolve from where you run it.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$repo/.venv}
if [ -x "$venv/bin/colocate" ]; then
  exec "$venv/bin/colocate" launch "$@"
fi
if command -v colocate >/dev/null 2>&1; then
  exec colocate launch "$@"
fi
echo "launch/local.sh: colocate is not installed: run 'make setup' (CPU) or 'pip install -e \".[gpu]\"' (GPU) first" >&2
exit 127

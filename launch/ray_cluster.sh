#!/usr/bin/env bash
# Start a Ray head on this node (loopback, token auth), run a colocate job on it, and stop the head.
#
#   bash launch/ray_cluster.sh [CONFIG] [key=value ...]       # e.g. bash launch/ray_cluster.sh algo.num_steps=20
#
# On a real cluster, start the head once (`ray start --head`), join the workers (`ray start --address=HEAD:6379`),
# then `colocate launch --address auto ...` on the head, or `colocate submit --address http://HEAD:8265 ...`
# from anywhere. Ray 2.60 refuses job submission without a token: head and clients share RAY_AUTH_TOKEN_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/colocate_token}
if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
  mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
  (umask 077 && "$VENV/bin/python" -c "import secrets; print(secrets.token_hex(32))" > "$RAY_AUTH_TOKEN_PATH")
fi
# Jobs submitted to this head (colocate submit) run `python -m colocate.cli`: put the venv's Python first.
export PATH="$PWD/$VENV/bin:$PATH"
"$VENV/bin/ray" start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 --disable-usage-stats >/dev/null
trap '"$VENV/bin/ray" stop --force >/dev/null 2>&1 || true' EXIT
"$VENV/bin/colocate" launch --address auto "$@"

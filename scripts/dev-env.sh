#!/usr/bin/env bash
# Creates (once) the project's virtual environment outside the clone, keyed by the
# dependency declaration, installs this checkout into it in editable mode, and prints its path.
set -euo pipefail
source "$(dirname "$0")/common.sh"

# Keyed by the declared dependencies (not the whole pyprojects) and this script.
deps="$(python3 -c 'import json, sys, tomllib
print(json.dumps([[p.get("dependencies"), p.get("optional-dependencies")]
                  for p in (tomllib.load(open(f, "rb"))["project"] for f in sys.argv[1:])], sort_keys=True))' \
  "$REPO_ROOT/pyproject.toml" "$REPO_ROOT/devcluster/pyproject.toml")"
key="$( (echo "$deps"; cat "$REPO_ROOT/scripts/dev-env.sh") | sha256sum | cut -c1-16)"
VENV="$AFD_CACHE_DIR/venv/dev-$key"
mkdir -p "$AFD_CACHE_DIR/venv"
# Concurrent callers (parallel jobs, a developer beside CI) must not build the same venv twice.
exec 9>"$VENV.lock"
flock 9
if [ ! -f "$VENV/.complete" ]; then
  log "creating $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel >&2
  # torch 2.13.0 CPU is the build that ships on this kind of machine; pinning it here keeps
  # pip from pulling a multi-GB CUDA build for the plugin's `torch>=2.6` range.
  "$VENV/bin/pip" install -q "torch==2.13.0" >&2
  (cd "$REPO_ROOT" && "$VENV/bin/pip" install -q -e ".[operator,plugin,dev]" -e ./devcluster >&2)
  touch "$VENV/.complete"
fi
# Point the editable installs at this checkout (the cached venv outlives any one clone). The dev
# cluster (local control plane, node stand-in) is a package of its own: tests and the main job
# use it, the operator image does not ship it.
(cd "$REPO_ROOT" && "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . -e ./devcluster >&2)
echo "$VENV"

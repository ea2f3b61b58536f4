#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs (Debian packages, the
# Kubernetes builds, the Python environments, the vLLM wheels; all cached outside the clone),
# then runs pytest. Extra arguments go to pytest.
# `--tier unit|apiserver|vllm|whole_machine` first: only that tier's tests (tests/conftest.py),
# after preparing only what it needs (README.md, "Test tiers").
set -euo pipefail
source "$(dirname "$0")/common.sh"

tier=all
if [ "${1:-}" = "--tier" ]; then
  tier="${2:?--tier needs one of unit, apiserver, vllm, whole_machine}"
  shift 2
fi
case "$tier" in
  all|whole_machine) parts="apiserver vllm realnode" ;;
  apiserver) parts="apiserver" ;;
  vllm) parts="vllm" ;;
  unit) parts="" ;;
  *) echo "unknown tier '$tier': one of unit, apiserver, vllm, whole_machine" >&2; exit 2 ;;
esac
needs() { [[ " $parts " == *" $1 "* ]]; }

# prometheus brings promtool, which lints the metrics expositions.
debs=(openssl prometheus)
needs apiserver && debs+=(etcd-server etcd-client)
ensure_debs "${debs[@]}"
# The vLLM wheels download (network) while the Kubernetes binaries build (CPU).
if needs vllm; then
  "$REPO_ROOT/scripts/vllm-wheelhouse.sh" >/dev/null &
  wheels=$!
fi
# The real node's packages and all six Kubernetes binaries, built in one pass (the API
# server the other tests use among them).
needs realnode && "$REPO_ROOT/scripts/realnode/prepare.sh"
needs vllm && wait "$wheels"
if needs apiserver; then
  AFD_KUBE_APISERVER="$("$REPO_ROOT/scripts/build-kube-apiserver.sh")"
  export AFD_KUBE_APISERVER
fi
VENV="$("$REPO_ROOT/scripts/dev-env.sh")"
if needs vllm; then
  # Real vLLM 0.23.0 (CPU wheel) in its own cached venv: the vLLM tests run it in subprocesses.
  AFD_VLLM_PYTHON="$("$REPO_ROOT/scripts/vllm-env.sh")/bin/python"
  export AFD_VLLM_PYTHON
fi
cd "$REPO_ROOT"
if [ "$tier" = all ]; then
  exec "$VENV/bin/python" -m pytest "$@"
fi
exec "$VENV/bin/python" -m pytest -m "$tier" "$@"

#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs (Debian packages, the
# Kubernetes builds, the Python environments, the vLLM wheels; all cached outside the clone),
# then runs pytest. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/common.sh"

# prometheus brings promtool, which lints the metrics expositions.
ensure_debs etcd-server etcd-client openssl prometheus
# The vLLM wheels download (network) while the Kubernetes binaries build (CPU).
"$REPO_ROOT/scripts/vllm-wheelhouse.sh" >/dev/null &
wheels=$!
# The real node's packages and all six Kubernetes binaries, built in one pass (the API
# server the other tests use among them).
"$REPO_ROOT/scripts/realnode/prepare.sh"
wait "$wheels"
AFD_KUBE_APISERVER="$("$REPO_ROOT/scripts/build-kube-apiserver.sh")"
export AFD_KUBE_APISERVER
VENV="$("$REPO_ROOT/scripts/dev-env.sh")"
# Real vLLM 0.23.0 (CPU wheel) in its own cached venv: the vLLM tests run it in subprocesses.
AFD_VLLM_PYTHON="$("$REPO_ROOT/scripts/vllm-env.sh")/bin/python"
export AFD_VLLM_PYTHON
cd "$REPO_ROOT"
exec "$VENV/bin/python" -m pytest "$@"

#!/usr/bin/env bash
# Starts the real single-node Kubernetes (docs/testbed.md, "Real node"), or finds it running.
# Prints the admin kubeconfig's path. State: $AFD_REALNODE_STATE (default /tmp/afd-realnode).
set -euo pipefail
source "$(dirname "$0")/../common.sh"
"$REPO_ROOT/scripts/realnode/prepare.sh"
VENV="$("$REPO_ROOT/scripts/dev-env.sh")"
exec "$VENV/bin/python" -m afd_devcluster.realnode start

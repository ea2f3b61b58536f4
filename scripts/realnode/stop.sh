#!/usr/bin/env bash
# Stops the real node (pods drained first), stops every daemon by its recorded PID and undoes
# the host changes it recorded at start. Safe to run when nothing runs; exits 1 and names what
# is left if the host is not back as it was.
set -euo pipefail
source "$(dirname "$0")/../common.sh"
VENV="$("$REPO_ROOT/scripts/dev-env.sh")"
exec "$VENV/bin/python" -m afd_devcluster.realnode stop

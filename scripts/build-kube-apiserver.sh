#!/usr/bin/env bash
# Builds kube-apiserver 1.20.2 from Debian's own `kubernetes` source package (once; cached
# outside the clone, keyed by the source version) and prints its path: scripts/build-kube.sh,
# which builds every Kubernetes binary of the test beds the same way.
set -euo pipefail
exec "$(dirname "$0")/build-kube.sh" kube-apiserver

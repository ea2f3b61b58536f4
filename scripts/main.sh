#!/usr/bin/env bash
# The main job, from a fresh machine: sets up what it needs (Debian packages, the cached
# Kubernetes builds, the Python environment), validates, plans and renders every
# AFDDeployment in examples/, then serves one for real: a single-node Kubernetes on this
# machine (kubelet + containerd), the images built from images/, the chart installed with
# helm, examples/cpu-tiny.yaml applied, a completion printed from its Service, a roll to a new
# topology, teardown (docs/testbed.md, "Real node"; needs root).
#   --stand-in: instead of the real node, the fast demo on a local API server where a
#               stand-in plays kubelet (converge, scale, roll, teardown; no container runs).
# Rendered manifests go to $AFD_RENDER_DIR (default: a temporary folder, printed at the end).
set -euo pipefail
mode=real-node
case "${1:-}" in
  "") ;;
  --stand-in) mode=stand-in ;;
  *) echo "usage: $0 [--stand-in]" >&2; exit 2 ;;
esac
source "$(dirname "$0")/common.sh"

ensure_debs etcd-server etcd-client openssl
# The real node's packages and all six Kubernetes binaries in one build pass (kube-apiserver
# alone first, then the other five, would fetch and compile the shared source twice).
if [ "$mode" = real-node ]; then "$REPO_ROOT/scripts/realnode/prepare.sh"; fi
AFD_KUBE_APISERVER="$("$REPO_ROOT/scripts/build-kube-apiserver.sh")"
export AFD_KUBE_APISERVER
VENV="$("$REPO_ROOT/scripts/dev-env.sh")"
AFDCTL="$VENV/bin/afdctl"
OUT_DIR="${AFD_RENDER_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/afd-render.XXXXXX")}"
mkdir -p "$OUT_DIR"
cd "$REPO_ROOT"

examples=(examples/*.yaml)
files=()
for f in "${examples[@]}"; do files+=(-f "$f"); done

echo "== afdctl validate"
"$AFDCTL" validate "${files[@]}"
for f in "${examples[@]}"; do
  echo
  echo "== afdctl plan -f $f"
  "$AFDCTL" plan -f "$f"
  out="$OUT_DIR/$(basename "$f" .yaml).rendered.yaml"
  "$AFDCTL" render -f "$f" >"$out"
  echo "   rendered $(grep -c '^kind:' "$out") objects -> $out"
done
"$AFDCTL" crd >"$OUT_DIR/crd.yaml"
echo
echo "CRD -> $OUT_DIR/crd.yaml"

echo
if [ "$mode" = stand-in ]; then
  echo "== live (stand-in kubelet): operator + local control plane"
  "$VENV/bin/python" -m afd_devcluster.demo --example examples/cpu-tiny.yaml
else
  echo "== live on the real node"
  "$VENV/bin/python" -m afd_devcluster.realnode.demo --example examples/cpu-tiny.yaml
fi

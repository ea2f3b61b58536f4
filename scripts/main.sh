#!/usr/bin/env bash
# The main job, from a fresh machine: sets up what it needs (Debian packages, the cached
# kube-apiserver build, the Python environment), validates, plans and renders every
# AFDDeployment in examples/, then runs the operator live on a local control plane: an
# example converges, scales, rolls to a new topology and is torn down.
# Rendered manifests go to $AFD_RENDER_DIR (default: a temporary folder, printed at the end).
set -euo pipefail
source "$(dirname "$0")/common.sh"

ensure_debs etcd-server etcd-client openssl
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
echo "== live: operator + local control plane"
"$VENV/bin/python" -m afd_devcluster.demo --example examples/cpu-tiny.yaml

#!/usr/bin/env bash
# The main job, from a fresh machine: sets up the Python environment (cached outside the
# clone), then validates, plans and renders every AFDDeployment in examples/.
# Rendered manifests go to $AFD_RENDER_DIR (default: a temporary folder, printed at the end).
set -euo pipefail
source "$(dirname "$0")/common.sh"

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

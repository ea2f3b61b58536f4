#!/usr/bin/env bash
# Builds kube-apiserver 1.20.2 from Debian's own `kubernetes` source package and caches the
# binary outside the clone, keyed by the source version. Rebuilds only when the binary is missing.
# Prints the binary's path on stdout (everything else goes to stderr).
set -euo pipefail

KUBE_SRC_VERSION="1.20.5+really1.20.2"
KUBE_GIT_VERSION="v1.20.2"
source "$(dirname "$0")/common.sh"
OUT_DIR="$AFD_CACHE_DIR/kube-apiserver/$KUBE_SRC_VERSION"
BIN="$OUT_DIR/kube-apiserver"


if [ -x "$BIN" ]; then
  echo "$BIN"
  exit 0
fi

ensure_debs golang-go rsync make

WORK="$(mktemp -d "${TMPDIR:-/tmp}/kube-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# A private apt configuration whose sources are the deb-src twins of the machine's own
# sources, so no mirror host is written anywhere.
APT_DIR="$WORK/apt"
mkdir -p "$APT_DIR/sources.list.d" "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial"
found_sources=0
for f in /etc/apt/sources.list.d/*.sources; do
  [ -e "$f" ] || continue
  sed -E 's/^Types:.*/Types: deb-src/' "$f" >"$APT_DIR/sources.list.d/$(basename "$f")"
  found_sources=1
done
: >"$APT_DIR/sources.list"
if [ -f /etc/apt/sources.list ]; then
  sed -nE 's/^deb (.*)/deb-src \1/p' /etc/apt/sources.list >"$APT_DIR/sources.list"
  [ -s "$APT_DIR/sources.list" ] && found_sources=1
fi
for f in /etc/apt/sources.list.d/*.list; do
  [ -e "$f" ] || continue
  sed -nE 's/^deb (.*)/deb-src \1/p' "$f" >>"$APT_DIR/sources.list"
  found_sources=1
done
[ "$found_sources" = 1 ] || { log "no apt sources found on this machine"; exit 1; }

APT_OPTS=(
  -o "Dir::Etc::SourceParts=$APT_DIR/sources.list.d"
  -o "Dir::Etc::SourceList=$APT_DIR/sources.list"
  -o "Dir::State::Lists=$APT_DIR/lists"
  -o "Dir::Cache=$APT_DIR/cache"
  -o "APT::Sandbox::User=root"
)
log "fetching the kubernetes source package"
apt-get "${APT_OPTS[@]}" update -qq >&2
(cd "$WORK" && apt-get "${APT_OPTS[@]}" source --download-only kubernetes >&2)
orig="$WORK/kubernetes_$KUBE_SRC_VERSION.orig.tar.gz"
[ -f "$orig" ] || { log "expected $(basename "$orig"); the source package has another version"; exit 1; }
mkdir -p "$WORK/src"
tar -xzf "$orig" -C "$WORK/src" --strip-components=1

# The vendored reflect2 1.0.1 segfaults under Go >= 1.18 when a custom object is served;
# Debian's 1.0.2 fixes it.
log "replacing vendored modern-go/reflect2 with Debian's 1.0.2"
(cd "$WORK" && apt-get download golang-github-modern-go-reflect2-dev >&2)
dpkg-deb -x "$WORK"/golang-github-modern-go-reflect2-dev_*.deb "$WORK/reflect2"
r2src="$(dirname "$(find "$WORK/reflect2" -name reflect2.go | head -n1)")"
vendored="$WORK/src/vendor/github.com/modern-go/reflect2"
rm -f "$vendored"/*.go "$vendored"/*.s
cp "$r2src"/*.go "$vendored/"
for asm in "$r2src"/*.s; do [ -e "$asm" ] && cp "$asm" "$vendored/"; done

export GOPATH="$WORK/gopath" GOCACHE="$WORK/gocache" GOFLAGS="" GO111MODULE=off CGO_ENABLED=0
mkdir -p "$GOPATH/src/k8s.io"
ln -s "$WORK/src" "$GOPATH/src/k8s.io/kubernetes"
cd "$GOPATH/src/k8s.io/kubernetes"
log "generating openapi definitions"
make gen_openapi >&2
log "building kube-apiserver (about 12 minutes on 2 cores)"
ver_pkgs=(k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version)
ldflags="-s -w"
for p in "${ver_pkgs[@]}"; do
  ldflags="$ldflags -X $p.gitVersion=$KUBE_GIT_VERSION -X $p.gitMajor=1 -X $p.gitMinor=20"
done
go build -ldflags "$ldflags" -o "$WORK/kube-apiserver" ./cmd/kube-apiserver >&2
mkdir -p "$OUT_DIR"
mv "$WORK/kube-apiserver" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
log "built $BIN"
echo "$BIN"

#!/usr/bin/env bash
# Builds Kubernetes 1.20.2 binaries (kube-apiserver, kubelet, kube-proxy, kube-scheduler,
# kube-controller-manager, kubectl) from Debian's own `kubernetes` source package, all missing
# ones in one pass over one source tree, and caches each outside the clone keyed by the source
# version: $AFD_CACHE_DIR/<binary>/<source version>/<binary>.
# Usage: build-kube.sh BINARY...   Prints the binaries' paths on stdout, one a line, in order.
set -euo pipefail

KUBE_SRC_VERSION="1.20.5+really1.20.2"
KUBE_GIT_VERSION="v1.20.2"
source "$(dirname "$0")/common.sh"
KNOWN="kube-apiserver kubelet kube-proxy kube-scheduler kube-controller-manager kubectl"
[ "$#" -gt 0 ] || { log "usage: $(basename "$0") BINARY... (of: $KNOWN)"; exit 2; }

bin_path() { echo "$AFD_CACHE_DIR/$1/$KUBE_SRC_VERSION/$1"; }
missing=()
for b in "$@"; do
  case " $KNOWN " in *" $b "*) ;; *) log "unknown binary '$b' (known: $KNOWN)"; exit 2 ;; esac
  [ -x "$(bin_path "$b")" ] || missing+=("$b")
done

if [ "${#missing[@]}" -gt 0 ]; then
  ensure_debs golang-go rsync make
  # One build at a time per cache: a second caller waits, then finds the binaries built.
  mkdir -p "$AFD_CACHE_DIR"
  exec 9>"$AFD_CACHE_DIR/kube-build.lock"
  flock 9
  still_missing=()
  for b in "${missing[@]}"; do [ -x "$(bin_path "$b")" ] || still_missing+=("$b"); done
  missing=("${still_missing[@]+"${still_missing[@]}"}")
fi

if [ "${#missing[@]}" -gt 0 ]; then
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
  ver_pkgs=(k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version)
  ldflags="-s -w"
  for p in "${ver_pkgs[@]}"; do
    ldflags="$ldflags -X $p.gitVersion=$KUBE_GIT_VERSION -X $p.gitMajor=1 -X $p.gitMinor=20"
  done
  # One `go build` for all of them: the packages they share compile once.
  log "building ${missing[*]} (about 12 minutes for one, 8 more for all six, on 2 cores)"
  targets=()
  for b in "${missing[@]}"; do targets+=("./cmd/$b"); done
  mkdir -p "$WORK/out"
  go build -ldflags "$ldflags" -o "$WORK/out/" "${targets[@]}" >&2
  for b in "${missing[@]}"; do
    dest="$(bin_path "$b")"
    mkdir -p "$(dirname "$dest")"
    mv "$WORK/out/$b" "$dest.tmp"
    mv "$dest.tmp" "$dest"
    log "built $dest"
  done
fi

for b in "$@"; do bin_path "$b"; done

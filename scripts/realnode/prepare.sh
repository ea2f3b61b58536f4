#!/usr/bin/env bash
# Everything the real node needs on this machine, installed or built once: Debian packages
# and the Kubernetes 1.20.2 binaries (cached outside the clone by scripts/build-kube.sh).
# Idempotent, and quick when everything is there.
set -euo pipefail
source "$(dirname "$0")/../common.sh"

# containerd + runc + CNI plugins run the pods; docker (Debian package docker.io) builds images; debootstrap makes
# the local Debian base; dnsmasq-base is the cluster DNS; tini reaps the daemons' orphans;
# iptables/conntrack/socat/ethtool/ebtables are what kubelet and kube-proxy call; gcc builds
# the pause program; busybox-static fills the test bed's check image.
ensure_debs containerd runc containernetworking-plugins docker.io debootstrap iptables conntrack \
  socat ethtool ebtables dnsmasq-base tini gcc libc6-dev busybox-static etcd-server etcd-client openssl
"$REPO_ROOT/scripts/build-kube.sh" kube-apiserver kubelet kube-proxy kube-scheduler kube-controller-manager kubectl >/dev/null

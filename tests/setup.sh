#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine, run as root.
# Installs every Debian package the tests and the demo need, the Rust musl
# target, builds the local control plane (etcd, kube-apiserver, kubectl) and the test node (kubelet,
# kube-scheduler, kube-controller-manager) from Go modules, and fetches the Debian
# kernel. Everything built or downloaded is cached under $ANNEAL_CACHE
# (default /var/cache/anneal), never in the tree. A re-run on a ready machine
# takes seconds.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
export ANNEAL_CACHE=${ANNEAL_CACHE:-/var/cache/anneal}
mkdir -p "$ANNEAL_CACHE/bin"
log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ "$(id -u)" != 0 ]; then
  echo "setup: run as root (network namespaces, taps and apt need it)" >&2
  exit 1
fi

# --- Debian packages -------------------------------------------------------
PKGS=(
  qemu-system-x86 ovmf ipxe qemu-utils busybox-static musl-tools
  e2fsprogs dosfstools gdisk mtools fdisk partclone file zstd cpio
  kea-admin kea-dhcp4-server dnsmasq-base tftpd-hpa atftp tftp-hpa isc-dhcp-relay
  radvd iproute2 tcpdump curl ca-certificates openssl procps
  lldpd
  build-essential pkg-config git kmod
  systemd-boot-efi binutils efibootmgr
  aria2 tmux
  skopeo
  containerd runc containernetworking-plugins iptables nftables
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  # Daemons from these packages (kea, tftpd-hpa, radvd, lldpd) must not start on the
  # host: the tests run their own copies inside network namespaces.
  policy_added=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    policy_added=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ -n "$policy_added" ] && rm -f /usr/sbin/policy-rc.d
fi
# Kea wants its runtime directory.
mkdir -p /run/kea

# --- Rust --------------------------------------------------------------------
if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    log "installing rustup"
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain none
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
fi
# rust-toolchain.toml pins the toolchain, the musl target and rustfmt/clippy;
# `rustup show` installs whatever of it is missing.
(cd "$repo" && rustup show active-toolchain >/dev/null 2>&1 || (cd "$repo" && rustup toolchain install))
(cd "$repo" && rustup target list --installed | grep -q x86_64-unknown-linux-musl || rustup target add x86_64-unknown-linux-musl)

# --- Go control plane ----------------------------------------------------------
# Prefer a Go newer than Debian's when present (the machine image has one).
for g in /usr/local/go/bin "$HOME/go/bin"; do [ -x "$g/go" ] && export PATH="$g:$PATH" && break; done
if ! command -v go >/dev/null 2>&1; then
  echo "setup: Go >= 1.26 is needed to build the control plane and test tools (the machine image ships it in /usr/local/go)" >&2
  exit 1
fi
build_go() { # module-dir output package [more -ldflags]
  local dir=$1 out=$2 pkg=$3 ldflags=${4:-} stamp="$ANNEAL_CACHE/bin/.$2.stamp" sum
  sum=$({ cat "$dir/go.mod" "$dir/go.sum" "$dir"/*.go 2>/dev/null; printf '%s' "$ldflags"; } | sha256sum | cut -c1-16)
  if [ -x "$ANNEAL_CACHE/bin/$out" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$sum" ]; then
    return 0
  fi
  log "building $out from Go modules (cached in $ANNEAL_CACHE/bin)"
  (cd "$dir" && go build -mod=readonly -trimpath -ldflags="-s -w $ldflags" -o "$ANNEAL_CACHE/bin/$out.tmp" "$pkg")
  mv "$ANNEAL_CACHE/bin/$out.tmp" "$ANNEAL_CACHE/bin/$out"
  echo "$sum" > "$stamp"
}
build_go "$here/controlplane/etcd" etcd .
# The API server reports its release at /version (as Kubernetes' own build
# stamps it; unstamped it says v0.0.0-master, which the Cluster API managers
# refuse: tests/setup.d/capi.sh).
kube_version=$(sed -n 's/^require k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' "$here/controlplane/kube/go.mod")
kube_major=${kube_version#v} kube_minor=${kube_version#v*.}
kube_stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_stamp="$kube_stamp -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=${kube_major%%.*} -X $pkg.gitMinor=${kube_minor%%.*}"
done
build_go "$here/controlplane/kube" kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$kube_stamp"
build_go "$here/controlplane/kube" kubectl k8s.io/kubernetes/cmd/kubectl
# The test node (tests/testinfra/src/node.rs, issue 17): kubelet, the
# scheduler and the controller manager from the same release; containerd,
# runc and the CNI plugins come from Debian (above; their daemons are not
# started: the node runs its own containerd).
build_go "$here/controlplane/kube" kubelet k8s.io/kubernetes/cmd/kubelet
build_go "$here/controlplane/kube" kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler
build_go "$here/controlplane/kube" kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager
# kube-proxy (iptables mode): Services on the node, for the tests that reach
# one from outside the cluster (node_failover: the agent API's externalIP)
build_go "$here/controlplane/kube" kube-proxy k8s.io/kubernetes/cmd/kube-proxy
# helm (issue 43): lint and template deploy/helm/anneal, its output dry-run
# against the real kube-apiserver (tests/tests/helm_chart.rs)
build_go "$here/controlplane/helm" helm helm.sh/helm/v4/cmd/helm

# --- Debian kernel (guest) ------------------------------------------------------
"$repo/qemu/fetch-kernel.sh"

# --- Per-area additions ------------------------------------------------------------
for f in "$here"/setup.d/*.sh; do
  [ -e "$f" ] || continue
  # shellcheck source=/dev/null
  . "$f"
done
log "ready (cache: $ANNEAL_CACHE)"

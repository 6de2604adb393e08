#!/usr/bin/env bash
# Builds the test control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)
# from the Go modules pinned in tests/gotools/go.mod (or tests/gotools/k8s137/go.mod), into a cache outside the repository keyed by
# the Kubernetes version and the module checksums. A warm cache makes this a no-op.
#
# Prints the directory holding the binaries on its last line of stdout; progress goes to stderr.
# Environment: DRUST_CACHE_DIR (default ~/.cache/drust); DRUST_K8S selects the Kubernetes minor:
# 1.36 (default, tests/gotools/go.mod) or 1.37 (tests/gotools/k8s137/go.mod). etcd is built from
# tests/gotools either way.
set -euo pipefail

here=$(cd "$(dirname "$0")/../gotools" && pwd)
case "${DRUST_K8S:-1.36}" in
  1.36)
    kmod=$here
    sum=$(cat "$here/go.mod" "$here/go.sum" "$here/cmd/etcd/main.go" | sha256sum | cut -c1-12)
    ;;
  1.37)
    kmod=$here/k8s137
    sum=$(cat "$kmod/go.mod" "$kmod/go.sum" "$here/go.mod" "$here/go.sum" "$here/cmd/etcd/main.go" | sha256sum | cut -c1-12)
    ;;
  *) echo "DRUST_K8S=${DRUST_K8S}: expected 1.36 or 1.37" >&2; exit 2 ;;
esac
# The pin, whether in a require block or on a one-line require.
k8s_version=$(awk '$1=="require"{$1=""; $0=$0} $1=="k8s.io/kubernetes"{print $2; exit}' "$kmod/go.mod")
[[ -n "$k8s_version" ]] || { echo "no k8s.io/kubernetes pin in $kmod/go.mod" >&2; exit 1; }
cache="${DRUST_CACHE_DIR:-$HOME/.cache/drust}/controlplane/${k8s_version}-${sum}"
bins=(etcd kube-apiserver kube-controller-manager kube-scheduler)

if [[ -f "$cache/.complete" ]]; then
  echo "control plane ${k8s_version}: cached in $cache" >&2
  echo "$cache"
  exit 0
fi

# Test threads and runs side by side may ask at once: one builds, the others wait for it and
# then find it cached.
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [[ -f "$cache/.complete" ]]; then
  echo "control plane ${k8s_version}: cached in $cache" >&2
  echo "$cache"
  exit 0
fi

echo "control plane ${k8s_version}: building into $cache (first run only; ~15-25 min on 2 cores)" >&2
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

minor=${k8s_version#v1.}; minor=${minor%%.*}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X ${pkg}.gitVersion=${k8s_version} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${minor}"
done

cd "$here"
start=$SECONDS
echo "  downloading Go modules..." >&2
go mod download >&2
if [[ "$kmod" != "$here" ]]; then (cd "$kmod" && go mod download) >&2; fi
for b in "${bins[@]}"; do
  t=$SECONDS
  case "$b" in
    etcd) dir=$here pkg=./cmd/etcd ;;
    *) dir=$kmod pkg=k8s.io/kubernetes/cmd/$b ;;
  esac
  echo "  building $b..." >&2
  (cd "$dir" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$tmp/$b" "$pkg") >&2
  echo "  built $b in $((SECONDS - t))s" >&2
done
mv "$tmp"/* "$cache/"
date -u +%FT%TZ > "$cache/.complete"
echo "control plane ${k8s_version}: built in $((SECONDS - start))s" >&2
echo "$cache"

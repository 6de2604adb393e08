#!/usr/bin/env bash
# Builds the test control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)
# from the Go modules pinned in tests/gotools/go.mod, into a cache outside the repository keyed by
# the Kubernetes version and the module checksums. A warm cache makes this a no-op.
#
# Prints the directory holding the binaries on its last line of stdout; progress goes to stderr.
# Environment: DRUST_CACHE_DIR (default ~/.cache/drust).
set -euo pipefail

here=$(cd "$(dirname "$0")/../gotools" && pwd)
k8s_version=$(awk '$1=="k8s.io/kubernetes"{print $2; exit}' "$here/go.mod")
sum=$(cat "$here/go.mod" "$here/go.sum" "$here/cmd/etcd/main.go" | sha256sum | cut -c1-12)
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
for b in "${bins[@]}"; do
  t=$SECONDS
  case "$b" in
    etcd) pkg=./cmd/etcd ;;
    *) pkg=k8s.io/kubernetes/cmd/$b ;;
  esac
  echo "  building $b..." >&2
  CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$tmp/$b" "$pkg" >&2
  echo "  built $b in $((SECONDS - t))s" >&2
done
mv "$tmp"/* "$cache/"
date -u +%FT%TZ > "$cache/.complete"
echo "control plane ${k8s_version}: built in $((SECONDS - start))s" >&2
echo "$cache"

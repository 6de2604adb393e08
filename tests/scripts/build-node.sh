#!/usr/bin/env bash
# Builds the real test node's binaries: the kubelet from the Kubernetes module pinned in
# tests/gotools/go.mod or tests/gotools/k8s137/go.mod (same replace set as the control plane), and containerd 2.x with its runc
# shim and ctr from tests/gotools/node (a module of its own, so containerd's dependencies do not
# fight Kubernetes' pins). Cached outside the repository like the control plane, keyed by the
# modules' checksums; a warm cache makes this a no-op. runc and the CNI plugins are Debian's
# (packages runc and containernetworking-plugins; ../shared/docs/real-node.md).
#
# Used by tests/e2e/src/node.rs (Node::start), and by .ci/run ahead of the tests.
#
# Prints the directory holding the binaries on its last line of stdout; progress goes to stderr.
# Environment: DRUST_CACHE_DIR (default ~/.cache/drust); DRUST_K8S selects the kubelet's minor:
# 1.36 (default, tests/gotools/go.mod) or 1.37 (tests/gotools/k8s137/go.mod). containerd is the
# same for both.
set -euo pipefail

gotools=$(cd "$(dirname "$0")/../gotools" && pwd)
case "${DRUST_K8S:-1.36}" in
  1.36) kmod=$gotools ;;
  1.37) kmod=$gotools/k8s137 ;;
  *) echo "DRUST_K8S=${DRUST_K8S}: expected 1.36 or 1.37" >&2; exit 2 ;;
esac
# The pin, whether in a require block or on a one-line require.
k8s_version=$(awk '$1=="require"{$1=""; $0=$0} $1=="k8s.io/kubernetes"{print $2; exit}' "$kmod/go.mod")
[[ -n "$k8s_version" ]] || { echo "no k8s.io/kubernetes pin in $kmod/go.mod" >&2; exit 1; }
containerd_version=$(grep -oP '^require github.com/containerd/containerd/v2 \K\S+' "$gotools/node/go.mod")
sum=$(cat "$kmod/go.mod" "$kmod/go.sum" "$gotools/node/go.mod" "$gotools/node/go.sum" | sha256sum | cut -c1-12)
cache="${DRUST_CACHE_DIR:-$HOME/.cache/drust}/node/${k8s_version}-containerd-${containerd_version}-${sum}"

if [[ -f "$cache/.complete" ]]; then
  echo "node ${k8s_version} + containerd ${containerd_version}: cached in $cache" >&2
  echo "$cache"
  exit 0
fi

# Test threads and runs side by side may ask at once: one builds, the others wait for it and
# then find it cached.
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [[ -f "$cache/.complete" ]]; then
  echo "node ${k8s_version} + containerd ${containerd_version}: cached in $cache" >&2
  echo "$cache"
  exit 0
fi

echo "node: building kubelet ${k8s_version} and containerd ${containerd_version} into $cache (first run only; ~15 min on 2 cores)" >&2
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

minor=${k8s_version#v1.}; minor=${minor%%.*}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X ${pkg}.gitVersion=${k8s_version} -X ${pkg}.gitMajor=1 -X ${pkg}.gitMinor=${minor}"
done
t=$SECONDS
(cd "$kmod" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$tmp/kubelet" k8s.io/kubernetes/cmd/kubelet) >&2
echo "  built kubelet in $((SECONDS - t))s" >&2

cd "$gotools/node"
for b in containerd containerd-shim-runc-v2 ctr; do
  t=$SECONDS
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=${containerd_version}" \
    -o "$tmp/$b" "github.com/containerd/containerd/v2/cmd/$b" >&2
  echo "  built $b in $((SECONDS - t))s" >&2
done
mv "$tmp"/* "$cache/"
date -u +%FT%TZ > "$cache/.complete"
echo "node: built in $((SECONDS - start))s" >&2
echo "$cache"

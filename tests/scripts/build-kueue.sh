#!/usr/bin/env bash
# Builds Kueue's manager (sigs.k8s.io/kueue/cmd/kueue) from the release pinned in
# tests/gotools/kueue/go.mod, a module of its own whose dependency versions are Kueue's own (its
# go.mod has no replace directives, so requiring it alone selects exactly its build list), and
# copies from that same module its Helm chart (charts/kueue: the CRDs with their conversion
# webhooks, the webhook configurations, RBAC, the webhook Service, as `helm install` gives them).
# Cached outside the repository keyed by the version and the module checksums; a warm cache makes
# this a no-op.
#
# Layout of the cache directory:
#   kueue      the manager binary (sigs.k8s.io/kueue/cmd/kueue)
#   chart/     the release's Helm chart, as released
#
# Used by tests/e2e/src/kueue.rs (Kueue::start), and by .ci/run ahead of the tests.
#
# Prints the cache directory on its last line of stdout; progress goes to stderr.
# Environment: DRUST_CACHE_DIR (default ~/.cache/drust).
set -euo pipefail

here=$(cd "$(dirname "$0")/../gotools/kueue" && pwd)
version=$(grep -oP '^require sigs.k8s.io/kueue \K\S+' "$here/go.mod")
sum=$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-12)
cache="${DRUST_CACHE_DIR:-$HOME/.cache/drust}/kueue/${version}-${sum}"

if [[ -f "$cache/.complete" ]]; then
  echo "kueue ${version}: cached in $cache" >&2
  echo "$cache"
  exit 0
fi

# Test threads and runs side by side may ask at once: one builds, the others wait for it and
# then find it cached.
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [[ -f "$cache/.complete" ]]; then
  echo "kueue ${version}: cached in $cache" >&2
  echo "$cache"
  exit 0
fi

echo "kueue ${version}: building into $cache (first run only; ~5 min on 2 cores)" >&2
tmp=$(mktemp -d "$cache/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

cd "$here"
# The chart is read from the module cache, checked against go.sum like the module's code.
src=$(go mod download -json sigs.k8s.io/kueue | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
if [[ ! -f "$src/charts/kueue/Chart.yaml" ]]; then
  echo "kueue ${version}: no charts/kueue/Chart.yaml in the module (${src:-not downloaded})" >&2
  exit 1
fi
cp -r "$src/charts/kueue" "$tmp/chart"
chmod -R u+w "$tmp/chart"

# As Kueue's Makefile builds bin/manager: CGO off, the version stamped into pkg/version.
t=$SECONDS
CGO_ENABLED=0 go build -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=${version}" \
  -o "$tmp/kueue" sigs.k8s.io/kueue/cmd/kueue >&2
echo "  built kueue in $((SECONDS - t))s" >&2

mv "$tmp"/* "$cache/"
date -u +%FT%TZ > "$cache/.complete"
echo "kueue ${version}: built in $((SECONDS - start))s" >&2
echo "$cache"

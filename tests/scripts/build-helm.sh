#!/usr/bin/env bash
# Builds Helm from its Go module (helm.sh/helm/v4, version pinned below) into a cache outside the
# repository keyed by that version. A warm cache makes this a no-op. Needs only Go and the module
# proxy; no release tarball, no network besides the proxy.
#
# Prints the path of the helm binary on its last line of stdout; progress goes to stderr.
# Environment: DRUST_CACHE_DIR (default ~/.cache/drust).
set -euo pipefail

helm_version=v4.3.1
cache="${DRUST_CACHE_DIR:-$HOME/.cache/drust}/helm/${helm_version}"
bin="$cache/helm"

if [[ -x "$bin" && -f "$cache/.complete" ]]; then
  echo "helm ${helm_version}: cached in $cache" >&2
  echo "$bin"
  exit 0
fi

# Test threads and runs side by side may ask at once: one builds, the others wait for it and
# then find it cached.
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [[ -x "$bin" && -f "$cache/.complete" ]]; then
  echo "helm ${helm_version}: cached in $cache" >&2
  echo "$bin"
  exit 0
fi

echo "helm ${helm_version}: building into $cache (first run only; ~5 CPU-minutes plus module downloads)" >&2
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

start=$SECONDS
# `go install pkg@version` builds the module exactly as released (its own go.mod and go.sum),
# outside any module of ours. The version string helm prints comes from -X on its version
# package, as its Makefile does.
CGO_ENABLED=0 GOBIN="$tmp" go install -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=${helm_version}" \
  "helm.sh/helm/v4/cmd/helm@${helm_version}" >&2
mv "$tmp/helm" "$bin"
date -u +%FT%TZ > "$cache/.complete"
echo "helm ${helm_version}: built in $((SECONDS - start))s" >&2
echo "$bin"

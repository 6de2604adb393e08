#!/usr/bin/env bash
# Builds the container image registry (CNCF Distribution, github.com/distribution/distribution/v3,
# the registry behind Docker Hub and most self-hosted ones; version pinned below) from its Go
# module into a cache outside the repository keyed by that version. A warm cache makes this a
# no-op. Needs only Go and the module proxy.
#
# Prints the path of the registry binary on its last line of stdout; progress goes to stderr.
# Environment: DRUST_CACHE_DIR (default ~/.cache/drust).
set -euo pipefail

version=v3.1.2
cache="${DRUST_CACHE_DIR:-$HOME/.cache/drust}/registry/${version}"
bin="$cache/registry"
cached() { [[ -x "$bin" && -f "$cache/.complete" ]]; }

if cached; then
  echo "registry ${version}: cached in $cache" >&2
  echo "$bin"
  exit 0
fi
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if cached; then
  echo "registry ${version}: cached in $cache" >&2
  echo "$bin"
  exit 0
fi

echo "registry ${version}: building into $cache (first run only)" >&2
tmp=$(mktemp -d "$cache/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
# `go install pkg@version` builds the module exactly as released (its own go.mod and go.sum).
CGO_ENABLED=0 GOBIN="$tmp" go install -trimpath -ldflags "-s -w" \
  "github.com/distribution/distribution/v3/cmd/registry@${version}" >&2
mv "$tmp/registry" "$bin"
date -u +%FT%TZ > "$cache/.complete"
echo "registry ${version}: built in $((SECONDS - start))s" >&2
echo "$bin"

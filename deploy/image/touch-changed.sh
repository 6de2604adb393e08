#!/bin/sh
# Makes cargo see every source that changed since the last build in this target directory.
#   touch-changed.sh MANIFEST         before the build: touch the changed sources
#   touch-changed.sh MANIFEST --save  after a build that succeeded: record the sources
# Cargo decides what to rebuild by modification times. The Dockerfile's target directory is a
# build cache, and a source copied in keeps its own time, which can be older than an output the
# cache holds (a file changed while the last build ran): cargo would keep the stale output. The
# manifest (SHA-256 of every file of the build context, kept in the cache) says which files
# differ from the last build's; only those are touched, so unchanged crates are not rebuilt.
set -eu
manifest=$1
now=/tmp/sources.sha256
if [ "${2:-}" = --save ]; then
  cp "$now" "$manifest"
  exit 0
fi
find . -path ./target -prune -o -type f -print0 | sort -z | xargs -0 sha256sum > "$now"
if [ -f "$manifest" ]; then
  # Lines of the new list that the old one lacks: files added or changed ("<digest>  <path>").
  sort "$manifest" > /tmp/before
  sort "$now" | comm -13 /tmp/before - | cut -c67- | while IFS= read -r file; do
    touch -- "$file"
  done
else
  find . -path ./target -prune -o -type f -exec touch -- {} +
fi

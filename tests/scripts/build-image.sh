#!/usr/bin/env bash
# Builds the plugin image from deploy/Dockerfile with buildah (Debian's), exactly as written but
# for its build stage's base image: no image registry is reachable here, so BUILD_IMAGE is a
# local Debian 12 image made with mmdebstrap from Debian's archive (bookworm, plus
# bookworm-security for Rust: rustc-web and cargo-web, Debian's Rust for bookworm). The final
# stage has no base image to swap.
#
# Usage: build-image.sh [DESTINATION...]: each DESTINATION (`docker://host:port/repo:tag`) gets
# the image pushed to it after the build (plain HTTP: registries on this machine).
#
# Everything buildah keeps lives in the cache, not in the machine's own container storage: its
# image store (the base image, the layers of the last build) and the Dockerfile's cache mounts
# (the cargo registry and release target directory), so a later build of changed sources
# rebuilds the workspace's crates only.
# Prints the image's name in that store on its last line of stdout; progress goes to stderr.
# Environment: DRUST_CACHE_DIR (default ~/.cache/drust), DRUST_IMAGE_TAG (default dev).
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts=tests/scripts
"$scripts/install-debian-packages.sh" "the plugin image's build" buildah mmdebstrap

image="localhost/drust/gpu-kubelet-plugin:${DRUST_IMAGE_TAG:-dev}"
cache="${DRUST_CACHE_DIR:-$HOME/.cache/drust}/image"
mkdir -p "$cache/tmp"
buildah() { TMPDIR="$cache/tmp" command buildah --root "$cache/storage" --runroot "$cache/run" "$@"; }
suite=bookworm
mirror=http://deb.debian.org/debian
security=http://deb.debian.org/debian-security
# What rust:1.95-bookworm gives the build: a compiler for Rust (1.95 or later) and C (ring's
# assembly and C parts), the C library's headers, the CA certificates cargo checks crates.io's
# TLS with.
packages=ca-certificates,rustc-web,cargo-web,gcc,libc6-dev
minimum_rust=1.95
# The machine's CA bundle replaces Debian's in the build image: it holds the CA of whatever
# TLS-inspecting proxy stands between this machine and crates.io (one does here), which cargo
# in the build must trust as the machine's own cargo does.
ca_bundle=/etc/ssl/certs/ca-certificates.crt
recipe=$( (printf '%s\n' "$suite" "$mirror" "$security" "$packages" "$minimum_rust"; cat "$ca_bundle") | sha256sum | cut -c1-12)
base="localhost/drust-build/rust-bookworm:$recipe"

# Test binaries and CI steps may ask at once: one builds, the others wait for it.
exec 9>"$cache/.lock"
flock 9

start=$SECONDS
if buildah inspect --type image "$base" >/dev/null 2>&1; then
  echo "build image $base: present" >&2
else
  echo "build image $base: mmdebstrap $suite with $packages (first run only)" >&2
  tmp=$(mktemp -d)
  container=
  trap 'rm -rf "$tmp"; [[ -z "$container" ]] || buildah rm "$container" >/dev/null 2>&1 || true' EXIT
  mmdebstrap --quiet --variant=minbase --format=tar --include="$packages" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$suite" "$tmp/rootfs.tar" \
    "deb $mirror $suite main" "deb $security $suite-security main" >&2
  container=$(buildah from scratch)
  buildah add --quiet "$container" "$tmp/rootfs.tar" / >/dev/null
  buildah copy --quiet "$container" "$ca_bundle" "$ca_bundle" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --label "dev.drust.recipe=$suite $packages" "$container"
  version=$(buildah run "$container" -- rustc --version)
  echo "build image: $version" >&2
  lowest=$(printf '%s\n%s\n' "$minimum_rust" "$(echo "$version" | awk '{print $2}')" | sort -V | head -1)
  if [[ "$lowest" != "$minimum_rust" ]]; then
    echo "Debian's $suite Rust is $version; the workspace needs $minimum_rust or later" >&2
    exit 1
  fi
  buildah commit --quiet --rm "$container" "$base" >/dev/null
  container=
  echo "build image $base: made in $((SECONDS - start)) s" >&2
fi

start=$SECONDS
# A build that failed before --force-rm left its working container, which holds its layers
# and makes the prune below refuse: no other build runs in this storage (the lock above).
buildah rm --all >/dev/null
buildah bud --layers --force-rm --network=host --build-arg "BUILD_IMAGE=$base" \
  -f deploy/Dockerfile -t "$image" . >&2
echo "image $image: built in $((SECONDS - start)) s" >&2
# The layers of earlier builds, no longer named by any image: the cache keeps the last build's.
buildah rmi --prune >/dev/null
for destination in "$@"; do
  buildah push --quiet --tls-verify=false "$image" "$destination" >&2
  echo "image $image: pushed to $destination" >&2
done
echo "$image"

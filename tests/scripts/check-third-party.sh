#!/usr/bin/env bash
# Proves that each patched crate under third_party/ is exactly the release published on
# crates.io plus the patch beside it (third_party/<crate>.patch), and that the workspace builds
# with the patched copy rather than the registry's: an upgrade that silently drops a patch fails
# here (and the kubelet tests fail with it). See third_party/README.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for dir in "$root"/third_party/*/; do
  crate=$(basename "$dir")
  version=$(awk -F'"' '/^version = /{print $2; exit}' "$dir/Cargo.toml")
  # Fetch the pristine release with cargo itself, in a throwaway package.
  probe="$tmp/probe-$crate"
  mkdir -p "$probe/src"
  printf '[package]\nname = "probe"\nversion = "0.0.0"\nedition = "2021"\n\n[dependencies]\n%s = "=%s"\n\n[workspace]\n' \
    "$crate" "$version" > "$probe/Cargo.toml"
  : > "$probe/src/lib.rs"
  cargo fetch --quiet --manifest-path "$probe/Cargo.toml"
  src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"$crate-$version" | head -n1)
  pristine="$tmp/pristine-$crate"
  cp -r "$src" "$pristine"
  rm -f "$pristine/.cargo-ok"
  patch --quiet -p1 -d "$pristine" < "$root/third_party/$crate.patch"
  if ! diff -r --exclude=Cargo.lock "$pristine" "$dir" > "$tmp/diff"; then
    echo "third_party/$crate is not $crate $version from crates.io plus third_party/$crate.patch:" >&2
    cat "$tmp/diff" >&2
    exit 1
  fi
  # The workspace must resolve the crate to this path, not to the registry.
  if ! (cd "$root" && cargo metadata --locked --format-version 1 > "$tmp/metadata.json"); then
    echo "cargo metadata failed: does Cargo.lock still match the [patch.crates-io] entry for $crate?" >&2
    exit 1
  fi
  used=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[2])); print("\n".join(p["manifest_path"] for p in m["packages"] if p["name"]==sys.argv[1]))' "$crate" "$tmp/metadata.json")
  if [[ "$used" != "${dir}Cargo.toml" ]]; then
    echo "the workspace does not build $crate from third_party/$crate; it uses: $used" >&2
    exit 1
  fi
  echo "third_party/$crate: $crate $version + third_party/$crate.patch, used by the workspace"
done

#!/usr/bin/env bash
# Debian packages the real test node needs (runc, the CNI plugins, static busybox for the
# images), installed with apt-get when missing. Used by .ci/run and by the demo.
set -euo pipefail
need=()
for package in runc containernetworking-plugins busybox-static; do
  # "install ok installed" only: a removed package can linger as config files ("rc").
  [[ "$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null)" == "install ok installed" ]] || need+=("$package")
done
if (( ${#need[@]} )); then
  echo "installing ${need[*]} (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi

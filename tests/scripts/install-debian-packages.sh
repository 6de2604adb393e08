#!/usr/bin/env bash
# Installs Debian packages with apt-get when missing: `install-debian-packages.sh WHAT PACKAGE...`
# (WHAT says what they are for, in the messages). Concurrent callers (test binaries run side by
# side) take one lock: the first installs, the others wait and then find everything installed.
set -euo pipefail
what=$1
shift
packages=("$@")
missing() {
  need=()
  for package in "${packages[@]}"; do
    # "install ok installed" only: a removed package can linger as config files ("rc").
    [[ "$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null)" == "install ok installed" ]] || need+=("$package")
  done
}
missing
(( ${#need[@]} )) || exit 0
if [[ $(id -u) != 0 ]]; then
  echo "$what needs Debian's ${need[*]}: install them as root (apt-get install ${need[*]})" >&2
  exit 1
fi
exec 9>"${DRUST_PACKAGES_LOCK:-/var/lock/drust-node-packages.lock}"
flock 9
missing
if (( ${#need[@]} )); then
  echo "installing Debian packages for $what: ${need[*]} (apt-get, once)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
  echo "installed ${need[*]}" >&2
fi

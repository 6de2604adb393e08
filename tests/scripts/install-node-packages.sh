#!/usr/bin/env bash
# Debian packages the real test node needs (runc, the CNI plugins, static busybox for the
# images), installed with apt-get when missing. Used by .ci/run, by the demo and by the test
# harness (`drust_e2e::node::ensure_packages`, before the first node starts), so `cargo test`
# needs no step before it.
exec "$(dirname "$0")/install-debian-packages.sh" "the real test node" \
  runc containernetworking-plugins busybox-static

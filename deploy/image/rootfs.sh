#!/bin/sh
# Assembles the plugin image's root filesystem (deploy/Dockerfile's final stage, which has no
# base image) in OUT from the release binaries in BIN, inside the build stage: every file the
# image holds is put there by a line below that says why.
#   rootfs.sh OUT BIN
# Fails when a file is missing, so an image never lacks one silently.
set -eu
out=$1
bin=$2
[ ! -e "$out" ] || { echo "rootfs.sh: $out exists" >&2; exit 1; }

# The plugin (the entrypoint), its CDI hook (the plugin copies it to the host, from where the
# container runtime runs it for `kernel`-level shares) and the explain controller (the chart's
# Deployment runs this image with it as the command).
install -D -m 0755 "$bin/gpu-kubelet-plugin" "$out/usr/bin/gpu-kubelet-plugin"
install -D -m 0755 "$bin/drust-cdi-hook" "$out/usr/bin/drust-cdi-hook"
install -D -m 0755 "$bin/drust-explain-controller" "$out/usr/bin/drust-explain-controller"
# The ComputeDomain controller (the chart's Deployment with `computeDomains.enabled`); its IMEX
# daemon Pods run this image too: this binary's `imex-daemon` runs `chroot /driver-root
# nvidia-imex` and restarts it when its nodes file changes, and their readiness probe is its
# `imex-ready` (the image has no shell to compare the answer with).
install -D -m 0755 "$bin/drust-compute-domain-controller" \
  "$out/usr/bin/drust-compute-domain-controller"
# An MPS control daemon Pod runs `chroot /driver-root nvidia-cuda-mps-control -f` in this image.
install -D -m 0755 "$(command -v chroot)" "$out/usr/sbin/chroot"

# Their shared libraries, at the paths the dynamic loader looks in (from ldd: glibc's libc and
# libm, libgcc_s, the loader itself).
libraries() {
  for binary in "$out/usr/bin/gpu-kubelet-plugin" "$out/usr/bin/drust-cdi-hook" \
                "$out/usr/bin/drust-explain-controller" \
                "$out/usr/bin/drust-compute-domain-controller" "$out/usr/sbin/chroot"; do
    ldd "$binary" | awk '/=> \// {print $3} /^\t\// {print $1}'
  done
  # The NVIDIA driver's libnvidia-ml.so.1 (which the plugin opens from the host's driver root)
  # and its tools that the plugin runs from there (nvidia-smi, nvidia-cuda-mps-control) were
  # linked against glibc's separate thread, real-time and dynamic-loading libraries; glibc
  # 2.34 and later keep them as compatibility files that the loader still has to find.
  dir=$(dirname "$(ldd "$out/usr/sbin/chroot" | awk '/libc.so.6 => \// {print $3}')")
  for compat in libpthread.so.0 librt.so.1 libdl.so.2; do echo "$dir/$compat"; done
}
for library in $(libraries | sort -u); do
  # Copy the file a link names, keeping the link's own path (/lib64/ld-linux-x86-64.so.2 is a
  # link on Debian; the image needs only the path).
  install -D -m 0755 "$(readlink -f "$library")" "$out$library"
done

# /tmp, for anything that writes a temporary file (mode 1777, as on every Linux root).
install -d -m 1777 "$out/tmp"

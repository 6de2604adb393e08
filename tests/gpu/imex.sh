#!/usr/bin/env bash
# What only hardware shows about ComputeDomains (issue 43), for a lent multi-node NVLink system
# (GB200/GB300 trays of one NVL72 rack, the NVIDIA driver and its nvidia-imex package installed,
# the host's nvidia-imex service stopped: one IMEX daemon per node). Run it on every node of the
# system at about the same time, with the same node list in the same order:
#
#   tests/gpu/imex.sh OUT_DIR IP_OF_NODE_0 IP_OF_NODE_1 [...]
#
# On each node it records the fabric (tests/gpu/fabric.sh), then runs the real nvidia-imex with
# the imexd.cfg drust's controller gives its daemons (`drust-compute-domain-controller
# imex-config`, or CONTROLLER=path) and a nodes file of the given IPs, as a daemon Pod would
# (IMEX_NODE_CONFIG_FILE pointed at this run's file), and records:
#   - whether `nvidia-imex-ctl -c <cfg> -q` answers READY (what the daemon Pods' readiness probe
#     requires), and how long it took, with the daemon's log;
#   - `nvidia-imex-ctl -c <cfg> -N` (the node table: every peer connected?);
#   - channel 0's device node (made with the major from /proc/devices if missing, removed after);
#   - with NVBANDWIDTH=path and MPI (mpirun) available, NVIDIA's nvbandwidth multinode test
#     (memory exported on one tray and imported on another over the channel); otherwise says it
#     was skipped.
# The daemon is stopped and what the script made is removed at the end. Not in the README's
# test command. The stand-ins drust tests with (tests/fakes) honour the same flags; their
# differences are listed in tests/fakes/src/nvidia-imex.rs.
set -uo pipefail
out=${1:?OUT_DIR}
shift
(($# >= 2)) || { echo "give the IPs of at least two nodes, the same list on every node" >&2; exit 2; }
mkdir -p "$out"
txt=$out/imex-$(hostname).txt
: >"$txt"
section() { printf '\n## %s\n' "$1" >>"$txt"; }
here=$(cd "$(dirname "$0")" && pwd)

section "fabric"
"$here/fabric.sh" "$out/fabric-$(hostname)" >>"$txt" 2>&1 || echo "fabric.sh failed" >>"$txt"

section "tools"
for t in nvidia-imex nvidia-imex-ctl; do command -v "$t" >>"$txt" 2>&1 || echo "$t: missing" >>"$txt"; done
nvidia-imex --version >>"$txt" 2>&1 || true
systemctl is-active nvidia-imex >>"$txt" 2>&1 || true

work=$(mktemp -d)
made_node=""
daemon=""
cleanup() {
  [[ -n "$daemon" ]] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
  [[ -n "$made_node" ]] && rm -f "$made_node"
  rm -rf "$work"
}
trap cleanup EXIT

section "imexd.cfg (drust's, nodes file of this run)"
controller=${CONTROLLER:-$(command -v drust-compute-domain-controller || echo "$here/../../target/release/drust-compute-domain-controller")}
"$controller" imex-config | sed "s|^IMEX_NODE_CONFIG_FILE=.*|IMEX_NODE_CONFIG_FILE=$work/nodes.cfg|" >"$work/imexd.cfg"
printf '%s\n' "$@" >"$work/nodes.cfg"
cat "$work/imexd.cfg" "$work/nodes.cfg" >>"$txt"

section "channel 0"
major=$(awk '/Character devices/{c=1;next} /^$/{c=0} c && $2=="nvidia-caps-imex-channels"{print $1}' /proc/devices)
echo "major: ${major:-none}" >>"$txt"
node=/dev/nvidia-caps-imex-channels/channel0
if [[ -n "$major" && ! -e "$node" ]]; then
  mkdir -p /dev/nvidia-caps-imex-channels && mknod -m 666 "$node" c "$major" 0 && made_node=$node
fi
ls -la /dev/nvidia-caps-imex-channels >>"$txt" 2>&1

section "nvidia-imex -c (drust's config)"
nvidia-imex -c "$work/imexd.cfg" >"$work/daemon.log" 2>&1 &
daemon=$!
start=$(date +%s)
answer=""
for _ in $(seq 1 120); do
  answer=$(nvidia-imex-ctl -c "$work/imexd.cfg" -q 2>&1)
  [[ "$answer" == "READY" ]] && break
  sleep 1
done
echo "answer: $answer after $(( $(date +%s) - start )) s" >>"$txt"
nvidia-imex-ctl -c "$work/imexd.cfg" -N >>"$txt" 2>&1 || true
echo "--- daemon log" >>"$txt"
cat "$work/daemon.log" >>"$txt"

section "memory across trays"
if [[ -n "${NVBANDWIDTH:-}" ]] && command -v mpirun >/dev/null; then
  hosts=$(IFS=,; echo "$*")
  mpirun --allow-run-as-root -H "$hosts" -np "$#" "$NVBANDWIDTH" -t multinode_device_to_device_memcpy_read_ce >>"$txt" 2>&1 \
    || echo "nvbandwidth failed" >>"$txt"
else
  echo "skipped: set NVBANDWIDTH to NVIDIA's nvbandwidth (multinode build) and have mpirun" >>"$txt"
fi
echo "written: $txt"

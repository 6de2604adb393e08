#!/usr/bin/env bash
# Per-client MPS limits on a real GPU: what issue 17's shares rely on. One control daemon
# (started by the plugin's own code, with a daemon-wide default) serves several clients, each
# with its own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT / CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, as each
# share's container would get them. Prints one line per client; not in the README's test command.
#
#   tests/gpu/mps_shares.sh OUT_DIR      (env: DRIVER_ROOT, PROBE as for validate.sh)
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
DRIVER_ROOT=${DRIVER_ROOT:-/usr/local/nvidia}
PROBE=${PROBE:?prebuilt gpu_probe}
mpsctl=$(command -v nvidia-cuda-mps-control || echo "$DRIVER_ROOT/bin/nvidia-cuda-mps-control")
root=$(mktemp -d /tmp/drust-shares.XXXXXX)
uid=9b1f3c2d-4e5a-4b6c-8d7e-0f1a2b3c4d5e
# Daemon-wide default: 10 GiB pinned, 100% threads (the GPU's owner sets the ceiling).
"$PROBE" mps-start --driver-root "$DRIVER_ROOT" --mps-root "$root" --uid "$uid" \
    --pinned-mib 10240 >"$out/shares-start.json" 2>>"$out/shares.log" || { echo "mps-start failed"; exit 1; }
pipe="$root/$uid/pipe"
client() { # name pinned-limit thread-percentage alloc-GiB
    env CUDA_MPS_PIPE_DIRECTORY="$pipe" CUDA_MPS_LOG_DIRECTORY="$root/$uid/log" \
        ${2:+CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=$2} ${3:+CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$3} \
        python3 - "$1" "$4" <<'PY' 2>&1
import sys, time, torch
name, gib = sys.argv[1], int(sys.argv[2])
props = torch.cuda.get_device_properties(0)
try:
    x = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    got = "allowed"
except RuntimeError as e:
    got = "refused"
# A fixed amount of work: its time shows the thread percentage.
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): a @ a
torch.cuda.synchronize()
print(f"{name}: {gib} GiB {got}; 20 bf16 8192^3 products {1000*(time.perf_counter()-t):.0f} ms; SMs reported {props.multi_processor_count}")
PY
}
{
    client "no per-client limit" "" "" 8
    client "share A: 2G pinned" 2G "" 4
    client "share B: 6G pinned" 6G "" 4
    client "share C: 16G pinned (above the daemon's 10G)" 16G "" 12
    client "share D: 25% threads" "" 25 1
    client "share E: 100% threads" "" 100 1
    # Two shares at once, each with its own limit.
    client "concurrent A: 2G" 2G 50 4 & client "concurrent B: 6G" 6G 50 4; wait
} | tee "$out/shares.txt"
echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$pipe "$mpsctl" >>"$out/shares.txt" 2>&1
cat "$root/$uid/log/control.log" "$root/$uid/log/server.log" >"$out/shares-mps.log" 2>/dev/null
"$PROBE" mps-stop --driver-root "$DRIVER_ROOT" --mps-root "$root" --uid "$uid" >>"$out/shares.log" 2>&1
rm -rf "$root"

#!/usr/bin/env bash
# What legacy MPS needs shared between its server and its clients (issue 41, defect 2): does a
# client whose /dev/shm is not the server's still work, and what does MPS keep there?
#
# One control daemon, started with the plugin's own code (`gpu_probe mps-start`) in a mount
# namespace whose /dev/shm is a 64 MiB tmpfs of its own (as the daemon Pod gets one), root's
# server started at once, the GPU in EXCLUSIVE_PROCESS (a client that missed MPS cannot run
# beside the server). Then CUDA clients, each in its own mount namespace:
#   shared   /dev/shm is the daemon's tmpfs (what drust does today)
#   private  /dev/shm is a fresh tmpfs of the client's own (what a container has without drust)
#   host     /dev/shm is the machine's own (neither)
#   readonly /dev/shm is the daemon's tmpfs, mounted read-only
#   second   a shared client while another shared client is connected (what one tenant sees of
#            another)
# Each prints one line: whether it ran through MPS, and the files in its /dev/shm while
# connected (name, size, mode, owner). Not in the README's test command (CI has no GPU).
#
#   tests/gpu/mps_shm.sh OUT_DIR      (env: DRIVER_ROOT, PROBE as for validate.sh; root;
#                                     python3 with torch; util-linux unshare; GPU 0 idle)
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
DRIVER_ROOT=${DRIVER_ROOT:-/usr/local/nvidia}
PROBE=${PROBE:?prebuilt gpu_probe}
mpsctl=$(command -v nvidia-cuda-mps-control || echo "$DRIVER_ROOT/bin/nvidia-cuda-mps-control")
smi=$(command -v nvidia-smi || echo "$DRIVER_ROOT/bin/nvidia-smi")
root=$(mktemp -d /tmp/drust-shm.XXXXXX)
key=gpu-shm-test
pipe=$root/$key/pipe
shm=$root/daemon-shm
log=$out/shm.log
restore() {
    "$PROBE" mps-stop --driver-root "$DRIVER_ROOT" --mps-root "$root" --uid "$key" >>"$log" 2>&1
    "$smi" -i 0 -c DEFAULT >>"$log" 2>&1
    umount "$shm" 2>>"$log"
    rm -rf "$root"
}
trap restore EXIT
mkdir -p "$shm"
mount -t tmpfs -o size=64m,mode=1777,nosuid,nodev drust-mps-shm "$shm" || { echo "cannot mount a tmpfs"; exit 1; }
"$smi" -i 0 -c EXCLUSIVE_PROCESS >>"$log" 2>&1 || { echo "cannot set EXCLUSIVE_PROCESS"; exit 1; }
# The daemon (and the servers it spawns) see $shm as /dev/shm.
unshare -m --propagation private sh -c 'mount --bind "$0" /dev/shm && exec "$@"' "$shm" \
    "$PROBE" mps-start --driver-root "$DRIVER_ROOT" --mps-root "$root" --uid "$key" \
    >"$out/shm-start.json" 2>>"$log" || { echo "mps-start failed: $(tail -n 3 "$log")"; exit 1; }
chmod 0755 "$root" "$root/$key"
echo start_server -uid 0 | CUDA_MPS_PIPE_DIRECTORY=$pipe "$mpsctl" >>"$log" 2>&1
sleep 2

# client NAME MODE HOLD_SECONDS [UNSHARE_FLAGS...]: a CUDA client in its own mount namespace
# (and the namespaces UNSHARE_FLAGS add: a container's PID and IPC ones) whose /dev/shm is set
# by MODE; prints one line, holding its context HOLD_SECONDS after listing /dev/shm.
client() {
    local name=$1 mode=$2 hold=$3
    shift 3
    unshare -m --propagation private "$@" sh -c '
        case "$1" in
            shared) mount --bind "$2" /dev/shm ;;
            private) mount -t tmpfs -o size=64m,mode=1777 client-shm /dev/shm ;;
            readonly) mount --bind "$2" /dev/shm && mount -o remount,bind,ro /dev/shm ;;
            host) : ;;
        esac || exit 9
        exec env -i PATH="$PATH" HOME=/root CUDA_MPS_PIPE_DIRECTORY="$3" python3 - "$4" "$5"
    ' client "$mode" "$shm" "$pipe" "$name" "$hold" <<'PY' 2>>"$log" | tail -n 1
import os, sys, time
name, hold = sys.argv[1], float(sys.argv[2])
def shm():
    rows = []
    for f in sorted(os.listdir("/dev/shm")):
        s = os.stat(os.path.join("/dev/shm", f))
        rows.append(f"{f}:{s.st_size}B:{oct(s.st_mode & 0o7777)}:uid{s.st_uid}")
    return " ".join(rows) or "(empty)"
try:
    import torch
    x = torch.ones(1024, 1024, device="cuda")
    y = float((x @ x).sum().item())
    seen = shm()
    time.sleep(hold)
    print(f"{name}: RAN pid {os.getpid()} result {y:.0f}; /dev/shm while connected: {seen}")
except Exception as e:
    print(f"{name}: FAILED pid {os.getpid()}: {str(e).splitlines()[0][:200]}; /dev/shm: {shm()}")
PY
}
{
    echo "driver $("$smi" --query-gpu=driver_version --format=csv,noheader | head -n 1); compute mode $("$smi" -i 0 --query-gpu=compute_mode --format=csv,noheader)"
    echo "server: $(echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$pipe "$mpsctl" 2>&1 | tr '\n' ' ')"
    echo "daemon's /dev/shm before any client: $(ls -la "$shm" | tail -n +2 | tr -s ' ' | tr '\n' ';')"
    client "shared (the daemon's tmpfs)" shared 0
    client "private tmpfs" private 0
    client "host /dev/shm" host 0
    client "daemon's tmpfs read-only" readonly 0
    client "first of two shared" shared 20 &
    sleep 12
    client "second of two shared" shared 0
    wait
    # As in a container: its own PID and IPC namespaces besides the mount one.
    container=(-p -i -f --mount-proc)
    client "container-like, private tmpfs" private 0 "${container[@]}"
    client "container-like, the daemon's tmpfs" shared 0 "${container[@]}"
    client "container-like first, private tmpfs" private 20 "${container[@]}" &
    sleep 12
    client "container-like second, private tmpfs" private 0 "${container[@]}"
    wait
    echo "daemon's /dev/shm after the clients: $(ls -la "$shm" | tail -n +2 | tr -s ' ' | tr '\n' ';')"
    echo "daemon tmpfs use: $(df -k "$shm" | tail -n 1 | tr -s ' ')"
    echo "control.log tail: $(tail -n 12 "$root/$key/log/control.log" 2>&1 | tr '\n' '|')"
} | tee "$out/shm.txt"
cat "$root/$key/log/control.log" "$root/$key/log/server.log" >"$out/shm-mps.log" 2>/dev/null

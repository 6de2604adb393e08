#!/usr/bin/env bash
# GPU usage on a real GPU: what issue 32's sampler reads. Two CUDA processes run in cgroups named
# as the kubelet's systemd driver names a pod's container (cgroup v2), one computing, one holding
# memory and idle; `gpu_probe usage` samples every GPU with the sampler's own code (NVML's
# utilization, memory, processes with per-process SM figures, GPM on MIG instances) and
# attributes each process to its pod and container. Then the same with the computing process as
# an MPS client (does NVML count its work to it or to the MPS server?). Not in the README's test
# command.
#
#   tests/gpu/usage.sh OUT_DIR      (env: DRIVER_ROOT, PROBE as for validate.sh)
#
# Writes usage.json, usage-mps.json and summary.txt to OUT_DIR; needs python3 with torch.
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
DRIVER_ROOT=${DRIVER_ROOT:-/usr/local/nvidia}
PROBE=${PROBE:?prebuilt gpu_probe}
cg=/sys/fs/cgroup
busy_uid=0b3c2d1e-8f7a-4b6c-9d5e-1a2b3c4d5e6f
idle_uid=7c1d9e2f-3a4b-4c5d-8e6f-a0b1c2d3e4f5
busy_ctr=$(printf 'b%.0s' {1..64})
idle_ctr=$(printf 'd%.0s' {1..64})
# kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid, _ for ->.slice/
# cri-containerd-<id>.scope, as usage::cgroup reads it.
scope() { # uid container-id
    local pod="kubepods-besteffort-pod${1//-/_}.slice"
    echo "$cg/kubepods.slice/kubepods-besteffort.slice/$pod/cri-containerd-$2.scope"
}
attributed=yes
for s in "$(scope $busy_uid "$busy_ctr")" "$(scope $idle_uid "$idle_ctr")"; do
    mkdir -p "$s" 2>>"$out/usage.log" || attributed=no
done
[ "$attributed" = yes ] || echo "cgroup v2 not writable here: processes run outside any pod" >>"$out/usage.log"

# run CGROUP-SCOPE ROLE SECONDS [env...]: a CUDA process that joins the scope before CUDA starts.
run() {
    local s=$1 role=$2 secs=$3
    shift 3
    env "$@" sh -c '[ -w "$0/cgroup.procs" ] && echo $$ >"$0/cgroup.procs"; exec python3 - "$1" "$2"' \
        "$s" "$role" "$secs" <<'PY' 2>>"$out/usage.log" &
import sys, time, torch
role, secs = sys.argv[1], float(sys.argv[2])
held = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + secs
while time.time() < end:
    if role == "busy":
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    else:
        time.sleep(0.5)
PY
}

sample() { # OUT_FILE
    sleep 8 # CUDA contexts up, a few utilization samples taken
    "$PROBE" usage --driver-root "$DRIVER_ROOT" --rounds 4 --interval-ms 2000 >"$1" 2>>"$out/usage.log"
}

run "$(scope $busy_uid "$busy_ctr")" busy 30
run "$(scope $idle_uid "$idle_ctr")" idle 30
sample "$out/usage.json"
wait

# The computing process as an MPS client of a daemon the plugin's code starts.
root=$(mktemp -d /tmp/drust-usage-mps.XXXXXX)
uid=5e2a7c1d-9b3f-4d6e-8a0c-1f2e3d4c5b6a
if "$PROBE" mps-start --driver-root "$DRIVER_ROOT" --mps-root "$root" --uid "$uid" \
    >>"$out/usage.log" 2>&1; then
    run "$(scope $busy_uid "$busy_ctr")" busy 30 \
        CUDA_MPS_PIPE_DIRECTORY="$root/$uid/pipe" CUDA_MPS_LOG_DIRECTORY="$root/$uid/log"
    sample "$out/usage-mps.json"
    wait
    "$PROBE" mps-stop --driver-root "$DRIVER_ROOT" --mps-root "$root" --uid "$uid" >>"$out/usage.log" 2>&1
else
    echo "mps-start failed: no MPS sample" >>"$out/usage.log"
fi
rm -rf "$root"
for s in "$(scope $busy_uid "$busy_ctr")" "$(scope $idle_uid "$idle_ctr")"; do
    rmdir "$s" "${s%/*}" 2>/dev/null
done
rmdir "$cg/kubepods.slice/kubepods-besteffort.slice" "$cg/kubepods.slice" 2>/dev/null

# One line per process seen: its GPU, SM figures, memory, and the pod it was attributed to.
python3 - "$out" "$busy_uid" "$idle_uid" <<'PY' | tee "$out/summary.txt"
import json, os, sys
out, busy, idle = sys.argv[1:4]
names = {busy: "busy pod", idle: "idle pod"}
for f in ("usage.json", "usage-mps.json"):
    path = os.path.join(out, f)
    if not os.path.exists(path):
        print(f"{f}: missing"); continue
    d = json.load(open(path))
    last = d["rounds"][-1]
    print(f"{f}: {len(d['rounds'])} rounds, last {last['micros']} us; RSS {d['rssKibBefore']} -> {d['rssKibAfter']} KiB")
    for gpu, s in sorted(last["gpus"].items()):
        if "error" in s:
            print(f"  GPU {gpu}: error {s['error']}"); continue
        u = s["usage"]
        for p in u["processes"]:
            pod = s["pods"].get(str(p["pid"]), {})
            who = names.get(pod.get("podUid"), "outside any pod")
            print(f"  GPU {gpu} (SM {u['smPercent']}%): pid {p['pid']} SM {p['smPercent']}% "
                  f"{(p['usedMemoryBytes'] or 0) >> 20} MiB, {who} {pod.get('containerId', '')[:12]}")
        for m in u["mig"]:
            print(f"  GPU {gpu} MIG instance {m['gpuInstanceId']}: SM {m['smPercent']}%, memory {m['memoryPercent']}%")
PY

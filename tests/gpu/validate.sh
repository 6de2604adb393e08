#!/usr/bin/env bash
# Runs the node plugin's real NVML path on a machine with an NVIDIA GPU and driver, and checks
# what it would publish against nvidia-smi. Not part of the README's test command (CI has no GPU).
#
#   tests/gpu/validate.sh [OUT_DIR]        (default: gpu-validation/)
#
# Environment:
#   DRIVER_ROOT  root of the driver installation (default: /usr/local/nvidia if it holds
#                nvidia-smi, else /)
#   PLUGIN, PROBE  prebuilt gpu-kubelet-plugin and gpu_probe example (default: built here with
#                `cargo build --release`, only these two)
#   ALLOW_MIG=1  also create and destroy one MIG device on a GPU whose MIG mode is already on
#                (never changes the MIG mode itself)
#   SKIP_MPS=1   do not start an MPS control daemon
#
# OUT_DIR receives: nvidia-smi-q.xml, nvidia-smi-query.csv, slices.json,
# slices-partitionable.json, probe.json, torch.json, mps.log, mig.json, report.json and
# summary.txt. Exit status: 0 when every check agrees, 1 otherwise.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:-gpu-validation}
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary="$out/summary.txt"
: >"$summary"
failed=0
say() { echo "$*" | tee -a "$summary"; }
fail() { say "FAIL: $*"; failed=1; }

if [ -z "${DRIVER_ROOT:-}" ]; then
    DRIVER_ROOT=/
    [ -x /usr/local/nvidia/bin/nvidia-smi ] && DRIVER_ROOT=/usr/local/nvidia
fi
smi=$(command -v nvidia-smi || echo "$DRIVER_ROOT/bin/nvidia-smi")
mpsctl=$(command -v nvidia-cuda-mps-control || echo "$DRIVER_ROOT/bin/nvidia-cuda-mps-control")
if [ -z "${PLUGIN:-}" ] || [ -z "${PROBE:-}" ]; then
    (cd "$repo" && cargo build --release -p gpu-kubelet-plugin --bin gpu-kubelet-plugin --example gpu_probe) || exit 1
    PLUGIN=${PLUGIN:-$repo/target/release/gpu-kubelet-plugin}
    PROBE=${PROBE:-$repo/target/release/examples/gpu_probe}
fi
say "driver root: $DRIVER_ROOT; nvidia-smi: $smi; MPS control: $mpsctl"
say "date: $(date -u +%FT%TZ); kernel: $(uname -r)"

"$smi" -q -x >"$out/nvidia-smi-q.xml" || fail "nvidia-smi -q -x"
"$smi" --query-gpu=uuid,compute_cap --format=csv,noheader >"$out/nvidia-smi-query.csv" || fail "nvidia-smi --query-gpu"
"$smi" -L | tee -a "$summary"

# Discovery exactly as the DaemonSet runs it, in both MIG strategies.
"$PLUGIN" --dry-run -o json --node-name gpu-validation --driver-root "$DRIVER_ROOT" \
    >"$out/slices.json" 2>"$out/plugin.log" || fail "plugin --dry-run (see plugin.log)"
"$PLUGIN" --dry-run -o json --node-name gpu-validation --driver-root "$DRIVER_ROOT" \
    --mig-strategy partitionable >"$out/slices-partitionable.json" 2>>"$out/plugin.log" ||
    fail "plugin --dry-run --mig-strategy partitionable"
# The backend's raw answers, the light per-prepare query, one health-event wait, driver files.
"$PROBE" nvml --driver-root "$DRIVER_ROOT" >"$out/probe.json" 2>>"$out/plugin.log" || fail "gpu_probe nvml"

# Multiprocessor counts as CUDA itself reports them (NVML's are what we publish).
if python3 -c 'import torch' 2>/dev/null; then
    python3 - >"$out/torch.json" <<'PY' || fail "torch device query"
import json, torch
out = []
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    out.append({"uuid": "GPU-" + str(p.uuid), "name": p.name, "multiprocessors": p.multi_processor_count})
print(json.dumps(out))
PY
fi

python3 "$here/validate.py" "$out" | tee -a "$summary"
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "published attributes differ from nvidia-smi"

# MPS: the plugin's own start (limits as a claim sets them), a CUDA client through the daemon,
# the plugin's own stop.
if [ "${SKIP_MPS:-0}" != 1 ] && [ -x "$mpsctl" ]; then
    mps_root=$(mktemp -d /tmp/drust-mps.XXXXXX)
    uid=4d7a2b5e-9c1f-4e0a-8b3d-2f6e1a7c9d10
    if "$PROBE" mps-start --driver-root "$DRIVER_ROOT" --mps-root "$mps_root" --uid "$uid" \
        --threads 50 --pinned-mib 4096 >"$out/mps-start.json" 2>>"$out/plugin.log"; then
        pipe="$mps_root/$uid/pipe"
        CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY="$mps_root/$uid/log" python3 - \
            >"$out/mps-client.txt" 2>&1 <<'PY' || fail "CUDA client through the MPS daemon"
import torch
x = torch.ones(1 << 20, device="cuda")
print("client ran on", torch.cuda.get_device_name(0), "sum", float(x.sum()))
try:
    torch.empty(6 << 30, dtype=torch.uint8, device="cuda")
    print("6 GiB allocation: allowed (pinned limit NOT enforced)")
except RuntimeError as e:
    print("6 GiB allocation refused under the 4 GiB pinned limit:", str(e).splitlines()[0])
PY
        cat "$out/mps-client.txt" | tee -a "$summary"
        echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$pipe "$mpsctl" >>"$out/mps-client.txt" 2>&1
        # The logs live in the directory the stop removes.
        cat "$mps_root/$uid/log/control.log" "$mps_root/$uid/log/server.log" >"$out/mps.log" 2>/dev/null
        "$PROBE" mps-stop --driver-root "$DRIVER_ROOT" --mps-root "$mps_root" --uid "$uid" \
            >"$out/mps-stop.json" 2>>"$out/plugin.log" || fail "gpu_probe mps-stop"
        [ -d "$mps_root/$uid" ] && fail "MPS directories left behind"
    else
        fail "gpu_probe mps-start (see plugin.log)"
    fi
    rm -rf "$mps_root"
else
    say "MPS: skipped (SKIP_MPS=1 or no nvidia-cuda-mps-control)"
fi

if [ "${ALLOW_MIG:-0}" = 1 ]; then
    "$PROBE" mig --driver-root "$DRIVER_ROOT" >"$out/mig.json" 2>>"$out/plugin.log" || fail "gpu_probe mig"
    cat "$out/mig.json" | tee -a "$summary"
else
    say "MIG create/destroy: skipped (set ALLOW_MIG=1 on a GPU whose MIG mode is on)"
fi

[ "$failed" = 0 ] && say "RESULT: all checks passed" || say "RESULT: some checks failed"
exit "$failed"

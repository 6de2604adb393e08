#!/usr/bin/env bash
# What a GPU host answers about NVLink fabrics and IMEX (issue 43), captured as a fixture: the
# raw return code and fields of every NVML fabric call (`nvmlDeviceGetGpuFabricInfo` v1 and
# `nvmlDeviceGetGpuFabricInfoV` with struct versions 2 and 3, through ctypes so nothing of
# drust's stands between the driver and the record), nvidia-smi's fabric section, the
# "Character devices" of /proc/devices (the IMEX channels' major), the driver's IMEX module
# parameters, the channel device nodes and IMEX tools present, and what opening a channel node
# made with that major does on a host without an IMEX daemon. Changes nothing on the host: the
# node is made in a temporary directory and removed. Not in the README's test command.
#
#   tests/gpu/fabric.sh OUT_DIR
#
# Writes fabric.txt (the record) and fabric.json (the NVML answers) to OUT_DIR.
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
txt=$out/fabric.txt
: >"$txt"
section() { printf '\n## %s\n' "$1" >>"$txt"; }

section "driver"
nvidia-smi --query-gpu=index,name,driver_version,pci.bus_id --format=csv,noheader >>"$txt" 2>&1
section "nvidia-smi -q: Fabric"
nvidia-smi -q | sed -n '/^ *Fabric/,/^ *[A-Z][a-z]* [A-Z]/p' | head -n 40 >>"$txt" 2>&1

section "NVML fabric calls (fabric.json)"
python3 - "$out/fabric.json" <<'PY' >>"$txt" 2>&1
import ctypes, json, sys
nvml = ctypes.CDLL("libnvidia-ml.so.1")
nvml.nvmlErrorString.restype = ctypes.c_char_p
def err(rc): return f"{rc} {nvml.nvmlErrorString(rc).decode()}"
class V1(ctypes.Structure):
    _fields_ = [("clusterUuid", ctypes.c_ubyte * 16), ("status", ctypes.c_int),
                ("cliqueId", ctypes.c_uint), ("state", ctypes.c_ubyte)]
class V2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_ubyte * 16),
                ("status", ctypes.c_int), ("cliqueId", ctypes.c_uint), ("state", ctypes.c_ubyte),
                ("healthMask", ctypes.c_uint)]
class V3(ctypes.Structure):
    _fields_ = V2._fields_ + [("healthSummary", ctypes.c_ubyte)]
def fields(s):
    d = {k: (bytes(getattr(s, k)).hex() if k == "clusterUuid" else getattr(s, k)) for k, _ in s._fields_}
    if "healthMask" in d: d["healthMask"] = hex(d["healthMask"])
    return d
print("nvmlInit_v2:", err(nvml.nvmlInit_v2()))
n = ctypes.c_uint()
nvml.nvmlDeviceGetCount_v2(ctypes.byref(n))
symbols = {s: hasattr(nvml, s) for s in ["nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetGpuFabricInfo_v4"]}
print("symbols:", symbols)
record = {"symbols": symbols, "gpus": []}
for i in range(n.value):
    dev = ctypes.c_void_p()
    nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(dev))
    gpu = {"index": i}
    s = V1()
    rc = nvml.nvmlDeviceGetGpuFabricInfo(dev, ctypes.byref(s))
    gpu["v1"] = {"return": err(rc), **(fields(s) if rc == 0 else {})}
    for name, cls, ver in (("v2", V2, 2), ("v3", V3, 3)):
        s = cls()
        s.version = ctypes.sizeof(cls) | (ver << 24)
        rc = nvml.nvmlDeviceGetGpuFabricInfoV(dev, ctypes.byref(s))
        gpu[name] = {"structSize": ctypes.sizeof(cls), "return": err(rc), **(fields(s) if rc == 0 else {})}
    # A wrong version tag: what drust must expect from a driver older than its struct.
    s = V3(); s.version = ctypes.sizeof(V3) | (9 << 24)
    gpu["v9Tag"] = {"return": err(nvml.nvmlDeviceGetGpuFabricInfoV(dev, ctypes.byref(s)))}
    record["gpus"].append(gpu)
    print(json.dumps(gpu))
json.dump(record, open(sys.argv[1], "w"), indent=1)
nvml.nvmlShutdown()
PY

section "/proc/devices (Character devices)"
sed -n '/Character devices/,/^$/p' /proc/devices >>"$txt"
major=$(awk '$2 == "nvidia-caps-imex-channels" {print $1}' /proc/devices)
echo "nvidia-caps-imex-channels major: ${major:-absent}" >>"$txt"

section "driver parameters naming IMEX or caps"
grep -i -E 'imex|caps' /proc/driver/nvidia/params >>"$txt" 2>&1 || echo "(none)" >>"$txt"
modinfo -p nvidia 2>/dev/null | grep -i -E 'imex|caps' >>"$txt" || echo "(modinfo: none or unavailable)" >>"$txt"

section "device nodes"
ls -la /dev/nvidia-caps /dev/nvidia-caps-imex-channels >>"$txt" 2>&1
ls -la /dev/nvidia* >>"$txt" 2>&1

section "IMEX tools"
for t in nvidia-imex nvidia-imex-ctl; do echo "$t: $(command -v $t || echo absent)"; done >>"$txt"
ls -la /etc/nvidia-imex 2>&1 | head -n 20 >>"$txt"
command -v systemctl >/dev/null && { systemctl is-active nvidia-imex >>"$txt" 2>&1 || true; }

section "opening channel 0 made with that major (no IMEX daemon)"
if [ -n "$major" ]; then
    tmp=$(mktemp -d)
    mknod -m 666 "$tmp/channel0" c "$major" 0 && python3 - "$tmp/channel0" <<'PY' >>"$txt" 2>&1
import os, sys
try:
    fd = os.open(sys.argv[1], os.O_RDWR); print("open O_RDWR: ok"); os.close(fd)
except OSError as e:
    print(f"open O_RDWR: {e}")
PY
    rm -rf "$tmp"
else
    echo "skipped: no major" >>"$txt"
fi
cat "$txt"

#!/usr/bin/env python3
"""Checks the ResourceSlices the plugin publishes through NVML against what nvidia-smi reports.

usage: validate.py OUT_DIR

OUT_DIR holds what tests/gpu/validate.sh captured: nvidia-smi-q.xml (`nvidia-smi -q -x`),
nvidia-smi-query.csv (`--query-gpu`, for the compute capability that -q does not print),
slices.json (`gpu-kubelet-plugin --dry-run -o json`), and optionally torch.json (multiprocessor
counts as CUDA reports them). Prints one line per checked attribute and writes report.json;
exits 1 when any value differs, 2 when the input is unusable.
"""
import json
import os
import sys
import xml.etree.ElementTree as ET


def semver(text):
    """NVIDIA's '580.159.04' or '13.0' as the version attribute's canonical 'X.Y.Z'."""
    parts = [str(int(p)) for p in text.strip().split(".")]
    while len(parts) < 3:
        parts.append("0")
    return ".".join(parts[:3])


def attr(device, name):
    value = device.get("attributes", {}).get(name)
    if value is None:
        return None
    (kind, v), = value.items()
    return v


def main():
    out = sys.argv[1]
    try:
        root = ET.parse(os.path.join(out, "nvidia-smi-q.xml")).getroot()
        slices = json.load(open(os.path.join(out, "slices.json")))
    except (OSError, ValueError, ET.ParseError) as e:
        print(f"unusable input: {e}")
        return 2
    csv = {}
    try:
        for line in open(os.path.join(out, "nvidia-smi-query.csv")):
            uuid, cap = [f.strip() for f in line.split(",")][:2]
            csv[uuid] = cap
    except OSError:
        pass
    torch = {}
    try:
        torch = {d["uuid"]: d for d in json.load(open(os.path.join(out, "torch.json")))}
    except (OSError, ValueError):
        pass

    devices = [d for s in slices for d in s["spec"].get("devices", [])]
    by_uuid = {attr(d, "uuid"): d for d in devices if attr(d, "type") == "gpu"}
    driver = semver(root.findtext("driver_version"))
    cuda = semver(root.findtext("cuda_version"))
    checks = []

    def check(gpu, name, ours, theirs):
        checks.append({"gpu": gpu, "attribute": name, "published": ours, "nvidiaSmi": theirs,
                       "agrees": ours == theirs})

    gpus = root.findall("gpu")
    check("node", "gpu count", len(by_uuid), len(gpus))
    for gpu in gpus:
        uuid = gpu.findtext("uuid")
        device = by_uuid.get(uuid)
        if device is None:
            check(uuid, "published", False, True)
            continue
        name = device["name"]
        bus = gpu.findtext("pci/pci_bus_id")  # 00000000:18:00.0
        domain, rest = bus.split(":", 1)
        check(name, "uuid", attr(device, "uuid"), uuid)
        check(name, "productName", attr(device, "productName"), gpu.findtext("product_name"))
        check(name, "brand", (attr(device, "brand") or "").lower(),
              gpu.findtext("product_brand").lower())
        check(name, "architecture", attr(device, "architecture"),
              gpu.findtext("product_architecture"))
        check(name, "driverVersion", attr(device, "driverVersion"), driver)
        check(name, "cudaDriverVersion", attr(device, "cudaDriverVersion"), cuda)
        check(name, "minor", attr(device, "minor"), int(gpu.findtext("minor_number")))
        check(name, "resource.kubernetes.io/pciBusID", attr(device, "resource.kubernetes.io/pciBusID"),
              f"{domain[-4:]}:{rest}".lower())
        # What CUDA can allocate: the framebuffer less the driver's reserve.
        total = int(gpu.findtext("fb_memory_usage/total").replace(" MiB", ""))  # 81559
        reserved = int((gpu.findtext("fb_memory_usage/reserved") or "0 MiB").replace(" MiB", ""))
        check(name, "capacity memory", device.get("capacity", {}).get("memory", {}).get("value"),
              f"{total - reserved}Mi")
        if uuid in csv:
            check(name, "cudaComputeCapability", attr(device, "cudaComputeCapability"),
                  semver(csv[uuid]))
        numa_file = f"/sys/bus/pci/devices/{f'{domain[-4:]}:{rest}'.lower()}/numa_node"
        numa = gpu.findtext("numa_id")
        if numa is None and os.path.exists(numa_file):
            numa = open(numa_file).read().strip()
        if numa is not None and numa.strip().lstrip("-").isdigit():
            expected = int(numa) if int(numa) >= 0 else None
            check(name, "resource.kubernetes.io/numaNode",
                  attr(device, "resource.kubernetes.io/numaNode"), expected)
        if uuid in torch:
            check(name, "capacity multiprocessors",
                  device.get("capacity", {}).get("multiprocessors", {}).get("value"),
                  str(torch[uuid]["multiprocessors"]))
        mig = (gpu.findtext("mig_mode/current_mig") or "N/A").strip()
        published_mig = [d for d in devices if attr(d, "type") == "mig"
                         and attr(d, "parentUUID") == uuid]
        if mig == "Enabled":
            listed = gpu.findall("mig_devices/mig_device")
            check(name, "MIG devices", len(published_mig), len(listed))
        else:
            check(name, "MIG devices (MIG mode " + mig + ")", len(published_mig), 0)

    for c in checks:
        mark = "ok  " if c["agrees"] else "DIFF"
        print(f"{mark} {c['gpu']:<22} {c['attribute']:<36} published={c['published']!r} "
              f"nvidia-smi={c['nvidiaSmi']!r}")
    json.dump(checks, open(os.path.join(out, "report.json"), "w"), indent=1)
    bad = [c for c in checks if not c["agrees"]]
    print(f"{len(checks) - len(bad)} of {len(checks)} checks agree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

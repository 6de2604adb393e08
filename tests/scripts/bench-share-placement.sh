#!/usr/bin/env bash
# Fractional GPUs, placement: how many pods of one workload fit on one fake 8-GPU node (the DGX
# H100 of examples/topologies) with shares (`--consumable-capacity`) and with whole GPUs, as the
# scheduler's allocator places them (`dractl simulate`, whose allocator is checked against
# upstream's in crates/dractl/tests/allocate_differential.rs).
#
# Usage: tests/scripts/bench-share-placement.sh [topology]   (builds the two binaries first)
set -euo pipefail
cd "$(dirname "$0")/../.."
topology=${1:-examples/topologies/dgx-h100.yaml}
cargo build -q --release -p gpu-kubelet-plugin -p dractl
plugin=target/release/gpu-kubelet-plugin
dractl=target/release/dractl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for shares in true false; do
  # Any executable stands for the MPS tool: the plugin only looks for it.
  "$plugin" --dry-run --fake-topology "$topology" --node-name node-0 \
    --consumable-capacity="$shares" --mps-control-binary /bin/sh > "$work/slices-$shares.yaml" \
    2>> "$work/plugin.log"
done
{
  printf 'apiVersion: v1\nkind: Node\nmetadata: {name: node-0}\n---\n'
  cat deploy/deviceclasses/gpu.yaml
  printf -- '---\n'
  cat deploy/deviceclasses/gpu-share.yaml
} > "$work/cluster.yaml"

template() { # name class capacity-requests
  cat <<YAML
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: $1, namespace: default}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: $2
$( [[ -n "$3" ]] && printf '            capacity: {requests: %s}\n' "$3" )
YAML
}

fits() { # slices template
  "$dractl" simulate -f "$work/cluster.yaml" -f "$work/$1" --claim-template "$work/$2" \
    | sed -n 's/^\([0-9]*\) more pods fit.*/\1/p'
}

echo "| workload | whole GPUs: pods per node | shares: pods per node |"
echo "|---|---|---|"
for w in "10 GiB|{memory: 10Gi}" "20 GB|{memory: 20G}" "10 GiB + 25% compute|{memory: 10Gi, computePercent: \"25\"}"; do
  name=${w%%|*}
  template whole gpu.drust.dev "" > "$work/whole.yaml"
  template share gpu-share.drust.dev "${w#*|}" > "$work/share.yaml"
  echo "| $name | $(fits slices-false.yaml whole.yaml) | $(fits slices-true.yaml share.yaml) |"
done

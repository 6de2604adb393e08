package main

import (
	"bytes"
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources"
)

func testdata(names ...string) []string {
	paths := make([]string, len(names))
	for i, name := range names {
		paths[i] = filepath.Join("testdata", name)
	}
	return paths
}

func load(t *testing.T, names ...string) *input {
	t.Helper()
	in, err := loadFiles(testdata(names...))
	if err != nil {
		t.Fatalf("loading %v: %v", names, err)
	}
	return in
}

func runDefault(t *testing.T, in *input) *output {
	t.Helper()
	out, err := run(context.Background(), in, options{filterTimeout: 10 * time.Second})
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	return out
}

// outcome is a compact view of one node's result: "alloc:claim=dev,dev;claim=dev", "nofit:REASON"
// or "error:MESSAGE".
func outcome(r nodeResult) string {
	switch {
	case r.Error != "":
		return "error:" + r.Error
	case r.Allocated != nil && !*r.Allocated:
		return "nofit:" + r.Reason
	case r.Allocated != nil && *r.Allocated && r.Claims != nil:
		var parts []string
		for _, c := range *r.Claims {
			var devices []string
			for _, d := range c.Allocation.Devices.Results {
				devices = append(devices, d.Request+"="+d.Device)
			}
			parts = append(parts, c.Name+":"+strings.Join(devices, ","))
		}
		return "alloc:" + strings.Join(parts, ";")
	}
	return "malformed"
}

func expectOutcomes(t *testing.T, out *output, want map[string]string) {
	t.Helper()
	if len(out.Nodes) != len(want) {
		t.Errorf("got %d nodes, want %d: %+v", len(out.Nodes), len(want), out.Nodes)
	}
	for _, n := range out.Nodes {
		got := outcome(n)
		if w, ok := want[n.Name]; !ok {
			t.Errorf("unexpected node %s: %s", n.Name, got)
		} else if got != w {
			t.Errorf("node %s: got %q, want %q", n.Name, got, w)
		}
	}
}

func TestFeatures(t *testing.T) {
	fts := schedulerFeatures()
	got := dynamicresources.AllocatorFeatures(fts)
	// kube-scheduler v1.36 default feature gates.
	want := structured.Features{
		AdminAccess:            true,
		PrioritizedList:        true,
		PartitionableDevices:   true,
		DeviceTaints:           true,
		DeviceBindingAndStatus: true,
		ConsumableCapacity:     true,
	}
	if got != want {
		t.Errorf("allocator features: got %+v, want %+v", got, want)
	}
	if !fts.EnableDRASchedulerFilterTimeout {
		t.Error("DRASchedulerFilterTimeout should be on by default")
	}
	if fts.EnableDRAListTypeAttributes || fts.EnableDRANodeAllocatableResources || fts.EnableDRAWorkloadResourceClaims {
		t.Errorf("alpha/off-by-default gates on: %+v", fts)
	}
}

func TestDefaultsApplied(t *testing.T) {
	in := load(t, "gpus.yaml", "claim-h100.yaml")
	if len(in.nodes) != 2 || len(in.classes) != 1 || len(in.slices) != 1 || len(in.claims) != 1 {
		t.Fatalf("unexpected input: %d nodes, %d classes, %d slices, %d claims", len(in.nodes), len(in.classes), len(in.slices), len(in.claims))
	}
	exactly := in.claims[0].Spec.Devices.Requests[0].Exactly
	if exactly.AllocationMode != resourceapi.DeviceAllocationModeExactCount || exactly.Count != 1 {
		t.Errorf("request not defaulted: mode %q count %d", exactly.AllocationMode, exactly.Count)
	}
}

func TestSelectorPicksDevice(t *testing.T) {
	out := runDefault(t, load(t, "gpus.yaml", "claim-h100.yaml"))
	expectOutcomes(t, out, map[string]string{
		"node-1": "alloc:h100:gpu=gpu-1",
		"node-2": "nofit:cannot allocate all claims",
	})
	alloc := (*out.Nodes[0].Claims)[0].Allocation
	if alloc.NodeSelector == nil || alloc.NodeSelector.NodeSelectorTerms[0].MatchFields[0].Values[0] != "node-1" {
		t.Errorf("node selector: %+v", alloc.NodeSelector)
	}
}

func TestOnlyNode(t *testing.T) {
	out, err := run(context.Background(), load(t, "gpus.yaml", "claim-h100.yaml"), options{node: "node-2"})
	if err != nil {
		t.Fatal(err)
	}
	expectOutcomes(t, out, map[string]string{"node-2": "nofit:cannot allocate all claims"})
	if _, err := run(context.Background(), load(t, "gpus.yaml"), options{node: "nosuch"}); err == nil {
		t.Error("unknown --node accepted")
	}
}

func TestDoesNotFit(t *testing.T) {
	expectOutcomes(t, runDefault(t, load(t, "gpus.yaml", "claim-three.yaml")), map[string]string{
		"node-1": "nofit:cannot allocate all claims",
		"node-2": "nofit:cannot allocate all claims",
	})
}

// The scheduler checks classes in PreFilter: a missing class makes the pod unschedulable
// everywhere, before the allocator runs.
func TestUnknownClass(t *testing.T) {
	reason := "nofit:request gpu: device class missing.example.com does not exist"
	expectOutcomes(t, runDefault(t, load(t, "gpus.yaml", "claim-unknown-class.yaml")), map[string]string{
		"node-1": reason,
		"node-2": reason,
	})
}

func TestCELRuntimeError(t *testing.T) {
	expectOutcomes(t, runDefault(t, load(t, "gpus.yaml", "claim-cel-error.yaml")), map[string]string{
		"node-1": "error:claim default/cel-error: selector #0: CEL runtime error: no such key: nosuch",
		// No device on node-2, so no selector is evaluated there.
		"node-2": "nofit:cannot allocate all claims",
	})
}

func TestInUseDeviceSkipped(t *testing.T) {
	in := load(t, "gpus.yaml", "in-use.json")
	expectOutcomes(t, runDefault(t, in), map[string]string{
		"node-1": "alloc:any-gpu:gpu=gpu-1",
		"node-2": "nofit:cannot allocate all claims",
	})
	// Control: without the allocated claim, the first device is picked.
	in.claims = in.claims[1:]
	expectOutcomes(t, runDefault(t, in), map[string]string{
		"node-1": "alloc:any-gpu:gpu=gpu-0",
		"node-2": "nofit:cannot allocate all claims",
	})
}

func TestFirstAvailable(t *testing.T) {
	expectOutcomes(t, runDefault(t, load(t, "gpus.yaml", "claim-first-available.yaml")), map[string]string{
		"node-1": "alloc:first-available:gpu/any=gpu-0",
		"node-2": "nofit:cannot allocate all claims",
	})
}

func TestPartitionable(t *testing.T) {
	expectOutcomes(t, runDefault(t, load(t, "partitionable.yaml", "claim-any-partition.yaml")), map[string]string{
		"node-1": "alloc:any-partition:gpu=gpu-0-half-1",
	})
	in := load(t, "partitionable.yaml", "claim-whole.yaml")
	expectOutcomes(t, runDefault(t, in), map[string]string{
		"node-1": "nofit:cannot allocate all claims",
	})
	// Control: with the half released, the whole GPU fits.
	in.claims = in.claims[1:]
	expectOutcomes(t, runDefault(t, in), map[string]string{
		"node-1": "alloc:whole:gpu=gpu-0",
	})
}

func TestConsumableCapacity(t *testing.T) {
	out := runDefault(t, load(t, "consumable.yaml"))
	expectOutcomes(t, out, map[string]string{"node-1": "alloc:twenty:mem=gpu-1"})
	result := (*out.Nodes[0].Claims)[0].Allocation.Devices.Results[0]
	if result.ShareID == nil {
		t.Error("no shareID")
	}
	if q := result.ConsumedCapacity["memory"]; q.String() != "20Gi" {
		t.Errorf("consumed capacity %v", result.ConsumedCapacity)
	}
}

func TestTimeout(t *testing.T) {
	in := load(t, "gpus.yaml", "claim-h100.yaml")
	out, err := run(context.Background(), in, options{node: "node-1", filterTimeout: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	expectOutcomes(t, out, map[string]string{"node-1": "error:node node-1: timed out trying to allocate devices"})
}

func TestNoClaims(t *testing.T) {
	expectOutcomes(t, runDefault(t, load(t, "gpus.yaml")), map[string]string{
		"node-1": "alloc:",
		"node-2": "alloc:",
	})
}

func TestCommandLine(t *testing.T) {
	var stdout, stderr bytes.Buffer
	args := []string{"-f", filepath.Join("testdata", "gpus.yaml"), "-f", filepath.Join("testdata", "claim-h100.yaml"), "--node", "node-1"}
	if rc := mainWithArgs(args, &stdout, &stderr); rc != 0 {
		t.Fatalf("exit %d, stderr: %s", rc, stderr.String())
	}
	var got struct {
		Nodes []struct {
			Name      string `json:"name"`
			Allocated bool   `json:"allocated"`
			Claims    []struct {
				Namespace  string                       `json:"namespace"`
				Name       string                       `json:"name"`
				Allocation resourceapi.AllocationResult `json:"allocation"`
			} `json:"claims"`
		} `json:"nodes"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &got); err != nil {
		t.Fatalf("output %q: %v", stdout.String(), err)
	}
	if len(got.Nodes) != 1 || !got.Nodes[0].Allocated || len(got.Nodes[0].Claims) != 1 ||
		got.Nodes[0].Claims[0].Namespace != "default" || got.Nodes[0].Claims[0].Allocation.Devices.Results[0].Device != "gpu-1" {
		t.Errorf("output: %s", stdout.String())
	}
}

func TestInvalidInput(t *testing.T) {
	for name, want := range map[string]string{
		"invalid-slice.yaml": `invalid-slice.yaml: document 0 (ResourceSlice "bad"): invalid: spec: Invalid value: "": only one of ` + "`sharedCounters` or `devices`",
		"unknown-field.yaml": `unknown-field.yaml: document 0 (ResourceClaim default/typo): strict decoding error: unknown field "spec.devices.requests[0].exactly.deviceClasName"`,
	} {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			rc := mainWithArgs([]string{"-f", filepath.Join("testdata", name)}, &stdout, &stderr)
			if rc != 2 {
				t.Errorf("exit %d, want 2", rc)
			}
			if stdout.Len() != 0 {
				t.Errorf("stdout: %s", stdout.String())
			}
			if !strings.Contains(stderr.String(), want) {
				t.Errorf("stderr %q does not contain %q", stderr.String(), want)
			}
		})
	}
}

func TestDuplicateObject(t *testing.T) {
	_, err := loadFiles(testdata("gpus.yaml", "gpus.yaml"))
	if err == nil || !strings.Contains(err.Error(), "duplicate object") {
		t.Errorf("got %v, want a duplicate object error", err)
	}
}

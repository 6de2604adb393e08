// NVLink fabric answers per node (what go-nvml's mock cannot give: its GetGpuFabricInfoV
// handler calls the real C symbol, so v2 and v3 can only be faked at the C level).
//
// DRUST_MOCK_NVML_FABRIC names a JSON file, read at every call so that a test rewrites it while
// the plugin runs (Fabric Manager finishing a registration, re-partitioning, a link going down);
// DRUST_MOCK_NVML_NODE is the node this library plays. The file maps node names to GPU answers,
// "*" for every GPU of the node and "<index>" for one (its fields override "*"):
//
//	{"tray-0": {"*": {"state": "completed", "clusterUuid": "5b1f2c8e-4d3a-4f7e-9a61-0c2d8e7f3b94",
//	                  "cliqueId": 32766, "healthMask": 10922, "healthSummary": 1},
//	            "2": {"healthMask": 10913, "healthSummary": 3}},
//	 "tray-1": {"*": {"state": "inProgress"}}}
//
// Fields: state (notSupported, notStarted, inProgress, completed, or a number), status (the
// registration's nvmlReturn_t), clusterUuid (canonical or 32 hex digits; absent: zeros),
// cliqueId, healthMask, healthSummary (numbers, as nvml.h defines them), return (the call's own
// nvmlReturn_t, default 0) and maxVersion (the newest struct version nvmlDeviceGetGpuFabricInfoV
// accepts, default 3: a newer one is answered ARGUMENT_VERSION_MISMATCH (25), as driver 580
// answers a version tag of 9). nvmlDeviceGetGpuFabricInfo (v1) answers the same fields. A GPU
// without an entry, a node without one, or no file: NOT_SUPPORTED, as a GPU without a fabric.
package main

/*
// nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfo_v3_t (nvml.h).
typedef struct {
    unsigned char clusterUuid[16];
    int status;
    unsigned int cliqueId;
    unsigned char state;
} mockFabricV1;
typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    int status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
} mockFabricV2;
typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    int status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
    unsigned char healthSummary;
} mockFabricV3;
*/
import "C"

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"
)

const versionMismatch = C.int(nvmlErrorArgumentVersionMismatch)

// nvmlErrorArgumentVersionMismatch is NVML_ERROR_ARGUMENT_VERSION_MISMATCH.
const nvmlErrorArgumentVersionMismatch = 25

// fabricEntry is one GPU's answer in the fabric file; nil fields are not given.
type fabricEntry struct {
	State         json.RawMessage `json:"state"`
	Status        *int32          `json:"status"`
	ClusterUUID   *string         `json:"clusterUuid"`
	CliqueID      *uint32         `json:"cliqueId"`
	HealthMask    *uint32         `json:"healthMask"`
	HealthSummary *uint8          `json:"healthSummary"`
	Return        *int32          `json:"return"`
	MaxVersion    *uint32         `json:"maxVersion"`
}

// over returns e with the fields o gives replaced.
func (e fabricEntry) over(o fabricEntry) fabricEntry {
	if o.State != nil {
		e.State = o.State
	}
	if o.Status != nil {
		e.Status = o.Status
	}
	if o.ClusterUUID != nil {
		e.ClusterUUID = o.ClusterUUID
	}
	if o.CliqueID != nil {
		e.CliqueID = o.CliqueID
	}
	if o.HealthMask != nil {
		e.HealthMask = o.HealthMask
	}
	if o.HealthSummary != nil {
		e.HealthSummary = o.HealthSummary
	}
	if o.Return != nil {
		e.Return = o.Return
	}
	if o.MaxVersion != nil {
		e.MaxVersion = o.MaxVersion
	}
	return e
}

// fabricAnswer is what the fabric calls fill in.
type fabricAnswer struct {
	ret        C.int
	maxVersion uint32
	uuid       [16]byte
	status     int32
	clique     uint32
	state      uint8
	mask       uint32
	summary    uint8
}

// fabricOf reads GPU i's answer from the fabric file; ok false: no entry (NOT_SUPPORTED). An
// unreadable file or entry is reported on stderr and answered NOT_SUPPORTED.
func fabricOf(i int) (fabricAnswer, bool) {
	path, node := os.Getenv("DRUST_MOCK_NVML_FABRIC"), os.Getenv("DRUST_MOCK_NVML_NODE")
	if path == "" || i < 0 {
		return fabricAnswer{}, false
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return fabricAnswer{}, false
	}
	var file map[string]map[string]fabricEntry
	if err := json.Unmarshal(data, &file); err != nil {
		fmt.Fprintf(os.Stderr, "mocknvml: fabric file %s: %v\n", path, err)
		return fabricAnswer{}, false
	}
	gpus, ok := file[node]
	if !ok {
		return fabricAnswer{}, false
	}
	all, hasAll := gpus["*"]
	one, hasOne := gpus[strconv.Itoa(i)]
	if !hasAll && !hasOne {
		return fabricAnswer{}, false
	}
	e := all.over(one)
	a := fabricAnswer{maxVersion: 3}
	if e.Return != nil {
		a.ret = C.int(*e.Return)
	}
	if e.MaxVersion != nil {
		a.maxVersion = *e.MaxVersion
	}
	if e.Status != nil {
		a.status = *e.Status
	}
	if e.CliqueID != nil {
		a.clique = *e.CliqueID
	}
	if e.HealthMask != nil {
		a.mask = *e.HealthMask
	}
	if e.HealthSummary != nil {
		a.summary = *e.HealthSummary
	}
	if e.ClusterUUID != nil {
		raw, err := hex.DecodeString(strings.ReplaceAll(*e.ClusterUUID, "-", ""))
		if err != nil || len(raw) != 16 {
			fmt.Fprintf(os.Stderr, "mocknvml: fabric file %s: node %s GPU %d: clusterUuid %q is not 16 bytes of hex\n", path, node, i, *e.ClusterUUID)
			return fabricAnswer{}, false
		}
		copy(a.uuid[:], raw)
	}
	if e.State != nil {
		state, err := fabricState(e.State)
		if err != nil {
			fmt.Fprintf(os.Stderr, "mocknvml: fabric file %s: node %s GPU %d: %v\n", path, node, i, err)
			return fabricAnswer{}, false
		}
		a.state = state
	}
	return a, true
}

// fabricState reads a state by name (as gpu-inventory's topology files spell it) or number.
func fabricState(raw json.RawMessage) (uint8, error) {
	var n uint8
	if json.Unmarshal(raw, &n) == nil {
		return n, nil
	}
	var name string
	if err := json.Unmarshal(raw, &name); err != nil {
		return 0, fmt.Errorf("state %s is neither a name nor a number", raw)
	}
	switch name {
	case "notSupported":
		return 0, nil
	case "notStarted":
		return 1, nil
	case "inProgress":
		return 2, nil
	case "completed":
		return 3, nil
	}
	return 0, fmt.Errorf("unknown state %q", name)
}

// fabricCall answers for handle h: NOT_SUPPORTED without an entry, the entry's return code, or
// the answer to fill in.
func fabricCall(h unsafe.Pointer) (fabricAnswer, C.int) {
	if server == nil {
		return fabricAnswer{}, uninitialized
	}
	if _, ok := device(h); !ok {
		return fabricAnswer{}, invalidArgument
	}
	a, ok := fabricOf(index(h))
	if !ok {
		return fabricAnswer{}, notSupported
	}
	return a, a.ret
}

//export nvmlDeviceGetGpuFabricInfo
func nvmlDeviceGetGpuFabricInfo(h unsafe.Pointer, out *C.mockFabricV1) C.int {
	if out == nil {
		return invalidArgument
	}
	a, r := fabricCall(h)
	if r != success {
		return r
	}
	for k, b := range a.uuid {
		out.clusterUuid[k] = C.uchar(b)
	}
	out.status, out.cliqueId, out.state = C.int(a.status), C.uint(a.clique), C.uchar(a.state)
	return success
}

//export nvmlDeviceGetGpuFabricInfoV
func nvmlDeviceGetGpuFabricInfoV(h unsafe.Pointer, out unsafe.Pointer) C.int {
	if out == nil {
		return invalidArgument
	}
	a, r := fabricCall(h)
	if r != success {
		return r
	}
	// NVML_STRUCT_VERSION(GpuFabricInfo, v): the struct's size, the version in the top byte.
	tag := *(*C.uint)(out)
	version, size := uint32(tag>>24), uint32(tag&0xffffff)
	switch {
	case version == 2 && size == uint32(C.sizeof_mockFabricV2) && a.maxVersion >= 2:
		v2 := (*C.mockFabricV2)(out)
		for k, b := range a.uuid {
			v2.clusterUuid[k] = C.uchar(b)
		}
		v2.status, v2.cliqueId, v2.state = C.int(a.status), C.uint(a.clique), C.uchar(a.state)
		v2.healthMask = C.uint(a.mask)
	case version == 3 && size == uint32(C.sizeof_mockFabricV3) && a.maxVersion >= 3:
		v3 := (*C.mockFabricV3)(out)
		for k, b := range a.uuid {
			v3.clusterUuid[k] = C.uchar(b)
		}
		v3.status, v3.cliqueId, v3.state = C.int(a.status), C.uint(a.clique), C.uchar(a.state)
		v3.healthMask, v3.healthSummary = C.uint(a.mask), C.uchar(a.summary)
	default:
		return versionMismatch
	}
	return success
}

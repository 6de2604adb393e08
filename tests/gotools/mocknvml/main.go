// Command mocknvml is a libnvidia-ml.so.1 for tests: NVML's C entry points, answered by NVIDIA's
// own mock of NVML (github.com/NVIDIA/go-nvml, pkg/nvml/mock, its DGX A100 / H100 / H200 / B200
// servers). Built with -buildmode=c-shared; the node plugin's real NVML backend loads it by path
// (--nvml-library) and runs against it exactly as against the driver's library.
//
// DRUST_MOCK_NVML_MACHINE picks the machine: dgxa100, dgxh100 (default), dgxh200, dgxb200.
// DRUST_MOCK_NVML_EVENTS names a directory of health events to deliver (the mock has none):
// each file `<name>.json`, `{"gpu": <index>, "xid": <code>}` for an XID critical error or
// `{"gpu": <index>, "dbe": true}` for a double-bit ECC error, is taken (deleted) by the next
// nvmlEventSetWait_v2 of a set the GPU is registered with, in name order. A file
// `remap-pending-<index>` there makes nvmlDeviceGetRemappedRows of that GPU report rows waiting
// for a reset (what a GPU reports after an uncorrectable memory error until it is reset).
// The file's `mig`, `[{"gpuInstanceId": 9, "smPercent": 40, "memoryPercent": 5}]`, answers
// GPM (nvmlGpmMigSampleGet, nvmlGpmMetricsGet: SM_UTIL and DRAM_BW_UTIL of the instance as the
// later sample saw them) on a GPU in MIG mode of a Hopper or later machine (not dgxa100, which
// answers that GPM is unsupported, as an A100 does).
// DRUST_MOCK_NVML_MIG=1 enables MIG mode on every GPU at init (the mock's SetMigMode), as an
// administrator would before partitionable mode; no MIG device exists then.
// DRUST_MOCK_NVML_CALLS names a file to which every setting call is appended, one line each,
// so a test sees what reached NVML: `nvmlDeviceSetComputeMode <uuid> <mode>` (mode as NVML's
// nvmlComputeMode_t: 0 default, 2 prohibited, 3 exclusive process) and
// `nvmlDeviceSetMemoryLimits_v1 <uuid> <cgroup path> <soft bytes> <hard bytes>`.
// DRUST_MOCK_NVML_UUIDS=fixed gives GPU i the UUID GPU-00000000-0000-4000-8000-<i, 12 digits>
// instead of the mock's random ones, so that two processes name the same GPU.
// DRUST_MOCK_NVML_DRIVER_VERSION replaces the machine's driver version (e.g. 615.20.01, a
// branch with memory partitioning).
//
// DRUST_MOCK_NVML_USAGE names a directory of usage files, read at every call, so that a test
// sets what the GPUs are doing while the plugin runs: `<index>.json`, in the format of
// gpu-inventory's GpuUsage, `{"smPercent": 87, "memoryPercent": 20, "memoryUsedBytes": n,
// "processes": [{"pid": 1234, "usedMemoryBytes": n}]}`, answers nvmlDeviceGetUtilizationRates,
// the `used` of nvmlDeviceGetMemoryInfo_v2 and nvmlDeviceGetComputeRunningProcesses_v3 of GPU
// index (nvmlDeviceGetMPSComputeRunningProcesses_v3 lists none); without the file the GPU is
// idle (0 %, no memory used, no process). A process's `smPercent` answers
// nvmlDeviceGetProcessUtilization: one sample, stamped now, per process with a non-zero figure,
// NOT_FOUND when none has one, as the real library answers. A GPU in MIG mode answers
// NOT_SUPPORTED to both utilization queries, as a real one does.
// Where the mock has no answer for a call the backend makes, this bridge gives one and says so
// here (and in tests/gpu/README.md):
//   - PCI bus IDs: the mock's PciInfo carries only the device ID. The bridge gives GPU i the
//     bus 0x18 + 0x10*i in domain 0 (devices and functions 0), like the slots of a DGX.
//   - nvmlDeviceGetAttributes_v2 answers NOT_SUPPORTED for full GPUs, as the real library does
//     (tests/gpu/fixtures/h200-580.159.04); nvmlDeviceGetNumGpuCores, NUMA node and NVLink
//     queries answer NOT_SUPPORTED (the mock models none of them).
//   - NVLink fabric (nvmlDeviceGetGpuFabricInfo, nvmlDeviceGetGpuFabricInfoV with struct
//     versions 2 and 3): NOT_SUPPORTED, unless DRUST_MOCK_NVML_FABRIC names a file of answers
//     per node (DRUST_MOCK_NVML_NODE) and GPU, read at every call; see fabric.go.
//   - nvmlDeviceGetMemoryInfo_v2 is the mock's v1 memory info with no reserved memory.
//   - Compute mode: the mock keeps none. The bridge keeps one per GPU (DEFAULT at init), set by
//     nvmlDeviceSetComputeMode and read by nvmlDeviceGetComputeMode; EXCLUSIVE_THREAD (1) is
//     refused as NOT_SUPPORTED, as drivers since CUDA 8 do.
//   - Memory limits (nvmlDeviceSetMemoryLimits_v1, driver r615+): the mock has none. The
//     bridge has the entry point whatever the driver version (a real pre-615 library lacks it;
//     the plugin checks the version too), refuses MIG handles and a cgroup path that is not an
//     existing directory as INVALID_ARGUMENT, and records each call.
//   - MIG devices: the mock keeps GPU and compute instances but has no MIG device handles. The
//     bridge lists one MIG device per compute instance (nvmlDeviceGetMigDeviceHandleByIndex, up
//     to 7 per GPU) with a UUID made from the parent's and the instance ids, the attributes and
//     memory of its GPU instance profile, and its instance ids. The mock does not refuse
//     overlapping placements (a GPU would); the plugin's own accounting prevents them.
//   - GPU instance profile IDs: the mock's are the NVML_GPU_INSTANCE_PROFILE_* values, but real
//     GPUs report other IDs (on an H200: 19, 14, 9, 5, 0, 20, 15 for profiles 0, 1, 2, 3, 4, 7,
//     9; tests/gpu/fixtures/h200-580.159.04). The bridge answers with those IDs, and 100 + the
//     profile for the profiles that fixture does not show, and takes them back in placement
//     queries, so code that mixes up ID and profile fails here as it would on a GPU.
//
// Test tooling only; nothing here ships.
package main

/*
#include <stdlib.h>
#include <string.h>

// A GPM sample of this mock: what the usage file said of one GPU instance when it was taken.
typedef struct {
    int gpu;
    unsigned int gi;
    int taken;
    int hasSm, hasMemory;
    unsigned int sm, memory;
} mockGpmSample;

// nvmlGpmMetric_t and nvmlGpmMetricsGet_t (nvml.h): the metrics array is as long as the
// caller made it (numMetrics entries are read and written).
typedef struct {
    unsigned int metricId;
    int nvmlReturn;
    double value;
    struct { char* shortName; char* longName; char* unit; } metricInfo;
} mockGpmMetric;
typedef struct {
    unsigned int version;
    unsigned int numMetrics;
    mockGpmSample* sample1;
    mockGpmSample* sample2;
    mockGpmMetric metrics[1];
} mockGpmMetricsGet;

// nvmlSetMemoryLimits_v1_t (nvml.h, CUDA 13.4).
typedef struct {
    const char* nameSpace;
    unsigned long long softLimit;
    unsigned long long hardLimit;
} nvmlSetMemoryLimits_v1_t;
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxb200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	mock "github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

func main() {}

var (
	mu      sync.Mutex
	server  nvml.Interface
	handles = map[unsafe.Pointer]nvml.Device{}
	byIndex = map[int]unsafe.Pointer{}
)

const (
	success          = C.int(nvml.SUCCESS)
	invalidArgument  = C.int(nvml.ERROR_INVALID_ARGUMENT)
	notSupported     = C.int(nvml.ERROR_NOT_SUPPORTED)
	insufficientSize = C.int(nvml.ERROR_INSUFFICIENT_SIZE)
	uninitialized    = C.int(nvml.ERROR_UNINITIALIZED)
)

func newServer() nvml.Interface {
	switch os.Getenv("DRUST_MOCK_NVML_MACHINE") {
	case "dgxa100":
		return dgxa100.New()
	case "dgxh200":
		return dgxh200.New()
	case "dgxb200":
		return dgxb200.New()
	default:
		return dgxh100.New()
	}
}

// device returns the mock device behind a handle this library gave out.
func device(h unsafe.Pointer) (nvml.Device, bool) {
	mu.Lock()
	defer mu.Unlock()
	d, ok := handles[h]
	return d, ok
}

// A MIG device: compute instance ci of GPU instance gi of GPU gpu.
type migDevice struct {
	gpu int
	gi  *mock.GpuInstance
	ci  *mock.ComputeInstance
}

var (
	migs    = map[unsafe.Pointer]migDevice{}
	giOf    = map[unsafe.Pointer]*mock.GpuInstance{}
	ciOf    = map[unsafe.Pointer]*mock.ComputeInstance{}
	handleG = map[*mock.GpuInstance]unsafe.Pointer{}
	handleC = map[*mock.ComputeInstance]unsafe.Pointer{}
	handleM = map[[2]unsafe.Pointer]unsafe.Pointer{}
)

// handle returns the C handle of a Go object, making one the first time (under mu).
func giHandle(gi *mock.GpuInstance) unsafe.Pointer {
	if h, ok := handleG[gi]; ok {
		return h
	}
	h := C.malloc(1)
	handleG[gi], giOf[h] = h, gi
	return h
}

func ciHandle(ci *mock.ComputeInstance) unsafe.Pointer {
	if h, ok := handleC[ci]; ok {
		return h
	}
	h := C.malloc(1)
	handleC[ci], ciOf[h] = h, ci
	return h
}

func lookupGI(h unsafe.Pointer) (*mock.GpuInstance, bool) {
	mu.Lock()
	defer mu.Unlock()
	gi, ok := giOf[h]
	return gi, ok
}

func lookupCI(h unsafe.Pointer) (*mock.ComputeInstance, bool) {
	mu.Lock()
	defer mu.Unlock()
	ci, ok := ciOf[h]
	return ci, ok
}

func mig(h unsafe.Pointer) (migDevice, bool) {
	mu.Lock()
	defer mu.Unlock()
	m, ok := migs[h]
	return m, ok
}

// giProfile is the mock's profile info of a GPU instance (the mock's profile IDs are profiles).
func giProfile(gi *mock.GpuInstance) nvml.GpuInstanceProfileInfo {
	return gi.MIGProfiles.GpuInstanceProfiles[int(gi.Info.ProfileId)]
}

// index of a handle (its GPU index).
func index(h unsafe.Pointer) int {
	mu.Lock()
	defer mu.Unlock()
	for i, p := range byIndex {
		if p == h {
			return i
		}
	}
	return -1
}

// putString copies s with its NUL into buf of length n.
func putString(buf *C.char, n C.uint, s string) C.int {
	if buf == nil {
		return invalidArgument
	}
	if C.uint(len(s)+1) > n {
		return insufficientSize
	}
	cs := C.CString(s)
	defer C.free(unsafe.Pointer(cs))
	C.strncpy(buf, cs, C.size_t(len(s)+1))
	return success
}

//export nvmlInit_v2
func nvmlInit_v2() C.int {
	mu.Lock()
	defer mu.Unlock()
	if server == nil {
		server = newServer()
		if os.Getenv("DRUST_MOCK_NVML_UUIDS") == "fixed" {
			count, _ := server.DeviceGetCount()
			for i := 0; i < count; i++ {
				if d, r := server.DeviceGetHandleByIndex(i); r == nvml.SUCCESS {
					if md, ok := d.(*mock.Device); ok {
						md.UUID = fmt.Sprintf("GPU-00000000-0000-4000-8000-%012d", i)
					}
				}
			}
		}
		if os.Getenv("DRUST_MOCK_NVML_MIG") == "1" {
			count, _ := server.DeviceGetCount()
			for i := 0; i < count; i++ {
				if d, r := server.DeviceGetHandleByIndex(i); r == nvml.SUCCESS {
					d.SetMigMode(nvml.DEVICE_MIG_ENABLE)
				}
			}
		}
	}
	return C.int(server.Init())
}

//export nvmlInitWithFlags
func nvmlInitWithFlags(flags C.uint) C.int { return nvmlInit_v2() }

//export nvmlShutdown
func nvmlShutdown() C.int { return success }

var errorStrings sync.Map

//export nvmlErrorString
func nvmlErrorString(r C.int) *C.char {
	if s, ok := errorStrings.Load(int(r)); ok {
		return s.(*C.char)
	}
	s := C.CString(nvml.Return(r).Error())
	errorStrings.Store(int(r), s)
	return s
}

//export nvmlSystemGetDriverVersion
func nvmlSystemGetDriverVersion(buf *C.char, n C.uint) C.int {
	if server == nil {
		return uninitialized
	}
	v, r := server.SystemGetDriverVersion()
	if r != nvml.SUCCESS {
		return C.int(r)
	}
	if override := os.Getenv("DRUST_MOCK_NVML_DRIVER_VERSION"); override != "" {
		v = override
	}
	return putString(buf, n, v)
}

//export nvmlSystemGetCudaDriverVersion_v2
func nvmlSystemGetCudaDriverVersion_v2(v *C.int) C.int {
	if server == nil {
		return uninitialized
	}
	got, r := server.SystemGetCudaDriverVersion()
	*v = C.int(got)
	return C.int(r)
}

//export nvmlSystemGetCudaDriverVersion
func nvmlSystemGetCudaDriverVersion(v *C.int) C.int { return nvmlSystemGetCudaDriverVersion_v2(v) }

//export nvmlDeviceGetCount_v2
func nvmlDeviceGetCount_v2(n *C.uint) C.int {
	if server == nil {
		return uninitialized
	}
	count, r := server.DeviceGetCount()
	*n = C.uint(count)
	return C.int(r)
}

//export nvmlDeviceGetHandleByIndex_v2
func nvmlDeviceGetHandleByIndex_v2(i C.uint, out *unsafe.Pointer) C.int {
	if server == nil {
		return uninitialized
	}
	d, r := server.DeviceGetHandleByIndex(int(i))
	if r != nvml.SUCCESS {
		return C.int(r)
	}
	mu.Lock()
	defer mu.Unlock()
	h, ok := byIndex[int(i)]
	if !ok {
		h = C.malloc(1)
		byIndex[int(i)] = h
		handles[h] = d
	}
	*out = h
	return success
}

//export nvmlDeviceGetIndex
func nvmlDeviceGetIndex(h unsafe.Pointer, out *C.uint) C.int {
	i := index(h)
	if i < 0 {
		return invalidArgument
	}
	*out = C.uint(i)
	return success
}

func str(h unsafe.Pointer, buf *C.char, n C.uint, get func(nvml.Device) (string, nvml.Return)) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	s, r := get(d)
	if r != nvml.SUCCESS {
		return C.int(r)
	}
	return putString(buf, n, s)
}

//export nvmlDeviceGetUUID
func nvmlDeviceGetUUID(h unsafe.Pointer, buf *C.char, n C.uint) C.int {
	if m, ok := mig(h); ok {
		mu.Lock()
		u := migUUID(m)
		mu.Unlock()
		return putString(buf, n, u)
	}
	return str(h, buf, n, nvml.Device.GetUUID)
}

//export nvmlDeviceGetName
func nvmlDeviceGetName(h unsafe.Pointer, buf *C.char, n C.uint) C.int {
	return str(h, buf, n, nvml.Device.GetName)
}

func integer(h unsafe.Pointer, out *C.uint, get func(nvml.Device) (int, nvml.Return)) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	v, r := get(d)
	*out = C.uint(v)
	return C.int(r)
}

//export nvmlDeviceGetMinorNumber
func nvmlDeviceGetMinorNumber(h unsafe.Pointer, out *C.uint) C.int {
	return integer(h, out, nvml.Device.GetMinorNumber)
}

//export nvmlDeviceGetBrand
func nvmlDeviceGetBrand(h unsafe.Pointer, out *C.int) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	b, r := d.GetBrand()
	*out = C.int(b)
	return C.int(r)
}

//export nvmlDeviceGetArchitecture
func nvmlDeviceGetArchitecture(h unsafe.Pointer, out *C.uint) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	a, r := d.GetArchitecture()
	*out = C.uint(a)
	return C.int(r)
}

//export nvmlDeviceGetCudaComputeCapability
func nvmlDeviceGetCudaComputeCapability(h unsafe.Pointer, major, minor *C.int) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	ma, mi, r := d.GetCudaComputeCapability()
	*major, *minor = C.int(ma), C.int(mi)
	return C.int(r)
}

//export nvmlDeviceGetMemoryInfo_v2
func nvmlDeviceGetMemoryInfo_v2(h unsafe.Pointer, out unsafe.Pointer) C.int {
	if m, ok := mig(h); ok {
		v2 := (*nvml.Memory_v2)(out)
		v2.Total, v2.Reserved, v2.Free, v2.Used = giProfile(m.gi).MemorySizeMB<<20, 0, 0, 0
		return success
	}
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	m, r := d.GetMemoryInfo()
	if r != nvml.SUCCESS {
		return C.int(r)
	}
	v2 := (*nvml.Memory_v2)(out)
	v2.Total, v2.Reserved, v2.Free, v2.Used = m.Total, 0, m.Free, m.Used
	if u, ok := usageOf(index(h)); ok {
		v2.Used = u.MemoryUsedBytes
		v2.Free = m.Total - min(m.Total, u.MemoryUsedBytes)
	}
	return success
}

//export nvmlDeviceGetPciInfo_v3
func nvmlDeviceGetPciInfo_v3(h unsafe.Pointer, out unsafe.Pointer) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	p, r := d.GetPciInfo()
	if r != nvml.SUCCESS {
		return C.int(r)
	}
	// The mock has no bus IDs: GPU i sits at bus 0x18 + 0x10*i (see the package docs).
	bus := uint32(0x18 + 0x10*index(h))
	p.Domain, p.Bus, p.Device = 0, bus, 0
	id := fmt.Sprintf("00000000:%02X:00.0", bus)
	for i := range p.BusId {
		p.BusId[i] = 0
	}
	for i := 0; i < len(id); i++ {
		p.BusId[i] = int8(id[i])
	}
	for i := range p.BusIdLegacy {
		p.BusIdLegacy[i] = 0
	}
	legacy := fmt.Sprintf("0000:%02X:00.0", bus)
	for i := 0; i < len(legacy); i++ {
		p.BusIdLegacy[i] = int8(legacy[i])
	}
	*(*nvml.PciInfo)(out) = p
	return success
}

//export nvmlDeviceGetMigMode
func nvmlDeviceGetMigMode(h unsafe.Pointer, current, pending *C.uint) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	c, p, r := d.GetMigMode()
	*current, *pending = C.uint(c), C.uint(p)
	return C.int(r)
}

//export nvmlDeviceGetGpuInstanceProfileInfo
func nvmlDeviceGetGpuInstanceProfileInfo(h unsafe.Pointer, profile C.uint, out unsafe.Pointer) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	info, r := d.GetGpuInstanceProfileInfo(int(profile))
	if r != nvml.SUCCESS {
		return C.int(r)
	}
	info.Id = idOf(int(profile))
	*(*nvml.GpuInstanceProfileInfo)(out) = info
	return success
}

//export nvmlDeviceGetGpuInstancePossiblePlacements_v2
func nvmlDeviceGetGpuInstancePossiblePlacements_v2(h unsafe.Pointer, profileID C.uint, out unsafe.Pointer, count *C.uint) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	profile := profileOf(uint32(profileID))
	if profile < 0 {
		return invalidArgument
	}
	// The mock keys its placements by profile (its IDs are the profiles).
	info := nvml.GpuInstanceProfileInfo{Id: uint32(profile)}
	placements, r := d.GetGpuInstancePossiblePlacements(&info)
	if r != nvml.SUCCESS {
		return C.int(r)
	}
	if out == nil {
		*count = C.uint(len(placements))
		return success
	}
	if int(*count) < len(placements) {
		*count = C.uint(len(placements))
		return insufficientSize
	}
	dst := unsafe.Slice((*nvml.GpuInstancePlacement)(out), len(placements))
	copy(dst, placements)
	*count = C.uint(len(placements))
	return success
}

// realID maps an NVML_GPU_INSTANCE_PROFILE_* value to the ID a real GPU reports for it.
var realID = map[int]uint32{0: 19, 1: 14, 2: 9, 3: 5, 4: 0, 7: 20, 9: 15}

func idOf(profile int) uint32 {
	if id, ok := realID[profile]; ok {
		return id
	}
	return uint32(100 + profile)
}

// profileOf is idOf's inverse; -1 for an ID no profile has.
func profileOf(id uint32) int {
	for p := 0; p < nvml.GPU_INSTANCE_PROFILE_COUNT; p++ {
		if idOf(p) == id {
			return p
		}
	}
	return -1
}

// What the mock does not model: answered NOT_SUPPORTED, as a GPU without the feature does.

//export nvmlDeviceGetAttributes_v2
func nvmlDeviceGetAttributes_v2(h unsafe.Pointer, out unsafe.Pointer) C.int {
	m, ok := mig(h)
	if !ok {
		// Full GPUs: NOT_SUPPORTED, as the real library answers.
		return notSupported
	}
	p := giProfile(m.gi)
	ci := m.gi.MIGProfiles.ComputeInstanceProfiles[int(m.gi.Info.ProfileId)][int(m.ci.Info.ProfileId)]
	*(*nvml.DeviceAttributes)(out) = nvml.DeviceAttributes{
		MultiprocessorCount:       ci.MultiprocessorCount,
		SharedCopyEngineCount:     ci.SharedCopyEngineCount,
		SharedDecoderCount:        ci.SharedDecoderCount,
		SharedEncoderCount:        ci.SharedEncoderCount,
		SharedJpegCount:           ci.SharedJpegCount,
		SharedOfaCount:            ci.SharedOfaCount,
		GpuInstanceSliceCount:     p.SliceCount,
		ComputeInstanceSliceCount: ci.SliceCount,
		MemorySizeMB:              p.MemorySizeMB,
	}
	return success
}

//export nvmlDeviceGetNumGpuCores
func nvmlDeviceGetNumGpuCores(h unsafe.Pointer, out *C.uint) C.int { return notSupported }

//export nvmlDeviceGetNumaNodeId
func nvmlDeviceGetNumaNodeId(h unsafe.Pointer, out *C.uint) C.int { return notSupported }

//export nvmlDeviceGetNvLinkState
func nvmlDeviceGetNvLinkState(h unsafe.Pointer, link C.uint, out *C.int) C.int { return notSupported }

// MIG: GPU and compute instances of NVIDIA's mock, and MIG devices the bridge derives from them.

// cGpuInstanceInfo is nvmlGpuInstanceInfo_t.
type cGpuInstanceInfo struct {
	Device      unsafe.Pointer
	Id          uint32
	ProfileId   uint32
	Start, Size uint32
}

// cComputeInstanceInfo is nvmlComputeInstanceInfo_t.
type cComputeInstanceInfo struct {
	Device      unsafe.Pointer
	GpuInstance unsafe.Pointer
	Id          uint32
	ProfileId   uint32
	Start, Size uint32
}

//export nvmlDeviceCreateGpuInstanceWithPlacement
func nvmlDeviceCreateGpuInstanceWithPlacement(h unsafe.Pointer, profileID C.uint, placement unsafe.Pointer, out *unsafe.Pointer) C.int {
	d, ok := device(h)
	if !ok || placement == nil {
		return invalidArgument
	}
	profile := profileOf(uint32(profileID))
	if profile < 0 {
		return invalidArgument
	}
	info, r := d.GetGpuInstanceProfileInfo(profile)
	if r != nvml.SUCCESS {
		return C.int(r)
	}
	gi, r := d.CreateGpuInstanceWithPlacement(&info, (*nvml.GpuInstancePlacement)(placement))
	if r != nvml.SUCCESS {
		return C.int(r)
	}
	mu.Lock()
	*out = giHandle(gi.(*mock.GpuInstance))
	mu.Unlock()
	return success
}

//export nvmlGpuInstanceGetInfo
func nvmlGpuInstanceGetInfo(h unsafe.Pointer, out unsafe.Pointer) C.int {
	mu.Lock()
	defer mu.Unlock()
	gi, ok := giOf[h]
	if !ok {
		return invalidArgument
	}
	var dev unsafe.Pointer
	for _, p := range byIndex {
		if handles[p] == gi.Info.Device {
			dev = p
		}
	}
	*(*cGpuInstanceInfo)(out) = cGpuInstanceInfo{
		Device:    dev,
		Id:        gi.Info.Id,
		ProfileId: idOf(int(gi.Info.ProfileId)),
		Start:     gi.Info.Placement.Start,
		Size:      gi.Info.Placement.Size,
	}
	return success
}

//export nvmlGpuInstanceGetComputeInstanceProfileInfo
func nvmlGpuInstanceGetComputeInstanceProfileInfo(h unsafe.Pointer, profile, engine C.uint, out unsafe.Pointer) C.int {
	gi, ok := lookupGI(h)
	if !ok {
		return invalidArgument
	}
	info, r := gi.GetComputeInstanceProfileInfo(int(profile), int(engine))
	if r != nvml.SUCCESS {
		return C.int(r)
	}
	*(*nvml.ComputeInstanceProfileInfo)(out) = info
	return success
}

//export nvmlGpuInstanceCreateComputeInstance
func nvmlGpuInstanceCreateComputeInstance(h unsafe.Pointer, profileID C.uint, out *unsafe.Pointer) C.int {
	gi, ok := lookupGI(h)
	if !ok {
		return invalidArgument
	}
	for p := 0; p < nvml.COMPUTE_INSTANCE_PROFILE_COUNT; p++ {
		info, r := gi.GetComputeInstanceProfileInfo(p, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if r != nvml.SUCCESS || info.Id != uint32(profileID) {
			continue
		}
		ci, r := gi.CreateComputeInstance(&info)
		if r != nvml.SUCCESS {
			return C.int(r)
		}
		mu.Lock()
		*out = ciHandle(ci.(*mock.ComputeInstance))
		mu.Unlock()
		return success
	}
	return invalidArgument
}

//export nvmlComputeInstanceGetInfo_v2
func nvmlComputeInstanceGetInfo_v2(h unsafe.Pointer, out unsafe.Pointer) C.int {
	mu.Lock()
	defer mu.Unlock()
	ci, ok := ciOf[h]
	if !ok {
		return invalidArgument
	}
	gi := ci.Info.GpuInstance.(*mock.GpuInstance)
	*(*cComputeInstanceInfo)(out) = cComputeInstanceInfo{
		GpuInstance: giHandle(gi),
		Id:          ci.Info.Id,
		ProfileId:   ci.Info.ProfileId,
		Start:       ci.Info.Placement.Start,
		Size:        ci.Info.Placement.Size,
	}
	return success
}

//export nvmlComputeInstanceDestroy
func nvmlComputeInstanceDestroy(h unsafe.Pointer) C.int {
	ci, ok := lookupCI(h)
	if !ok {
		return invalidArgument
	}
	return C.int(ci.Destroy())
}

//export nvmlGpuInstanceDestroy
func nvmlGpuInstanceDestroy(h unsafe.Pointer) C.int {
	gi, ok := lookupGI(h)
	if !ok {
		return invalidArgument
	}
	gi.RLock()
	busy := len(gi.ComputeInstances) > 0
	gi.RUnlock()
	if busy {
		// As NVML: a GPU instance with compute instances is in use.
		return C.int(nvml.ERROR_IN_USE)
	}
	return C.int(gi.Destroy())
}

//export nvmlDeviceGetGpuInstanceById
func nvmlDeviceGetGpuInstanceById(h unsafe.Pointer, id C.uint, out *unsafe.Pointer) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	sd := d.(*mock.Device)
	sd.RLock()
	defer sd.RUnlock()
	for gi := range sd.GpuInstances {
		if gi.Info.Id == uint32(id) {
			mu.Lock()
			*out = giHandle(gi)
			mu.Unlock()
			return success
		}
	}
	return C.int(nvml.ERROR_NOT_FOUND)
}

//export nvmlGpuInstanceGetComputeInstanceById
func nvmlGpuInstanceGetComputeInstanceById(h unsafe.Pointer, id C.uint, out *unsafe.Pointer) C.int {
	gi, ok := lookupGI(h)
	if !ok {
		return invalidArgument
	}
	gi.RLock()
	defer gi.RUnlock()
	for ci := range gi.ComputeInstances {
		if ci.Info.Id == uint32(id) {
			mu.Lock()
			*out = ciHandle(ci)
			mu.Unlock()
			return success
		}
	}
	return C.int(nvml.ERROR_NOT_FOUND)
}

// migList is the GPU's MIG devices, by GPU instance id then compute instance id.
func migList(sd *mock.Device) [][2]any {
	sd.RLock()
	defer sd.RUnlock()
	var out [][2]any
	for gi := range sd.GpuInstances {
		gi.RLock()
		for ci := range gi.ComputeInstances {
			out = append(out, [2]any{gi, ci})
		}
		gi.RUnlock()
	}
	sort.Slice(out, func(a, b int) bool {
		ga, gb := out[a][0].(*mock.GpuInstance), out[b][0].(*mock.GpuInstance)
		if ga.Info.Id != gb.Info.Id {
			return ga.Info.Id < gb.Info.Id
		}
		return out[a][1].(*mock.ComputeInstance).Info.Id < out[b][1].(*mock.ComputeInstance).Info.Id
	})
	return out
}

//export nvmlDeviceGetMaxMigDeviceCount
func nvmlDeviceGetMaxMigDeviceCount(h unsafe.Pointer, out *C.uint) C.int {
	if _, ok := device(h); !ok {
		return invalidArgument
	}
	*out = 7
	return success
}

//export nvmlDeviceGetMigDeviceHandleByIndex
func nvmlDeviceGetMigDeviceHandleByIndex(h unsafe.Pointer, i C.uint, out *unsafe.Pointer) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	list := migList(d.(*mock.Device))
	if int(i) >= len(list) {
		return C.int(nvml.ERROR_NOT_FOUND)
	}
	gi, ci := list[i][0].(*mock.GpuInstance), list[i][1].(*mock.ComputeInstance)
	mu.Lock()
	defer mu.Unlock()
	key := [2]unsafe.Pointer{giHandle(gi), ciHandle(ci)}
	m, ok := handleM[key]
	if !ok {
		m = C.malloc(1)
		handleM[key] = m
		migs[m] = migDevice{gpu: index0(h), gi: gi, ci: ci}
	}
	*out = m
	return success
}

// index0 is index() for callers holding mu.
func index0(h unsafe.Pointer) int {
	for i, p := range byIndex {
		if p == h {
			return i
		}
	}
	return -1
}

//export nvmlDeviceGetGpuInstanceId
func nvmlDeviceGetGpuInstanceId(h unsafe.Pointer, out *C.uint) C.int {
	m, ok := mig(h)
	if !ok {
		return invalidArgument
	}
	*out = C.uint(m.gi.Info.Id)
	return success
}

//export nvmlDeviceGetComputeInstanceId
func nvmlDeviceGetComputeInstanceId(h unsafe.Pointer, out *C.uint) C.int {
	m, ok := mig(h)
	if !ok {
		return invalidArgument
	}
	*out = C.uint(m.ci.Info.Id)
	return success
}

// migUUID is a MIG device's UUID: from its parent's and its instance ids, stable for them.
func migUUID(m migDevice) string {
	parent := "GPU-unknown"
	if d, ok := handles[byIndex[m.gpu]]; ok {
		parent, _ = d.GetUUID()
	}
	return fmt.Sprintf("MIG-%s-%02x%02x", parent[4:], m.gi.Info.Id, m.ci.Info.Id)
}

// Health events: event sets over the files of DRUST_MOCK_NVML_EVENTS.

const (
	eventXid = uint64(nvml.EventTypeXidCriticalError)
	eventDbe = uint64(nvml.EventTypeDoubleBitEccError)
)

// cEventData is nvmlEventData_t.
type cEventData struct {
	Device            unsafe.Pointer
	EventType         uint64
	EventData         uint64
	GpuInstanceId     uint32
	ComputeInstanceId uint32
}

// eventSets: set handle -> registered GPU handle -> event types.
var eventSets = map[unsafe.Pointer]map[unsafe.Pointer]uint64{}

//export nvmlDeviceGetSupportedEventTypes
func nvmlDeviceGetSupportedEventTypes(h unsafe.Pointer, out *C.ulonglong) C.int {
	if _, ok := device(h); !ok {
		return invalidArgument
	}
	*out = C.ulonglong(eventXid | eventDbe)
	return success
}

//export nvmlEventSetCreate
func nvmlEventSetCreate(out *unsafe.Pointer) C.int {
	mu.Lock()
	defer mu.Unlock()
	set := C.malloc(1)
	eventSets[set] = map[unsafe.Pointer]uint64{}
	*out = set
	return success
}

//export nvmlDeviceRegisterEvents
func nvmlDeviceRegisterEvents(h unsafe.Pointer, types C.ulonglong, set unsafe.Pointer) C.int {
	if _, ok := device(h); !ok {
		return invalidArgument
	}
	mu.Lock()
	defer mu.Unlock()
	gpus, ok := eventSets[set]
	if !ok {
		return invalidArgument
	}
	gpus[h] |= uint64(types)
	return success
}

//export nvmlEventSetFree
func nvmlEventSetFree(set unsafe.Pointer) C.int {
	mu.Lock()
	defer mu.Unlock()
	if _, ok := eventSets[set]; !ok {
		return invalidArgument
	}
	delete(eventSets, set)
	C.free(set)
	return success
}

// takeEvent removes and returns the first event file for a GPU registered with set.
func takeEvent(set unsafe.Pointer) (cEventData, bool) {
	dir := os.Getenv("DRUST_MOCK_NVML_EVENTS")
	if dir == "" {
		return cEventData{}, false
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	sort.Strings(files)
	for _, f := range files {
		text, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var e struct {
			Gpu int    `json:"gpu"`
			Xid uint64 `json:"xid"`
			Dbe bool   `json:"dbe"`
		}
		if json.Unmarshal(text, &e) != nil {
			continue
		}
		mu.Lock()
		h := byIndex[e.Gpu]
		types := eventSets[set][h]
		mu.Unlock()
		kind := eventXid
		if e.Dbe {
			kind = eventDbe
		}
		if h == nil || types&kind == 0 {
			continue
		}
		os.Remove(f)
		return cEventData{Device: h, EventType: kind, EventData: e.Xid}, true
	}
	return cEventData{}, false
}

//export nvmlEventSetWait_v2
func nvmlEventSetWait_v2(set unsafe.Pointer, out unsafe.Pointer, timeoutMs C.uint) C.int {
	mu.Lock()
	_, ok := eventSets[set]
	mu.Unlock()
	if !ok {
		return invalidArgument
	}
	deadline := time.Now().Add(time.Duration(timeoutMs) * time.Millisecond)
	for {
		if e, ok := takeEvent(set); ok {
			*(*cEventData)(out) = e
			return success
		}
		if time.Now().After(deadline) {
			return C.int(nvml.ERROR_TIMEOUT)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Recovery: what the node plugin asks before it clears a GPU's health taint.

//export nvmlDeviceGetHandleByUUID
func nvmlDeviceGetHandleByUUID(uuid *C.char, out *unsafe.Pointer) C.int {
	want := C.GoString(uuid)
	if server == nil {
		return uninitialized
	}
	count, _ := server.DeviceGetCount()
	for i := 0; i < count; i++ {
		var h unsafe.Pointer
		if r := nvmlDeviceGetHandleByIndex_v2(C.uint(i), &h); r != success {
			return r
		}
		if d, ok := device(h); ok {
			if u, _ := d.GetUUID(); u == want {
				*out = h
				return success
			}
		}
	}
	return C.int(nvml.ERROR_NOT_FOUND)
}

//export nvmlDeviceGetRetiredPagesPendingStatus
func nvmlDeviceGetRetiredPagesPendingStatus(h unsafe.Pointer, out *C.int) C.int {
	// Page retirement is a pre-Ampere mechanism; these GPUs remap rows instead.
	return notSupported
}

//export nvmlDeviceGetRemappedRows
func nvmlDeviceGetRemappedRows(h unsafe.Pointer, corr, unc, pending, failure *C.uint) C.int {
	i := index(h)
	if i < 0 {
		return invalidArgument
	}
	*corr, *unc, *pending, *failure = 0, 0, 0, 0
	if dir := os.Getenv("DRUST_MOCK_NVML_EVENTS"); dir != "" {
		if _, err := os.Stat(filepath.Join(dir, fmt.Sprintf("remap-pending-%d", i))); err == nil {
			*unc, *pending = 1, 1
		}
	}
	return success
}

// Compute modes, by GPU index (absent: DEFAULT).
var computeModes = map[int]C.int{}

// record appends one line to DRUST_MOCK_NVML_CALLS, if set.
func record(format string, args ...any) {
	path := os.Getenv("DRUST_MOCK_NVML_CALLS")
	if path == "" {
		return
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintf(f, format+"\n", args...)
}

//export nvmlDeviceGetComputeMode
func nvmlDeviceGetComputeMode(h unsafe.Pointer, out *C.int) C.int {
	i := index(h)
	if i < 0 || out == nil {
		return invalidArgument
	}
	mu.Lock()
	defer mu.Unlock()
	*out = computeModes[i]
	return success
}

//export nvmlDeviceSetComputeMode
func nvmlDeviceSetComputeMode(h unsafe.Pointer, mode C.int) C.int {
	d, ok := device(h)
	i := index(h)
	if !ok || i < 0 {
		return invalidArgument
	}
	switch mode {
	case 0, 2, 3:
	case 1:
		return notSupported
	default:
		return invalidArgument
	}
	uuid, _ := d.GetUUID()
	mu.Lock()
	computeModes[i] = mode
	mu.Unlock()
	record("nvmlDeviceSetComputeMode %s %d", uuid, int(mode))
	return success
}

//export nvmlDeviceSetMemoryLimits_v1
func nvmlDeviceSetMemoryLimits_v1(h unsafe.Pointer, limits *C.nvmlSetMemoryLimits_v1_t) C.int {
	d, ok := device(h)
	if !ok || limits == nil || limits.nameSpace == nil {
		// MIG handles are not full-GPU handles: NVML refuses them here.
		return invalidArgument
	}
	cgroup := C.GoString(limits.nameSpace)
	if st, err := os.Stat(cgroup); err != nil || !st.IsDir() {
		return invalidArgument
	}
	uuid, _ := d.GetUUID()
	record("nvmlDeviceSetMemoryLimits_v1 %s %s %d %d", uuid, cgroup,
		uint64(limits.softLimit), uint64(limits.hardLimit))
	return success
}

// usage is one GPU's usage file (DRUST_MOCK_NVML_USAGE).
type usage struct {
	SmPercent       *uint32 `json:"smPercent"`
	MemoryPercent   *uint32 `json:"memoryPercent"`
	MemoryUsedBytes uint64  `json:"memoryUsedBytes"`
	Processes       []struct {
		Pid               uint32  `json:"pid"`
		UsedMemoryBytes   *uint64 `json:"usedMemoryBytes"`
		GpuInstanceId     *uint32 `json:"gpuInstanceId"`
		ComputeInstanceId *uint32 `json:"computeInstanceId"`
		SmPercent         *uint32 `json:"smPercent"`
	} `json:"processes"`
	Mig []struct {
		GpuInstanceId uint32  `json:"gpuInstanceId"`
		SmPercent     *uint32 `json:"smPercent"`
		MemoryPercent *uint32 `json:"memoryPercent"`
	} `json:"mig"`
}

// usageOf reads GPU i's usage file; false without DRUST_MOCK_NVML_USAGE. A missing file is an
// idle GPU; an unreadable one is reported on stderr and read as idle.
func usageOf(i int) (usage, bool) {
	dir := os.Getenv("DRUST_MOCK_NVML_USAGE")
	if dir == "" || i < 0 {
		return usage{}, false
	}
	var u usage
	data, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("%d.json", i)))
	if err != nil {
		return u, true
	}
	if err := json.Unmarshal(data, &u); err != nil {
		fmt.Fprintf(os.Stderr, "mocknvml: usage file of GPU %d: %v\n", i, err)
		return usage{}, true
	}
	return u, true
}

// migEnabled reports whether GPU handle h has MIG mode on.
func migEnabled(d nvml.Device) bool {
	current, _, r := d.GetMigMode()
	return r == nvml.SUCCESS && current == nvml.DEVICE_MIG_ENABLE
}

//export nvmlDeviceGetUtilizationRates
func nvmlDeviceGetUtilizationRates(h unsafe.Pointer, ptr unsafe.Pointer) C.int {
	out := (*nvml.Utilization)(ptr)
	d, ok := device(h)
	if !ok || out == nil {
		return invalidArgument
	}
	if migEnabled(d) {
		return notSupported
	}
	u, _ := usageOf(index(h))
	out.Gpu, out.Memory = 0, 0
	if u.SmPercent != nil {
		out.Gpu = *u.SmPercent
	}
	if u.MemoryPercent != nil {
		out.Memory = *u.MemoryPercent
	}
	return success
}

// noValue is NVML's "not applicable" for a process's instance ids.
const noValue = 0xFFFFFFFF

//export nvmlDeviceGetComputeRunningProcesses_v3
func nvmlDeviceGetComputeRunningProcesses_v3(h unsafe.Pointer, count *C.uint, ptr unsafe.Pointer) C.int {
	infos := (*nvml.ProcessInfo)(ptr)
	if _, ok := device(h); !ok || count == nil {
		return invalidArgument
	}
	u, _ := usageOf(index(h))
	n := len(u.Processes)
	if int(*count) < n || (n > 0 && infos == nil) {
		*count = C.uint(n)
		return insufficientSize
	}
	out := unsafe.Slice(infos, int(*count))
	for i, p := range u.Processes {
		info := nvml.ProcessInfo{Pid: p.Pid, UsedGpuMemory: ^uint64(0), GpuInstanceId: noValue, ComputeInstanceId: noValue}
		if p.UsedMemoryBytes != nil {
			info.UsedGpuMemory = *p.UsedMemoryBytes
		}
		if p.GpuInstanceId != nil {
			info.GpuInstanceId = *p.GpuInstanceId
		}
		if p.ComputeInstanceId != nil {
			info.ComputeInstanceId = *p.ComputeInstanceId
		}
		out[i] = info
	}
	*count = C.uint(n)
	return success
}

//export nvmlDeviceGetProcessUtilization
func nvmlDeviceGetProcessUtilization(h unsafe.Pointer, ptr unsafe.Pointer, count *C.uint, lastSeen C.ulonglong) C.int {
	d, ok := device(h)
	if !ok || count == nil {
		return invalidArgument
	}
	if migEnabled(d) {
		return notSupported
	}
	u, _ := usageOf(index(h))
	now := uint64(time.Now().UnixMicro())
	var samples []nvml.ProcessUtilizationSample
	for _, p := range u.Processes {
		if p.SmPercent != nil && *p.SmPercent > 0 && now > uint64(lastSeen) {
			samples = append(samples, nvml.ProcessUtilizationSample{Pid: p.Pid, TimeStamp: now, SmUtil: *p.SmPercent})
		}
	}
	if len(samples) == 0 {
		*count = 0
		return C.int(nvml.ERROR_NOT_FOUND)
	}
	if ptr == nil || int(*count) < len(samples) {
		*count = C.uint(len(samples))
		return insufficientSize
	}
	copy(unsafe.Slice((*nvml.ProcessUtilizationSample)(ptr), len(samples)), samples)
	*count = C.uint(len(samples))
	return success
}

//export nvmlGpmQueryDeviceSupport
func nvmlGpmQueryDeviceSupport(h unsafe.Pointer, ptr unsafe.Pointer) C.int {
	support := (*nvml.GpmSupport)(ptr)
	if _, ok := device(h); !ok || support == nil || support.Version != nvml.GPM_SUPPORT_VERSION {
		return invalidArgument
	}
	support.IsSupportedDevice = 1
	if os.Getenv("DRUST_MOCK_NVML_MACHINE") == "dgxa100" {
		support.IsSupportedDevice = 0
	}
	return success
}

//export nvmlGpmSampleAlloc
func nvmlGpmSampleAlloc(out **C.mockGpmSample) C.int {
	if out == nil {
		return invalidArgument
	}
	*out = (*C.mockGpmSample)(C.calloc(1, C.size_t(unsafe.Sizeof(C.mockGpmSample{}))))
	return success
}

//export nvmlGpmSampleFree
func nvmlGpmSampleFree(sample *C.mockGpmSample) C.int {
	if sample == nil {
		return invalidArgument
	}
	C.free(unsafe.Pointer(sample))
	return success
}

//export nvmlGpmMigSampleGet
func nvmlGpmMigSampleGet(h unsafe.Pointer, gi C.uint, sample *C.mockGpmSample) C.int {
	d, ok := device(h)
	if !ok || sample == nil {
		return invalidArgument
	}
	if os.Getenv("DRUST_MOCK_NVML_MACHINE") == "dgxa100" {
		return notSupported
	}
	if !migEnabled(d) {
		return invalidArgument
	}
	*sample = C.mockGpmSample{gpu: C.int(index(h)), gi: gi, taken: 1}
	u, _ := usageOf(index(h))
	for _, m := range u.Mig {
		if m.GpuInstanceId != uint32(gi) {
			continue
		}
		if m.SmPercent != nil {
			sample.hasSm, sample.sm = 1, C.uint(*m.SmPercent)
		}
		if m.MemoryPercent != nil {
			sample.hasMemory, sample.memory = 1, C.uint(*m.MemoryPercent)
		}
	}
	return success
}

//export nvmlGpmMetricsGet
func nvmlGpmMetricsGet(get *C.mockGpmMetricsGet) C.int {
	if get == nil || get.version != nvml.GPM_METRICS_GET_VERSION || get.sample1 == nil || get.sample2 == nil {
		return invalidArgument
	}
	before, after := get.sample1, get.sample2
	if before.taken == 0 || after.taken == 0 || before.gpu != after.gpu || before.gi != after.gi {
		return invalidArgument
	}
	metrics := unsafe.Slice(&get.metrics[0], int(get.numMetrics))
	for i := range metrics {
		m := &metrics[i]
		m.metricInfo.shortName, m.metricInfo.longName, m.metricInfo.unit = nil, nil, nil
		m.nvmlReturn, m.value = C.int(nvml.SUCCESS), 0
		switch nvml.GpmMetricId(m.metricId) {
		case nvml.GPM_METRIC_SM_UTIL:
			if after.hasSm != 0 {
				m.value = C.double(after.sm)
			}
		case nvml.GPM_METRIC_DRAM_BW_UTIL:
			if after.hasMemory != 0 {
				m.value = C.double(after.memory)
			}
		default:
			m.nvmlReturn = notSupported
		}
	}
	return success
}

//export nvmlDeviceGetMPSComputeRunningProcesses_v3
func nvmlDeviceGetMPSComputeRunningProcesses_v3(h unsafe.Pointer, count *C.uint, _ unsafe.Pointer) C.int {
	if _, ok := device(h); !ok || count == nil {
		return invalidArgument
	}
	*count = 0
	return success
}

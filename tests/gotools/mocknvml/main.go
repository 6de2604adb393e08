// Command mocknvml is a libnvidia-ml.so.1 for tests: NVML's C entry points, answered by NVIDIA's
// own mock of NVML (github.com/NVIDIA/go-nvml, pkg/nvml/mock, its DGX A100 / H100 / H200 / B200
// servers). Built with -buildmode=c-shared; the node plugin's real NVML backend loads it by path
// (--nvml-library) and runs against it exactly as against the driver's library.
//
// DRUST_MOCK_NVML_MACHINE picks the machine: dgxa100, dgxh100 (default), dgxh200, dgxb200.
// DRUST_MOCK_NVML_MIG=1 enables MIG mode on every GPU at init (the mock's SetMigMode), as an
// administrator would before partitionable mode; no MIG device exists then.
//
// Where the mock has no answer for a call the backend makes, this bridge gives one and says so
// here (and in tests/gpu/README.md):
//   - PCI bus IDs: the mock's PciInfo carries only the device ID. The bridge gives GPU i the
//     bus 0x18 + 0x10*i in domain 0 (devices and functions 0), like the slots of a DGX.
//   - nvmlDeviceGetAttributes_v2 answers NOT_SUPPORTED for full GPUs, as the real library does
//     (tests/gpu/fixtures/h200-580.159.04); nvmlDeviceGetNumGpuCores, NUMA node, NVLink and
//     fabric queries answer NOT_SUPPORTED (the mock models none of them).
//   - nvmlDeviceGetMemoryInfo_v2 is the mock's v1 memory info with no reserved memory.
//   - nvmlDeviceGetMaxMigDeviceCount answers 7 and nvmlDeviceGetMigDeviceHandleByIndex
//     NOT_FOUND: the mock has no MIG device handles.
//   - The mock's GPU instance profile IDs are the NVML_GPU_INSTANCE_PROFILE_* values; real
//     GPUs report other IDs (19 for 1 slice, ...). Both are served faithfully.
//
// Test tooling only; nothing here ships.
package main

/*
#include <stdlib.h>
#include <string.h>
*/
import "C"

import (
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxb200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
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
	*(*nvml.GpuInstanceProfileInfo)(out) = info
	return success
}

//export nvmlDeviceGetGpuInstancePossiblePlacements_v2
func nvmlDeviceGetGpuInstancePossiblePlacements_v2(h unsafe.Pointer, profileID C.uint, out unsafe.Pointer, count *C.uint) C.int {
	d, ok := device(h)
	if !ok {
		return invalidArgument
	}
	info := nvml.GpuInstanceProfileInfo{Id: uint32(profileID)}
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

// What the mock does not model: answered NOT_SUPPORTED, as a GPU without the feature does.

//export nvmlDeviceGetAttributes_v2
func nvmlDeviceGetAttributes_v2(h unsafe.Pointer, out unsafe.Pointer) C.int { return notSupported }

//export nvmlDeviceGetNumGpuCores
func nvmlDeviceGetNumGpuCores(h unsafe.Pointer, out *C.uint) C.int { return notSupported }

//export nvmlDeviceGetNumaNodeId
func nvmlDeviceGetNumaNodeId(h unsafe.Pointer, out *C.uint) C.int { return notSupported }

//export nvmlDeviceGetNvLinkState
func nvmlDeviceGetNvLinkState(h unsafe.Pointer, link C.uint, out *C.int) C.int { return notSupported }

//export nvmlDeviceGetGpuFabricInfoV
func nvmlDeviceGetGpuFabricInfoV(h unsafe.Pointer, out unsafe.Pointer) C.int { return notSupported }

//export nvmlDeviceGetMaxMigDeviceCount
func nvmlDeviceGetMaxMigDeviceCount(h unsafe.Pointer, out *C.uint) C.int {
	if _, ok := device(h); !ok {
		return invalidArgument
	}
	// The mock tracks GPU instances but has no MIG device handles: none exist to list.
	*out = 7
	return success
}

//export nvmlDeviceGetMigDeviceHandleByIndex
func nvmlDeviceGetMigDeviceHandleByIndex(h unsafe.Pointer, i C.uint, out *unsafe.Pointer) C.int {
	return C.int(nvml.ERROR_NOT_FOUND)
}

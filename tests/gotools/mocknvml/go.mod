// The mock libnvidia-ml.so.1 (see main.go): its own module, so that go-nvml does not change the
// control plane's pinned module set (tests/gotools/go.mod keys the control plane cache).
module drust.dev/gotools/mocknvml

go 1.26.0

require github.com/NVIDIA/go-nvml v0.13.4-1

require github.com/google/uuid v1.6.0 // indirect

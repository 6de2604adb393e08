// Command peerplugin is the benchmark peer for drust's prepare/unprepare latency: a minimal DRA
// kubelet plugin built on upstream's k8s.io/dynamic-resource-allocation/kubeletplugin helper (the
// library dra-example-driver and NVIDIA's driver build on), doing the same durable file work per
// claim as drust: one CDI spec file and one checkpoint file, each written to a temp file,
// fsynced, renamed, and the directory fsynced. With --devices N it also publishes N GPUs in a
// ResourceSlice of its node's pool (as a real driver does) and names their device nodes under
// --dev-root in its CDI specs, so that real pods on a real node can use it. Test tooling only.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
)

type driver struct {
	name, node, cdiRoot, checkpoint string
	// devRoot is the host directory holding dev/nvidia<N> ("/" on a real GPU host).
	devRoot string

	mu       sync.Mutex
	prepared map[types.UID][]kubeletplugin.Device
}

// writeAtomic replaces path durably: temp file, fsync, rename, fsync of the directory.
func writeAtomic(path string, data []byte) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, ".tmp-*")
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

func (d *driver) saveLocked() error {
	data, err := json.Marshal(d.prepared)
	if err != nil {
		return err
	}
	return writeAtomic(d.checkpoint, data)
}

func (d *driver) specPath(uid types.UID) string {
	return filepath.Join(d.cdiRoot, fmt.Sprintf("%s-claim_%s.json", d.name, uid))
}

// deviceNodes are the CDI device nodes of a published device "gpu-<N>": /dev/nvidia<N> and the
// control nodes, with their host paths under devRoot.
func (d *driver) deviceNodes(device string) []map[string]string {
	minor := "0"
	if n, err := strconv.Atoi(strings.TrimPrefix(device, "gpu-")); err == nil {
		minor = strconv.Itoa(n)
	}
	var nodes []map[string]string
	for _, node := range []string{"nvidia" + minor, "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"} {
		path := "/dev/" + node
		entry := map[string]string{"path": path}
		if d.devRoot != "/" {
			entry["hostPath"] = filepath.Join(d.devRoot, path)
		}
		nodes = append(nodes, entry)
	}
	return nodes
}

func (d *driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	result := map[types.UID]kubeletplugin.PrepareResult{}
	for _, claim := range claims {
		d.mu.Lock()
		if devs, ok := d.prepared[claim.UID]; ok {
			d.mu.Unlock()
			result[claim.UID] = kubeletplugin.PrepareResult{Devices: devs}
			continue
		}
		d.mu.Unlock()
		var devs []kubeletplugin.Device
		type cdiDevice struct {
			Name           string         `json:"name"`
			ContainerEdits map[string]any `json:"containerEdits"`
		}
		var cdiDevices []cdiDevice
		if claim.Status.Allocation != nil {
			for _, r := range claim.Status.Allocation.Devices.Results {
				if r.Driver != d.name || r.Pool != d.node {
					continue
				}
				name := fmt.Sprintf("%s-%s", claim.UID, r.Device)
				devs = append(devs, kubeletplugin.Device{
					Requests:     []string{r.Request},
					PoolName:     r.Pool,
					DeviceName:   r.Device,
					CDIDeviceIDs: []string{d.name + "/claim=" + name},
				})
				cdiDevices = append(cdiDevices, cdiDevice{Name: name, ContainerEdits: map[string]any{
					"deviceNodes": d.deviceNodes(r.Device),
				}})
			}
		}
		spec, _ := json.Marshal(map[string]any{"cdiVersion": "0.6.0", "kind": d.name + "/claim", "devices": cdiDevices})
		if err := writeAtomic(d.specPath(claim.UID), spec); err != nil {
			result[claim.UID] = kubeletplugin.PrepareResult{Err: err}
			continue
		}
		d.mu.Lock()
		d.prepared[claim.UID] = devs
		err := d.saveLocked()
		d.mu.Unlock()
		result[claim.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	return result, nil
}

func (d *driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	result := map[types.UID]error{}
	for _, claim := range claims {
		if err := os.Remove(d.specPath(claim.UID)); err != nil && !os.IsNotExist(err) {
			result[claim.UID] = err
			continue
		}
		d.mu.Lock()
		delete(d.prepared, claim.UID)
		result[claim.UID] = d.saveLocked()
		d.mu.Unlock()
	}
	return result, nil
}

func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	fmt.Fprintf(os.Stderr, "%s: %v\n", msg, err)
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig file")
	node := flag.String("node", "", "node name (pool)")
	name := flag.String("driver", "peer.drust.dev", "driver name")
	pluginDir := flag.String("plugin-dir", "", "plugin data directory (dra.sock, checkpoint)")
	registrarDir := flag.String("registrar-dir", "", "kubelet plugin registration directory")
	cdiRoot := flag.String("cdi-root", "", "CDI spec directory")
	qps := flag.Float64("kube-api-qps", 5, "client-go QPS (client-go's default is 5)")
	burst := flag.Int("kube-api-burst", 10, "client-go burst (client-go's default is 10)")
	devices := flag.Int("devices", 0, "GPUs gpu-0..gpu-<N-1> to publish in a ResourceSlice (0: publish none)")
	devRoot := flag.String("dev-root", "/", "host directory holding dev/nvidia<N>, named in CDI specs")
	flag.Parse()

	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	cfg.QPS = float32(*qps)
	cfg.Burst = *burst
	client := kubernetes.NewForConfigOrDie(cfg)
	for _, dir := range []string{*pluginDir, *registrarDir, *cdiRoot} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	d := &driver{name: *name, node: *node, cdiRoot: *cdiRoot, devRoot: *devRoot,
		checkpoint: filepath.Join(*pluginDir, "checkpoint.json"), prepared: map[types.UID][]kubeletplugin.Device{}}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	helper, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.KubeClient(client),
		kubeletplugin.NodeName(*node),
		kubeletplugin.DriverName(*name),
		kubeletplugin.PluginDataDirectoryPath(*pluginDir),
		kubeletplugin.RegistrarDirectoryPath(*registrarDir),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if *devices > 0 {
		var published []resourceapi.Device
		for i := 0; i < *devices; i++ {
			index := int64(i)
			published = append(published, resourceapi.Device{
				Name: fmt.Sprintf("gpu-%d", i),
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
					"index": {IntValue: &index},
				},
			})
		}
		err := helper.PublishResources(ctx, resourceslice.DriverResources{
			Pools: map[string]resourceslice.Pool{*node: {Slices: []resourceslice.Slice{{Devices: published}}}},
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	<-ctx.Done()
	helper.Stop()
}

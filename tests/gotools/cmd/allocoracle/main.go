// Command allocoracle runs the upstream structured-parameters allocator
// (k8s.io/dynamic-resource-allocation/structured) on offline objects the way kube-scheduler v1.36's
// DynamicResources plugin does, so that drust's own allocator (dractl allocate) can be compared
// against it.
//
// Usage:
//
//	allocoracle -f FILE [-f FILE]... [--node NAME] [--timeout 10s] [-v N]
//	allocoracle --batch FILE|- [--jobs N] [--timeout 10s] [-v N]
//
// The second form answers many scenarios (JSON Lines in, JSON Lines out) in one process; batch.go
// describes it. What follows describes one run of the first form, which each scenario repeats.
//
// Input: each FILE is YAML or JSON as `kubectl get -o yaml|json` prints it: a stream of documents,
// each one object or a List (kind List, items). Kinds: Node (v1), DeviceClass, ResourceSlice,
// ResourceClaim (resource.k8s.io; v1, or any version the API server serves, converted to v1).
//
// Every object goes through what the API server does on create, with the v1.36 default feature
// gates: strict decoding (unknown or duplicate fields are rejected), the registered defaulting
// functions (pkg/apis/resource/v1 and pkg/apis/core/v1 via install.Install), conversion to the
// internal type, the registry strategy's PrepareForCreate (which drops fields of disabled features),
// the handwritten API validation (pkg/apis/resource/validation), and conversion back to v1. A
// claim with a status goes through the status-update strategy and status validation on top of its
// create. A claim without metadata.namespace gets "default", as kubectl would send it. Any failure
// there, an unsupported kind and a duplicate object are fatal: a message naming the file, the
// document and the object goes to stderr and the exit status is 2.
//
// Claims with status.allocation are in use: their devices (and shared-device IDs and consumed
// capacity) count as allocated. Claims without one are one pod's claims, allocated together.
//
// For each Node (input order, or only --node), the scheduler's path is followed: PreFilter checks
// every request's DeviceClass (a missing one makes the pod unschedulable), gathers the allocated
// state from the in-use claims, and builds one allocator from all ResourceSlices and DeviceClasses
// with the plugin's feature set and CEL cache; Filter then calls Allocate for the node with the
// filter timeout.
//
// Output: one JSON object on stdout, {"nodes": [...]}, each entry one of
//
//	{"name": N, "allocated": true, "claims": [{"namespace": ns, "name": n, "allocation": <v1 AllocationResult>}]}
//	{"name": N, "allocated": false, "reason": "..."}
//	{"name": N, "error": "..."}
//
// "allocated": false is the plugin's Unschedulable status (its message as reason); "error" is its
// Error status (an Allocate error other than a per-node failure, or the filter timeout).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	jsonserializer "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	"k8s.io/client-go/tools/cache"
	dracel "k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/klog/v2"
	schedconfigv1 "k8s.io/kube-scheduler/config/v1"
	"k8s.io/kubernetes/pkg/apis/core"
	coreinstall "k8s.io/kubernetes/pkg/apis/core/install"
	"k8s.io/kubernetes/pkg/apis/resource"
	resourceinstall "k8s.io/kubernetes/pkg/apis/resource/install"
	"k8s.io/kubernetes/pkg/apis/resource/validation"
	"k8s.io/kubernetes/pkg/registry/resource/deviceclass"
	"k8s.io/kubernetes/pkg/registry/resource/resourceclaim"
	"k8s.io/kubernetes/pkg/registry/resource/resourceslice"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"
)

// celCacheSize is the size of the scheduler plugin's LRU cache of compiled CEL expressions
// (dynamicresources.New).
const celCacheSize = 10

// input is everything read from the files, in input order.
type input struct {
	nodes   []*v1.Node
	classes []*resourceapi.DeviceClass
	slices  []*resourceapi.ResourceSlice
	// claims holds all ResourceClaims; those with status.allocation are in use.
	claims []*resourceapi.ResourceClaim
}

// inputError is a fatal problem with one input file or object.
type inputError struct{ msg string }

func (e *inputError) Error() string { return e.msg }

type claimResult struct {
	Namespace  string                        `json:"namespace"`
	Name       string                        `json:"name"`
	Allocation *resourceapi.AllocationResult `json:"allocation"`
}

type nodeResult struct {
	Name      string         `json:"name"`
	Allocated *bool          `json:"allocated,omitempty"`
	Claims    *[]claimResult `json:"claims,omitempty"`
	Reason    string         `json:"reason,omitempty"`
	Error     string         `json:"error,omitempty"`
}

type output struct {
	Nodes []nodeResult `json:"nodes"`
}

// options are the scheduler settings the oracle runs with.
type options struct {
	// node, if set, restricts the run to the Node of that name.
	node string
	// filterTimeout is DynamicResourcesArgs.filterTimeout; zero or negative disables it.
	filterTimeout time.Duration
	// allocateNanos, if set, receives the duration of each node's Allocate call, in node
	// order (benchmarks: the scheduler's per-node Filter cost without set-up and output).
	allocateNanos *[]int64
}

// decoder turns input documents into defaulted, validated v1 objects.
type decoder struct {
	scheme *runtime.Scheme
	strict runtime.Decoder
	seen   sets.Set[string]
}

func newDecoder() *decoder {
	scheme := runtime.NewScheme()
	// The API server's registrations: types, conversions and defaulting functions of the internal
	// and all served versions.
	coreinstall.Install(scheme)
	resourceinstall.Install(scheme)
	// The document reader hands over JSON (YAML converted); decode it as the API server does with
	// fieldValidation=Strict, kubectl's default.
	strict := jsonserializer.NewSerializerWithOptions(jsonserializer.DefaultMetaFactory, scheme, scheme,
		jsonserializer.SerializerOptions{Strict: true})
	return &decoder{scheme: scheme, strict: strict, seen: sets.New[string]()}
}

// objectName is "Kind namespace/name" or "Kind name" for messages.
func objectName(kind string, obj runtime.Object) string {
	accessor, err := meta.Accessor(obj)
	if err != nil {
		return kind
	}
	if ns := accessor.GetNamespace(); ns != "" {
		return fmt.Sprintf("%s %s/%s", kind, ns, accessor.GetName())
	}
	return fmt.Sprintf("%s %q", kind, accessor.GetName())
}

// readFile appends the objects in the file to in.
func (d *decoder) readFile(path string, in *input) error {
	f, err := os.Open(path)
	if err != nil {
		return &inputError{fmt.Sprintf("%s: %v", path, err)}
	}
	defer func() { _ = f.Close() }()
	return d.read(path, f, in)
}

func (d *decoder) read(path string, r io.Reader, in *input) error {
	docs := utilyaml.NewYAMLOrJSONDecoder(r, 4096)
	for index := 0; ; index++ {
		var raw runtime.RawExtension
		if err := docs.Decode(&raw); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return &inputError{fmt.Sprintf("%s: document %d: %v", path, index, err)}
		}
		if len(raw.Raw) == 0 || string(raw.Raw) == "null" {
			continue // empty document
		}
		if err := d.document(fmt.Sprintf("%s: document %d", path, index), raw.Raw, in); err != nil {
			return err
		}
	}
}

// document decodes one JSON document (an object or a List of objects) and adds its objects.
func (d *decoder) document(where string, raw []byte, in *input) error {
	obj, gvk, err := d.strict.Decode(raw, nil, nil)
	if err != nil {
		return decodeError(where, obj, gvk, err)
	}
	if list, ok := obj.(*v1.List); ok {
		for i, item := range list.Items {
			itemWhere := fmt.Sprintf("%s, item %d", where, i)
			obj, gvk, err := d.strict.Decode(item.Raw, nil, nil)
			if err != nil {
				return decodeError(itemWhere, obj, gvk, err)
			}
			if err := d.add(itemWhere, obj, gvk, in); err != nil {
				return err
			}
		}
		return nil
	}
	return d.add(where, obj, gvk, in)
}

// decodeError names the object where strict decoding got that far.
func decodeError(where string, obj runtime.Object, gvk *schema.GroupVersionKind, err error) error {
	if obj != nil && gvk != nil {
		return &inputError{fmt.Sprintf("%s (%s): %v", where, objectName(gvk.Kind, obj), err)}
	}
	return &inputError{fmt.Sprintf("%s: %v", where, err)}
}

// add runs one decoded object through defaulting, the create (and status update) strategy and
// validation, and records the resulting v1 object.
func (d *decoder) add(where string, obj runtime.Object, gvk *schema.GroupVersionKind, in *input) error {
	kind := gvk.Kind
	fail := func(format string, args ...any) error {
		return &inputError{fmt.Sprintf("%s (%s): %s", where, objectName(kind, obj), fmt.Sprintf(format, args...))}
	}
	switch gvk.GroupKind() {
	case schema.GroupKind{Kind: "Node"}, resource.Kind("DeviceClass"), resource.Kind("ResourceSlice"), resource.Kind("ResourceClaim"):
	default:
		return fail("unsupported kind %s", gvk)
	}
	if gvk.Kind == "ResourceClaim" {
		if accessor, err := meta.Accessor(obj); err == nil && accessor.GetNamespace() == "" {
			accessor.SetNamespace("default")
		}
	}
	d.scheme.Default(obj)
	internal, err := d.scheme.ConvertToVersion(obj, runtime.InternalGroupVersioner)
	if err != nil {
		return fail("conversion: %v", err)
	}
	ctx := context.Background()
	var errs field.ErrorList
	var target schema.GroupVersion
	switch o := internal.(type) {
	case *core.Node:
		// Nodes only matter through their labels and name; they are used as decoded and defaulted.
		target = v1.SchemeGroupVersion
	case *resource.DeviceClass:
		deviceclass.Strategy.PrepareForCreate(ctx, o)
		errs = validation.ValidateDeviceClass(o)
		target = resourceapi.SchemeGroupVersion
	case *resource.ResourceSlice:
		resourceslice.Strategy.PrepareForCreate(ctx, o)
		errs = validation.ValidateResourceSlice(o)
		target = resourceapi.SchemeGroupVersion
	case *resource.ResourceClaim:
		strategy := resourceclaim.NewStrategy(nil, nil)
		created := o.DeepCopy()
		strategy.PrepareForCreate(ctx, created) // clears the status, drops disabled spec fields
		errs = validation.ValidateResourceClaim(created)
		if len(errs) == 0 && !isEmptyClaimStatus(&o.Status) {
			// The status is written by an update of the stored object, which has a resourceVersion
			// that the update repeats.
			if created.ResourceVersion == "" {
				created.ResourceVersion = "1"
			}
			updated := o.DeepCopy()
			updated.ResourceVersion = created.ResourceVersion
			resourceclaim.NewStatusStrategy(strategy).PrepareForUpdate(ctx, updated, created)
			errs = validation.ValidateResourceClaimStatusUpdate(updated, created)
			internal = updated
		} else {
			internal = created
		}
		target = resourceapi.SchemeGroupVersion
	default:
		return fail("unsupported type %T", internal)
	}
	if len(errs) > 0 {
		return fail("invalid: %v", errs.ToAggregate())
	}
	external, err := d.scheme.ConvertToVersion(internal, target)
	if err != nil {
		return fail("conversion: %v", err)
	}
	// Reading back from storage applies the defaults again.
	d.scheme.Default(external)

	key := gvk.GroupKind().String() + " " + objectName(kind, external)
	if d.seen.Has(key) {
		return fail("duplicate object")
	}
	d.seen.Insert(key)

	switch o := external.(type) {
	case *v1.Node:
		in.nodes = append(in.nodes, o)
	case *resourceapi.DeviceClass:
		in.classes = append(in.classes, o)
	case *resourceapi.ResourceSlice:
		in.slices = append(in.slices, o)
	case *resourceapi.ResourceClaim:
		in.claims = append(in.claims, o)
	default:
		return fail("unexpected converted type %T", external)
	}
	return nil
}

func isEmptyClaimStatus(s *resource.ResourceClaimStatus) bool {
	return s.Allocation == nil && len(s.ReservedFor) == 0 && len(s.Devices) == 0
}

// loadFiles reads all files in order.
func loadFiles(paths []string) (*input, error) {
	d := newDecoder()
	in := &input{}
	for _, path := range paths {
		if err := d.readFile(path, in); err != nil {
			return nil, err
		}
	}
	return in, nil
}

// classLister is the allocator's DeviceClassLister over an in-memory indexer, the same client-go
// lister the scheduler wraps.
type classLister struct {
	lister resourcelisters.DeviceClassLister
}

func newClassLister(classes []*resourceapi.DeviceClass) (*classLister, error) {
	indexer := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	for _, class := range classes {
		if err := indexer.Add(class); err != nil {
			return nil, err
		}
	}
	return &classLister{lister: resourcelisters.NewDeviceClassLister(indexer)}, nil
}

func (l *classLister) Get(name string) (*resourceapi.DeviceClass, error) { return l.lister.Get(name) }
func (l *classLister) List() ([]*resourceapi.DeviceClass, error) {
	return l.lister.List(labels.Everything())
}

// schedulerFeatures are the plugin's feature flags from the default feature gates of this build
// (k8s.io/kubernetes v1.36.3).
func schedulerFeatures() feature.Features {
	return feature.NewSchedulerFeaturesFromGates(utilfeature.DefaultFeatureGate)
}

// allocatedState is what the scheduler's claim tracker gathers from allocated claims: devices
// allocated exclusively, and with consumable capacity the shared-device IDs and their consumed
// capacity. Results with admin access do not count.
func allocatedState(claims []*resourceapi.ResourceClaim, consumableCapacity bool) structured.AllocatedState {
	state := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	for _, claim := range claims {
		if claim.Status.Allocation == nil {
			continue
		}
		for _, result := range claim.Status.Allocation.Devices.Results {
			if result.AdminAccess != nil && *result.AdminAccess {
				continue
			}
			id := structured.MakeDeviceID(result.Driver, result.Pool, result.Device)
			if consumableCapacity && result.ShareID != nil {
				state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, result.ShareID))
				if result.ConsumedCapacity != nil {
					state.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, result.ConsumedCapacity))
				}
				continue
			}
			state.AllocatedDevices.Insert(id)
		}
	}
	return state
}

// preFilter mirrors the plugin's per-pod checks of the claims to allocate: every request (and
// subrequest) must name an existing DeviceClass. It returns an unschedulable reason, or an error.
func preFilter(fts feature.Features, classes structured.DeviceClassLister, claims []*resourceapi.ResourceClaim) (string, error) {
	check := func(className, requestName string) (string, error) {
		if className == "" {
			return "", fmt.Errorf("request %s: unsupported request type", requestName)
		}
		if _, err := classes.Get(className); err != nil && apierrors.IsNotFound(err) {
			return fmt.Sprintf("request %s: device class %s does not exist", requestName, className), nil
		}
		return "", nil
	}
	for _, claim := range claims {
		for _, request := range claim.Spec.Devices.Requests {
			switch {
			case request.Exactly != nil:
				if reason, err := check(request.Exactly.DeviceClassName, request.Name); reason != "" || err != nil {
					return reason, err
				}
			case len(request.FirstAvailable) > 0:
				if !fts.EnableDRAPrioritizedList {
					return fmt.Sprintf("resource claim %s, request %s: has subrequests, but the DRAPrioritizedList feature is disabled", klog.KObj(claim), request.Name), nil
				}
				for _, sub := range request.FirstAvailable {
					if reason, err := check(sub.DeviceClassName, request.Name+"/"+sub.Name); reason != "" || err != nil {
						return reason, err
					}
				}
			default:
				return fmt.Sprintf("resource claim %s, request %s: unknown request type", klog.KObj(claim), request.Name), nil
			}
		}
	}
	return "", nil
}

func notAllocated(name, reason string) nodeResult {
	no := false
	return nodeResult{Name: name, Allocated: &no, Reason: reason}
}

// run allocates the pod's claims (the unallocated ones) on each selected node.
func run(ctx context.Context, in *input, opts options) (*output, error) {
	nodes := in.nodes
	if opts.node != "" {
		nodes = nil
		for _, node := range in.nodes {
			if node.Name == opts.node {
				nodes = append(nodes, node)
			}
		}
		if len(nodes) == 0 {
			return nil, &inputError{fmt.Sprintf("node %q is not in the input", opts.node)}
		}
	}
	out := &output{Nodes: []nodeResult{}}

	var toAllocate []*resourceapi.ResourceClaim
	for _, claim := range in.claims {
		if claim.Status.Allocation == nil {
			toAllocate = append(toAllocate, claim)
		}
	}
	// No claim to allocate: the plugin skips the pod, every node fits.
	if len(toAllocate) == 0 {
		for _, node := range nodes {
			yes := true
			out.Nodes = append(out.Nodes, nodeResult{Name: node.Name, Allocated: &yes, Claims: &[]claimResult{}})
		}
		return out, nil
	}

	classes, err := newClassLister(in.classes)
	if err != nil {
		return nil, err
	}
	fts := schedulerFeatures()

	// PreFilter: one verdict for all nodes.
	everyNode := func(result func(name string) nodeResult) *output {
		for _, node := range nodes {
			out.Nodes = append(out.Nodes, result(node.Name))
		}
		return out
	}
	reason, err := preFilter(fts, classes, toAllocate)
	if err != nil {
		return everyNode(func(name string) nodeResult { return nodeResult{Name: name, Error: err.Error()} }), nil
	}
	if reason != "" {
		return everyNode(func(name string) nodeResult { return notAllocated(name, reason) }), nil
	}
	celCache := dracel.NewCache(celCacheSize, dracel.Features{
		EnableConsumableCapacity: fts.EnableDRAConsumableCapacity,
		EnableListTypeAttributes: fts.EnableDRAListTypeAttributes,
	})
	allocator, err := structured.NewAllocator(ctx, dynamicresources.AllocatorFeatures(fts),
		allocatedState(in.claims, fts.EnableDRAConsumableCapacity), classes, in.slices, celCache)
	if err != nil {
		return everyNode(func(name string) nodeResult { return nodeResult{Name: name, Error: err.Error()} }), nil
	}

	// Filter, node by node.
	for _, node := range nodes {
		out.Nodes = append(out.Nodes, filter(ctx, fts, opts, allocator, node, toAllocate))
	}
	return out, nil
}

func filter(ctx context.Context, fts feature.Features, opts options, allocator structured.Allocator, node *v1.Node, claims []*resourceapi.ResourceClaim) nodeResult {
	allocCtx := ctx
	if fts.EnableDRASchedulerFilterTimeout && opts.filterTimeout > 0 {
		c, cancel := context.WithTimeout(ctx, opts.filterTimeout)
		defer cancel()
		allocCtx = c
	}
	started := time.Now()
	results, err := allocator.Allocate(allocCtx, node, claims)
	if opts.allocateNanos != nil {
		*opts.allocateNanos = append(*opts.allocateNanos, time.Since(started).Nanoseconds())
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return nodeResult{Name: node.Name, Error: fmt.Sprintf("node %s: timed out trying to allocate devices", node.Name)}
	case errors.Is(err, structured.ErrFailedAllocationOnNode):
		return notAllocated(node.Name, err.Error())
	case err != nil:
		return nodeResult{Name: node.Name, Error: err.Error()}
	case len(results) != len(claims):
		return notAllocated(node.Name, "cannot allocate all claims")
	}
	allocated := make([]claimResult, len(claims))
	for i, claim := range claims {
		allocated[i] = claimResult{Namespace: claim.Namespace, Name: claim.Name, Allocation: &results[i]}
	}
	yes := true
	return nodeResult{Name: node.Name, Allocated: &yes, Claims: &allocated}
}

type fileList []string

func (f *fileList) String() string     { return strings.Join(*f, ",") }
func (f *fileList) Set(v string) error { *f = append(*f, v); return nil }

// stdin is where --batch - reads from (a variable for tests).
var stdin io.Reader = os.Stdin

func main() {
	os.Exit(mainWithArgs(os.Args[1:], os.Stdout, os.Stderr))
}

func mainWithArgs(args []string, stdout, stderr io.Writer) int {
	flags := flag.NewFlagSet("allocoracle", flag.ContinueOnError)
	flags.SetOutput(stderr)
	var files fileList
	flags.Var(&files, "f", "input file (YAML or JSON; repeatable)")
	node := flags.String("node", "", "only this node")
	timeout := flags.Duration("timeout", schedconfigv1.DynamicResourcesFilterTimeoutDefault, "filter timeout per node (DynamicResourcesArgs.filterTimeout; 0 disables)")
	verbosity := flags.String("v", "0", "klog verbosity (logs go to stderr; the allocator logs at 5 to 7)")
	batch := flags.String("batch", "", "JSON Lines scenarios file (- for stdin): batch mode, see batch.go")
	jobs := flags.Int("jobs", 1, "batch mode: scenarios run concurrently")
	timings := flags.String("timings", "", "file mode: write each node's Allocate duration (JSON {\"allocateNanos\": [...]}, node order) to this file")
	if err := flags.Parse(args); err != nil {
		return 2
	}
	if (len(files) == 0) == (*batch == "") || flags.NArg() > 0 || (*batch != "" && *node != "") {
		_, _ = fmt.Fprintln(stderr, "usage: allocoracle -f FILE [-f FILE]... [--node NAME] [--timeout 10s]\n       allocoracle --batch FILE|- [--jobs N] [--timeout 10s]")
		return 2
	}
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	_ = klogFlags.Set("v", *verbosity)
	_ = klogFlags.Set("logtostderr", "true")
	klog.SetOutput(stderr)
	if *batch != "" {
		return batchMain(*batch, *jobs, *timeout, stdin, stdout, stderr)
	}

	in, err := loadFiles(files)
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "allocoracle: %v\n", err)
		return 2
	}
	ctx := klog.NewContext(context.Background(), klog.Background())
	nanos := []int64{}
	out, err := run(ctx, in, options{node: *node, filterTimeout: *timeout, allocateNanos: &nanos})
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "allocoracle: %v\n", err)
		return 2
	}
	if *timings != "" {
		data, _ := json.Marshal(map[string][]int64{"allocateNanos": nanos})
		if err := os.WriteFile(*timings, data, 0o644); err != nil {
			_, _ = fmt.Fprintf(stderr, "allocoracle: writing timings: %v\n", err)
			return 1
		}
	}
	enc := json.NewEncoder(stdout)
	if err := enc.Encode(out); err != nil {
		_, _ = fmt.Fprintf(stderr, "allocoracle: writing output: %v\n", err)
		return 1
	}
	return 0
}

// Command kubeletpeer is the kubelet's side of a DRA plugin's sockets, made of the kubelet's own
// code at v1.36.3, so that tests call a plugin exactly the way a real kubelet does. Test tooling
// only.
//
// Registration runs the kubelet's plugin-manager operation (operationexecutor's
// GenerateRegisterPluginFunc: grpc.DialContext on the bare socket path with WithBlock and a unix
// context dialer, GetInfo, then NotifyRegistrationStatus), either once per "register" command
// (one socket, as a test asks) or, with -registry-dir, through the kubelet's whole plugin
// manager (the fsnotify plugin watcher, the reconciler, deregistration when the socket goes).
// The handler is the kubelet's DRAPluginManager: it dials the advertised endpoint with
// grpc.NewClient("unix:"+endpoint, ...) and calls NodePrepareResources / NodeUnprepareResources
// through DRAPlugin with the kubelet's own per-call timeout, and opens the NodeWatchResources
// health stream as the kubelet does when the plugin advertises it.
//
// Protocol: JSON Lines. Each stdin line is a command {"id":N,"op":...}; each reply is
// {"id":N,"ok":...} or {"id":N,"error":"..."} on stdout; asynchronous events are
// {"event":...}. Protobuf messages travel as base64 of their binary encoding, so the Rust side
// decodes them with its own generated types. The process exits when stdin closes.
//
// Commands:
//
//	{"op":"register","socket":PATH}         -> {"driver","endpoint","services"}
//	{"op":"prepare","driver":D,"service":S,"request":B64}   -> {"response":B64}
//	{"op":"unprepare","driver":D,"service":S,"request":B64} -> {"response":B64}
//
// S is "v1.DRAPlugin" (what the kubelet picks when the plugin offers it) or
// "v1beta1.DRAPlugin" (the kubelet's path for a plugin that offers only v1beta1: the same
// connection, v1 messages converted by the kubelet's V1Beta1ClientWrapper). Requests and
// responses are always the kubelet's internal v1 messages.
//
// Events: {"event":"registered"|"deregistered","driver","endpoint","services"} and
// {"event":"health","driver","response":B64} for every NodeWatchResourcesResponse.
package main

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	drahealthv1alpha1 "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"
	drapbv1 "k8s.io/kubelet/pkg/apis/dra/v1"
	drapbv1beta1 "k8s.io/kubelet/pkg/apis/dra/v1beta1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	draplugin "k8s.io/kubernetes/pkg/kubelet/cm/dra/plugin"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/operationexecutor"
)

type command struct {
	ID      int64  `json:"id"`
	Op      string `json:"op"`
	Socket  string `json:"socket,omitempty"`
	Driver  string `json:"driver,omitempty"`
	Service string `json:"service,omitempty"`
	Request string `json:"request,omitempty"`
}

type reply struct {
	ID    int64  `json:"id"`
	OK    any    `json:"ok,omitempty"`
	Error string `json:"error,omitempty"`
}

type registration struct {
	Event    string   `json:"event,omitempty"`
	Driver   string   `json:"driver"`
	Endpoint string   `json:"endpoint"`
	Services []string `json:"services,omitempty"`
}

type healthEvent struct {
	Event    string `json:"event"`
	Driver   string `json:"driver"`
	Response string `json:"response"`
}

type encoded struct {
	Response string `json:"response"`
}

// out serialises every line written to stdout.
type out struct {
	mu  sync.Mutex
	enc *json.Encoder
}

func (o *out) write(v any) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.enc.Encode(v); err != nil {
		klog.ErrorS(err, "writing to stdout")
		os.Exit(1)
	}
}

// handler is the kubelet's DRA registration handler (DRAPluginManager), reporting each
// registration it accepts as an event and remembering what the plugin advertised.
type handler struct {
	*draplugin.DRAPluginManager
	out *out

	mu      sync.Mutex
	last    map[string]registration // by driver
	beta    *draplugin.DRAPluginManager
	betaFor map[string]string // driver -> endpoint registered with beta
}

func (h *handler) RegisterPlugin(name, endpoint string, versions []string, timeout *time.Duration) error {
	if err := h.DRAPluginManager.RegisterPlugin(name, endpoint, versions, timeout); err != nil {
		return err
	}
	r := registration{Event: "registered", Driver: name, Endpoint: endpoint, Services: versions}
	h.mu.Lock()
	h.last[name] = r
	h.mu.Unlock()
	h.out.write(r)
	return nil
}

func (h *handler) DeRegisterPlugin(name, endpoint string) {
	h.DRAPluginManager.DeRegisterPlugin(name, endpoint)
	h.out.write(registration{Event: "deregistered", Driver: name, Endpoint: endpoint})
}

// plugin is the kubelet's DRAPlugin for driver speaking service: the plugin manager's own for
// v1, and for v1beta1 one registered with a second manager to which the plugin's endpoint is
// offered with v1beta1 alone, which is how the kubelet talks to a v1beta1-only plugin.
func (h *handler) plugin(driver, service string) (*draplugin.DRAPlugin, error) {
	switch service {
	case drapbv1.DRAPluginService:
		return h.GetPlugin(driver)
	case drapbv1beta1.DRAPluginService:
		h.mu.Lock()
		defer h.mu.Unlock()
		r, ok := h.last[driver]
		if !ok {
			return nil, fmt.Errorf("DRA driver %s is not registered", driver)
		}
		if h.betaFor[driver] != r.Endpoint {
			if old, ok := h.betaFor[driver]; ok {
				h.beta.DeRegisterPlugin(driver, old)
			}
			if err := h.beta.RegisterPlugin(driver, r.Endpoint, []string{drapbv1beta1.DRAPluginService}, nil); err != nil {
				return nil, err
			}
			h.betaFor[driver] = r.Endpoint
		}
		return h.beta.GetPlugin(driver)
	default:
		return nil, fmt.Errorf("unknown service %q", service)
	}
}

// streams forwards every health message the kubelet's manager receives.
type streams struct{ out *out }

func (s streams) HandleWatchResourcesStream(ctx context.Context, stream drahealthv1alpha1.DRAResourceHealth_NodeWatchResourcesClient, driver string) error {
	for {
		msg, err := stream.Recv()
		if err != nil {
			return err
		}
		b, err := proto.Marshal(msg)
		if err != nil {
			return err
		}
		s.out.write(healthEvent{Event: "health", Driver: driver, Response: base64.StdEncoding.EncodeToString(b)})
	}
}

func decode(b64 string, m proto.Message) error {
	b, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return fmt.Errorf("request: %w", err)
	}
	return proto.Unmarshal(b, m)
}

func encode(m proto.Message) (any, error) {
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, err
	}
	return encoded{Response: base64.StdEncoding.EncodeToString(b)}, nil
}

func main() {
	registryDir := flag.String("registry-dir", "", "watch this plugins_registry directory with the kubelet's plugin manager")
	verbosity := flag.String("v", "0", "klog verbosity (logs go to stderr)")
	flag.Parse()
	klogFlags := flag.NewFlagSet("klog", flag.ExitOnError)
	klog.InitFlags(klogFlags)
	_ = klogFlags.Set("v", *verbosity)
	_ = klogFlags.Set("logtostderr", "true")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	o := &out{enc: json.NewEncoder(os.Stdout)}
	s := streams{out: o}
	// No API client: the stand-in never wipes ResourceSlices, which a real kubelet does after a
	// plugin has been gone for 30 s.
	h := &handler{
		DRAPluginManager: draplugin.NewDRAPluginManager(ctx, nil, nil, s, 30*time.Second),
		out:              o,
		last:             map[string]registration{},
		beta:             draplugin.NewDRAPluginManager(ctx, nil, nil, nil, 30*time.Second),
		betaFor:          map[string]string{},
	}
	asw := cache.NewActualStateOfWorld()
	generator := operationexecutor.NewOperationGenerator(&record.FakeRecorder{})

	stop := make(chan struct{})
	if *registryDir != "" {
		pm := pluginmanager.NewPluginManager(*registryDir, &record.FakeRecorder{})
		pm.AddHandler(registerapi.DRAPlugin, h)
		go pm.Run(ctx, config.NewSourcesReady(func(sets.Set[string]) bool { return true }), stop)
	}

	var wg sync.WaitGroup
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	for in.Scan() {
		var c command
		if err := json.Unmarshal(in.Bytes(), &c); err != nil {
			o.write(reply{ID: -1, Error: fmt.Sprintf("bad command %q: %v", in.Text(), err)})
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ok, err := run(ctx, c, h, generator, asw)
			if err != nil {
				o.write(reply{ID: c.ID, Error: err.Error()})
				return
			}
			o.write(reply{ID: c.ID, OK: ok})
		}()
	}
	wg.Wait()
	close(stop)
	h.Stop()
	h.beta.Stop()
}

func run(ctx context.Context, c command, h *handler, generator operationexecutor.OperationGenerator, asw cache.ActualStateOfWorld) (any, error) {
	switch c.Op {
	case "register":
		if c.Socket == "" {
			return nil, errors.New("register: no socket")
		}
		uid := types.UID(fmt.Sprintf("%s-%d", c.Socket, time.Now().UnixNano()))
		if err := generator.GenerateRegisterPluginFunc(ctx, c.Socket, uid, map[string]cache.PluginHandler{registerapi.DRAPlugin: h}, asw)(); err != nil {
			return nil, err
		}
		for _, p := range asw.GetRegisteredPlugins() {
			if p.SocketPath == c.Socket {
				h.mu.Lock()
				r := h.last[p.Name]
				h.mu.Unlock()
				r.Event = ""
				return r, nil
			}
		}
		return nil, fmt.Errorf("register: %s registered but not recorded", c.Socket)
	case "prepare":
		p, err := h.plugin(c.Driver, c.Service)
		if err != nil {
			return nil, err
		}
		var req drapbv1.NodePrepareResourcesRequest
		if err := decode(c.Request, &req); err != nil {
			return nil, err
		}
		resp, err := p.NodePrepareResources(ctx, &req)
		if err != nil {
			return nil, err
		}
		return encode(resp)
	case "unprepare":
		p, err := h.plugin(c.Driver, c.Service)
		if err != nil {
			return nil, err
		}
		var req drapbv1.NodeUnprepareResourcesRequest
		if err := decode(c.Request, &req); err != nil {
			return nil, err
		}
		resp, err := p.NodeUnprepareResources(ctx, &req)
		if err != nil {
			return nil, err
		}
		return encode(resp)
	default:
		return nil, fmt.Errorf("unknown op %q", c.Op)
	}
}

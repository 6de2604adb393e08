// Command podresourceslist calls the kubelet's PodResources API with the kubelet's own client
// (k8s.io/kubernetes/pkg/kubelet/apis/podresources.GetV1Client at v1.36.3, the client DCGM
// exporter's pod mapper uses), so that tests compare drust's client with it: what each reads
// from the same kubelet, and how long each takes. Test tooling only.
//
// Usage: podresourceslist -socket PATH [-rounds N] [-pace DURATION]
//
// Each round dials the socket, calls List and closes the connection (as drust's client does),
// after sleeping -pace (the kubelet refuses more than 100 calls/s). Prints one JSON object:
// {"millisPerCall": mean over rounds, dial included, "pods": the last answer}, each pod as
// {"namespace","name","containers":[{"name","devices":[{"claimNamespace","claimName",
// "driver","pool","device","shareId"}]}]}.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	v1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
)

type device struct {
	ClaimNamespace string  `json:"claimNamespace"`
	ClaimName      string  `json:"claimName"`
	Driver         string  `json:"driver"`
	Pool           string  `json:"pool"`
	Device         string  `json:"device"`
	ShareID        *string `json:"shareId"`
}

type container struct {
	Name    string   `json:"name"`
	Devices []device `json:"devices"`
}

type pod struct {
	Namespace  string      `json:"namespace"`
	Name       string      `json:"name"`
	Containers []container `json:"containers"`
}

func list(socket string) (*v1.ListPodResourcesResponse, error) {
	client, conn, err := podresources.GetV1Client(socket, 5*time.Second, 16<<20)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return client.List(ctx, &v1.ListPodResourcesRequest{})
}

func main() {
	socket := flag.String("socket", "", "the kubelet's PodResources socket")
	rounds := flag.Int("rounds", 1, "calls to make")
	pace := flag.Duration("pace", 20*time.Millisecond, "pause before each call")
	flag.Parse()
	if *socket == "" || *rounds < 1 {
		fmt.Fprintln(os.Stderr, "usage: podresourceslist -socket PATH [-rounds N] [-pace D]")
		os.Exit(2)
	}
	var spent time.Duration
	var answer *v1.ListPodResourcesResponse
	for i := 0; i < *rounds; i++ {
		time.Sleep(*pace)
		start := time.Now()
		a, err := list(*socket)
		spent += time.Since(start)
		if err != nil {
			fmt.Fprintln(os.Stderr, "List:", err)
			os.Exit(1)
		}
		answer = a
	}
	pods := []pod{}
	for _, p := range answer.GetPodResources() {
		out := pod{Namespace: p.GetNamespace(), Name: p.GetName(), Containers: []container{}}
		for _, c := range p.GetContainers() {
			oc := container{Name: c.GetName(), Devices: []device{}}
			for _, d := range c.GetDynamicResources() {
				for _, r := range d.GetClaimResources() {
					oc.Devices = append(oc.Devices, device{
						ClaimNamespace: d.GetClaimNamespace(),
						ClaimName:      d.GetClaimName(),
						Driver:         r.GetDriverName(),
						Pool:           r.GetPoolName(),
						Device:         r.GetDeviceName(),
						ShareID:        r.ShareId,
					})
				}
			}
			out.Containers = append(out.Containers, oc)
		}
		pods = append(pods, out)
	}
	json.NewEncoder(os.Stdout).Encode(map[string]any{
		"millisPerCall": float64(spent.Microseconds()) / 1000 / float64(*rounds),
		"pods":          pods,
	})
}

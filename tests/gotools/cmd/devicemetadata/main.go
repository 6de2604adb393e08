// Command devicemetadata reads a DRA device metadata file (KEP-5304) with upstream's own reader,
// k8s.io/dynamic-resource-allocation/devicemetadata at v0.36.3, so that tests check that what
// drust writes is what upstream's consumers decode. Test tooling only.
//
// Usage, inside a container (upstream's in-container paths):
//
//	devicemetadata -driver D -pod-claim NAME -request R   (a claim made from a template)
//	devicemetadata -driver D -claim NAME -request R       (a claim named in the pod)
//
// or on the host: devicemetadata -file PATH. Prints one JSON object: {"name", "namespace",
// "uid", "generation", "podClaimName", "requests": [{"name", "devices": [{"driver", "pool",
// "name", "attributes"}]}]}; exits 1 with the reader's error.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/api/metadata"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
)

type device struct {
	Driver     string                                                    `json:"driver"`
	Pool       string                                                    `json:"pool"`
	Name       string                                                    `json:"name"`
	Attributes map[resourceapi.QualifiedName]resourceapi.DeviceAttribute `json:"attributes,omitempty"`
}

type request struct {
	Name    string   `json:"name"`
	Devices []device `json:"devices"`
}

type summary struct {
	Name         string    `json:"name"`
	Namespace    string    `json:"namespace"`
	UID          string    `json:"uid"`
	Generation   int64     `json:"generation"`
	PodClaimName *string   `json:"podClaimName,omitempty"`
	Requests     []request `json:"requests"`
}

func main() {
	driver := flag.String("driver", "", "the DRA driver's name")
	podClaim := flag.String("pod-claim", "", "the pod's name for a claim made from a template")
	claim := flag.String("claim", "", "the name of a claim named in the pod")
	req := flag.String("request", "", "the request")
	file := flag.String("file", "", "a metadata file on the host instead")
	flag.Parse()

	var (
		dm  *metadata.DeviceMetadata
		err error
	)
	switch {
	case *file != "":
		var f *os.File
		f, err = os.Open(*file)
		if err == nil {
			dm = &metadata.DeviceMetadata{}
			err = devicemetadata.DecodeMetadataFromStream(json.NewDecoder(f), dm)
			f.Close()
		}
	case *podClaim != "":
		dm, err = devicemetadata.ReadResourceClaimTemplateMetadataWithDriverName(*driver, *podClaim, *req)
	default:
		dm, err = devicemetadata.ReadResourceClaimMetadataWithDriverName(*driver, *claim, *req)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "devicemetadata:", err)
		os.Exit(1)
	}
	out := summary{
		Name:         dm.Name,
		Namespace:    dm.Namespace,
		UID:          string(dm.UID),
		Generation:   dm.Generation,
		PodClaimName: dm.PodClaimName,
	}
	for _, r := range dm.Requests {
		rq := request{Name: r.Name}
		for _, d := range r.Devices {
			rq.Devices = append(rq.Devices, device{Driver: d.Driver, Pool: d.Pool, Name: d.Name, Attributes: d.Attributes})
		}
		out.Requests = append(out.Requests, rq)
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "devicemetadata:", err)
		os.Exit(1)
	}
}

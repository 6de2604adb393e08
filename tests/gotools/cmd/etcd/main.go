// Command etcd is upstream etcd's server, built from the go.etcd.io/etcd/server/v3 module at the
// version k8s.io/kubernetes requires, so the test control plane needs no prebuilt download.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}

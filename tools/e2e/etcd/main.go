// etcd for the cluster session's API server (tools/e2e/builds.py builds it): the etcd server of
// the version go.mod requires, started as its own command starts it.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}

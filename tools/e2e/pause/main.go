// The e2e node's sandbox ("pause") image: nothing can be pulled there, so containerd's
// sandbox_image is built from this file (tools/e2e/images.py packs it into a docker-archive).
// It holds the pod's namespaces until it is told to stop, and reaps any child it inherits.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			return
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}

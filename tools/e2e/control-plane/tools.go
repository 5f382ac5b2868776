//go:build tools

// Package tools pins k8s.io/kubernetes in this module, so that `go build` of the control plane's
// three commands builds exactly the versions in go.mod and go.sum, the kubelet's version
// (tools/e2e/kubelet). tools/e2e/builds.py builds them; bump both modules together.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)

//go:build tools

// Package tools pins k8s.io/kubernetes in this module, so that
// `go build k8s.io/kubernetes/cmd/kubelet` builds exactly the versions in go.mod and go.sum.
// tools/e2e/kubelet_build.py builds it; bump KUBERNETES there and run `go mod tidy` here.
package tools

import _ "k8s.io/kubernetes/cmd/kubelet"

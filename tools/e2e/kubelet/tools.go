//go:build tools

// Package tools pins k8s.io/kubernetes in this module, so that
// `go build k8s.io/kubernetes/cmd/kubelet` builds exactly the versions in go.mod and go.sum.
// tools/e2e/builds.py builds it; to bump it, change the version here and in
// ../control-plane, then run `go mod tidy` in both.
package tools

import _ "k8s.io/kubernetes/cmd/kubelet"

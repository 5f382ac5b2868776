//go:build tools

// Package tools pins k8s.io/kubernetes at the oldest minor still supported upstream, so that the
// fleet check (tools/e2e/fleet.py) runs a kubelet of that generation beside the control plane's
// own (tools/e2e/kubelet). tools/e2e/builds.py builds it; to bump it, change the version in
// go.mod and its replace block, then run `go mod tidy`.
package tools

import _ "k8s.io/kubernetes/cmd/kubelet"

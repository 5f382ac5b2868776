//go:build tools

// Package tools pins k8s.io/kubernetes at the control plane's version (tools/e2e/control-plane),
// so that the cluster check drives it with a kubectl of its own minor, as kubectl's version skew
// policy asks, whatever kubectl the machine has. tools/e2e/builds.py builds it; bump it with the
// control plane.
package tools

import _ "k8s.io/kubernetes/cmd/kubectl"

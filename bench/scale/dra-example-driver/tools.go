//go:build tools

// Package tools pins the Go reference of the scale benchmark (bench/scale): the kubelet plugin
// of kubernetes-sigs/dra-example-driver at the version go.mod requires, which publishes its
// ResourceSlices through k8s.io/dynamic-resource-allocation's kubelet-plugin helper.
// bench/scale/builds.py builds it with this module's go.sum.
package tools

import (
	_ "sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin"
)

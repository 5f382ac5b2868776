//go:build tools

// Package tools pins containerd in this module, so that `go build` of its daemon, its runc shim
// and ctr builds exactly the versions in go.mod and go.sum. tools/e2e/builds.py builds them.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)

//go:build tools

// Package tools pins the main packages that build.sh compiles for the node.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubelet"
)

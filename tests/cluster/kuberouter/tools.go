//go:build tools

// Package tools pins the main package that build.sh compiles for the node's NetworkPolicies.
package tools

import (
	_ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
)

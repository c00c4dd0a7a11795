//go:build tools

// Package tools pins kwok's main package, which build.sh compiles.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"

//go:build tools

// Package tools pins Kueue's controller main package, which build.sh compiles.
package tools

import _ "sigs.k8s.io/kueue/cmd/kueue"

//go:build tools

// Package tools pins JobSet's controller main package (the module root, sigs.k8s.io/jobset),
// which build.sh compiles.
package tools

import _ "sigs.k8s.io/jobset"

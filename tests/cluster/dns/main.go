// Command coredns runs CoreDNS with the plugins the test node's Corefile uses, as CoreDNS's
// own guide to custom builds does: its plugin list, in the order they handle a query.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"log", "errors", "health", "ready", "cache", "kubernetes"}
}

func main() {
	coremain.Run()
}

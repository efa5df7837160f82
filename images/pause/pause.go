// The pod sandbox ("pause") image of the registry-free test nodes: holds the pod's
// namespaces, reaps orphans (it is PID 1 of pods sharing a PID namespace) and exits on
// SIGINT/SIGTERM. Built static by hack/build-images.sh with the machine's Go; it plays
// the part of registry.k8s.io/pause, which the tests may not pull.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}

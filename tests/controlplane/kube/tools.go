//go:build tools

// Package tools pins the Kubernetes commands the tests build: the real
// kube-apiserver and kubectl, and for the test node (issue 17)
// kube-controller-manager, kube-scheduler, kubelet and kube-proxy, all from
// the same k8s.io/kubernetes release.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kubectl"
)

//go:build tools

// Package tools pins the Kubernetes commands the tests build: the real
// kube-apiserver, kube-controller-manager (owner-reference garbage collection)
// and kubectl, all from the same k8s.io/kubernetes release.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kubectl"
)

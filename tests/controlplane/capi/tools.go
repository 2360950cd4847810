//go:build tools

// Package tools pins the Cluster API managers the tests build (issue 46,
// manager/tests/capi_core.rs): the core manager (Cluster, Machine,
// MachineSet, MachineDeployment controllers) and the kubeadm bootstrap
// manager (KubeadmConfig), both from the same sigs.k8s.io/cluster-api
// release. tests/setup.d/capi.sh builds them and copies their CRDs.
package tools

import (
	_ "sigs.k8s.io/cluster-api"
	_ "sigs.k8s.io/cluster-api/bootstrap/kubeadm"
)

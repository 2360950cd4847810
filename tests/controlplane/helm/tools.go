//go:build tools

// Package tools pins the Helm command the tests build (issue 43): helm lint
// and helm template over deploy/helm/anneal, their output dry-run against
// the real kube-apiserver (tests/tests/helm_chart.rs).
package tools

import (
	_ "helm.sh/helm/v4/cmd/helm"
)

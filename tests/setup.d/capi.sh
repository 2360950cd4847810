# Cluster API (issue 46): the core manager and the kubeadm bootstrap manager
# of sigs.k8s.io/cluster-api, pinned in tests/controlplane/capi (go.mod,
# tools.go), built with build_go like the kube-apiserver, and their CRDs
# (the core's and kubeadm bootstrap's config/crd/bases, no conversion
# webhook in them) copied from the Go module cache into
# $ANNEAL_CACHE/capi-crds (manager/tests/capi_core.rs installs them).
# Sourced by tests/setup.sh as root; a re-run on a ready machine is instant.
capi_dir="$here/controlplane/capi"
build_go "$capi_dir" capi-manager sigs.k8s.io/cluster-api
build_go "$capi_dir" capi-kubeadm-bootstrap-manager sigs.k8s.io/cluster-api/bootstrap/kubeadm
capi_mod=$(cd "$capi_dir" && go list -mod=readonly -m -f '{{.Dir}}' sigs.k8s.io/cluster-api)
rm -rf "$ANNEAL_CACHE/capi-crds.tmp"
mkdir -p "$ANNEAL_CACHE/capi-crds.tmp"
# (the module cache's files are read-only: install gives the copies 0644)
install -m 0644 "$capi_mod"/config/crd/bases/*.yaml \
  "$capi_mod"/bootstrap/kubeadm/config/crd/bases/*.yaml "$ANNEAL_CACHE/capi-crds.tmp/"
rm -rf "$ANNEAL_CACHE/capi-crds"
mv "$ANNEAL_CACHE/capi-crds.tmp" "$ANNEAL_CACHE/capi-crds"
unset capi_dir capi_mod

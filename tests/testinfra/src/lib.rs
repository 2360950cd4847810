//! Test infrastructure: a real local control plane, network namespaces and QEMU VMs.

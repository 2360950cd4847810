//! anneal.dev/v1alpha1 custom resource types (feature `crd`) and the agent
//! protocol types (always available, no cluster dependency).

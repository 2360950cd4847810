//! The committed CRD YAML under `deploy/base/crds/` must equal what the types
//! generate. Regenerate with:
//! `cargo run -p anneal-manager --bin manager -- crd --out-dir deploy/base/crds --reference-dir docs/reference`
//! (the Markdown CRD reference under `docs/reference/` is checked the same way).
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::too_many_lines)]

use std::path::Path;

#[test]
fn committed_crds_match_types() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/base/crds");
    let mut expected_files = Vec::new();
    for crd in anneal_api::crds() {
        let name = anneal_manager::crdgen::file_name(&crd);
        let want = anneal_manager::crdgen::render(&crd).unwrap();
        let got = std::fs::read_to_string(dir.join(&name)).unwrap_or_default();
        assert!(
            got == want,
            "deploy/base/crds/{name} drifted from the types; regenerate with \
             `cargo run -p anneal-manager --bin manager -- crd --out-dir deploy/base/crds`"
        );
        expected_files.push(name);
    }
    let crds = anneal_api::crds();
    let got = std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap_or_default();
    assert!(
        got == anneal_manager::crdgen::kustomization(&crds),
        "deploy/base/crds/kustomization.yaml drifted; regenerate with \
         `cargo run -p anneal-manager --bin manager -- crd --out-dir deploy/base/crds`"
    );
    expected_files.push("kustomization.yaml".into());
    let mut present: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    present.sort();
    expected_files.sort();
    assert_eq!(
        present, expected_files,
        "stale or missing files in deploy/base/crds/"
    );
}

#[test]
fn committed_reference_matches_types() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference");
    let crds = anneal_api::crds();
    let mut expected = vec![(
        "README.md".to_string(),
        anneal_manager::crdgen::reference_index(&crds),
    )];
    for crd in &crds {
        expected.push((
            anneal_manager::crdgen::reference_file_name(crd),
            anneal_manager::crdgen::reference(crd),
        ));
    }
    for (name, want) in &expected {
        let got = std::fs::read_to_string(dir.join(name)).unwrap_or_default();
        assert!(
            &got == want,
            "docs/reference/{name} drifted from the types; regenerate with \
             `cargo run -p anneal-manager --bin manager -- crd --out-dir deploy/base/crds \
             --reference-dir docs/reference`"
        );
    }
    let mut present: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .collect();
    present.sort();
    let mut names: Vec<String> = expected.into_iter().map(|(n, _)| n).collect();
    names.sort();
    assert_eq!(present, names, "stale or missing files in docs/reference/");
    // every field of Machine's spec is documented with its description
    let machine = std::fs::read_to_string(dir.join("machine.md")).unwrap();
    assert!(machine.contains("| `spec.bmc.address` |"), "{machine}");
}

#[test]
fn every_kind_is_namespaced_with_status_and_short_names() {
    for crd in anneal_api::crds() {
        // anneal.dev, and the Cluster API provider's group (docs/capi.md)
        assert!(
            [anneal_api::GROUP, anneal_api::capi::GROUP].contains(&crd.spec.group.as_str()),
            "{}",
            crd.spec.group
        );
        assert_eq!(crd.spec.scope, "Namespaced");
        assert!(
            crd.spec
                .names
                .short_names
                .as_ref()
                .is_some_and(|s| !s.is_empty())
        );
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert!(
            version
                .additional_printer_columns
                .as_ref()
                .is_some_and(|c| c.len() >= 2),
            "{} has printer columns",
            crd.spec.names.kind
        );
    }
}

/// No short name (or plural/singular) of ours shadows the short name of a
/// built-in kind, or of a peer a cluster running anneal commonly holds
/// (Cluster API, Tinkerbell, Metal3, Istio, cert-manager, Crossplane,
/// KubeVirt): `kubectl get pc` must keep listing PriorityClasses.
#[test]
fn short_names_shadow_no_common_kind() {
    // kubectl api-resources of Kubernetes 1.34 (built-ins) and of the peers
    const BUILT_IN: &[&str] = &[
        "cs", "cm", "ep", "ev", "limits", "ns", "no", "pvc", "pv", "po", "rc", "quota", "sa",
        "svc", "crd", "crds", "ds", "deploy", "rs", "sts", "hpa", "cj", "csr", "ing", "netpol",
        "pdb", "pc", "sc", "ingclass", "vac", "ipa",
    ];
    const CLUSTER_API: &[&str] = &["ma", "ms", "md", "mp", "mhc", "cl", "kcp", "cc"];
    const TINKERBELL: &[&str] = &["hw", "tpl", "wf"];
    const METAL3: &[&str] = &["bmh", "bmc", "hfs", "ppimg"];
    const ISTIO: &[&str] = &["dr", "vs", "gw", "se", "pa", "ra"];
    const CERT_MANAGER: &[&str] = &["cert", "certs", "cr", "crs"];
    const KUBEVIRT: &[&str] = &["vm", "vms", "vmi", "vmis", "dv"];
    let taken: Vec<&str> = [
        BUILT_IN,
        CLUSTER_API,
        TINKERBELL,
        METAL3,
        ISTIO,
        CERT_MANAGER,
        KUBEVIRT,
    ]
    .concat();
    for crd in anneal_api::crds() {
        let n = &crd.spec.names;
        for s in n.short_names.iter().flatten() {
            assert!(
                !taken.contains(&s.as_str()),
                "{}: short name {s} is another kind's",
                n.kind
            );
        }
    }
}

#![allow(clippy::too_many_lines)]
//! Short names as the real kube-apiserver serves them (docs/operators.md,
//! "Columns, short names, `kubectl get anneal`"): every built-in resource's
//! short names, plural and singular are listed through discovery, and no
//! anneal short name (nor plural, nor singular) is one of them, nor one of the
//! short names of the CRDs a bare-metal cluster commonly runs beside anneal
//! (hard-coded below with their sources), so `kubectl get pc` keeps listing
//! PriorityClasses and `kubectl get ma` Cluster API Machines. Once installed,
//! every anneal kind is served with its short names and in the category
//! `anneal` (`kubectl get anneal`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};

use anneal_testinfra::ControlPlane;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResource;

/// Short names (and a few singular names kubectl resolves the same way) of
/// the CRDs a cluster running anneal commonly holds, from each project's
/// kubebuilder markers (`+kubebuilder:resource:...shortName=...`):
const WIDESPREAD: &[(&str, &[&str])] = &[
    // kubernetes-sigs/cluster-api: api/core/v1beta2/{cluster,machine,
    // machineset,machinedeployment,machinehealthcheck,clusterclass,
    // machinedrainrule}_types.go, exp/api/.../machinepool_types.go,
    // controlplane/kubeadm/api/v1beta2/kubeadm_control_plane_types.go
    // (kcp), api/runtime/v1alpha1/extensionconfig_types.go (ext)
    (
        "Cluster API",
        &[
            "cl", "ma", "ms", "md", "mp", "mhc", "mhcs", "cc", "kcp", "mdr", "ext",
        ],
    ),
    // tinkerbell/tink api/v1alpha1/{hardware,template,workflow}_types.go
    ("Tinkerbell", &["hw", "tpl", "wf"]),
    // metal3-io/baremetal-operator apis/metal3.io/v1alpha1/
    // baremetalhost_types.go (bmh;bmhost), hostfirmwaresettings (hfs),
    // preprovisioningimage (ppimg), bmceventsubscription (bes),
    // hardwaredata (hd); metal3-io/cluster-api-provider-metal3 (m3c, m3m)
    (
        "Metal3",
        &["bmh", "bmhost", "hfs", "ppimg", "bes", "hd", "m3c", "m3m"],
    ),
    // cert-manager/cert-manager pkg/apis/certmanager/v1/types_*.go:
    // Certificate (cert;certs), CertificateRequest (cr;crs); Issuer,
    // ClusterIssuer, Order and Challenge by their singular names
    (
        "cert-manager",
        &[
            "cert",
            "certs",
            "cr",
            "crs",
            "issuer",
            "clusterissuer",
            "order",
            "challenge",
        ],
    ),
    // prometheus-operator/prometheus-operator pkg/apis/monitoring/v1*/
    // *_types.go (categories="prometheus-operator",shortName=...)
    (
        "Prometheus operator",
        &[
            "smon",
            "pmon",
            "prom",
            "promrule",
            "prb",
            "am",
            "amcfg",
            "scfg",
            "ruler",
            "promagent",
        ],
    ),
    // Istio networking.istio.io (dr, vs, gw, se), security.istio.io (pa, ra)
    ("Istio", &["dr", "vs", "gw", "se", "pa", "ra"]),
    // KubeVirt and CDI
    ("KubeVirt", &["vm", "vms", "vmi", "vmis", "dv"]),
];

/// Every (group/version, resource) the server lists, subresources left out.
async fn discover(client: &kube::Client) -> Vec<(String, APIResource)> {
    let mut out = Vec::new();
    let core = client.list_core_api_versions().await.unwrap();
    for v in core.versions {
        for r in client.list_core_api_resources(&v).await.unwrap().resources {
            out.push((v.clone(), r));
        }
    }
    for g in client.list_api_groups().await.unwrap().groups {
        for v in g.versions {
            let list = client
                .list_api_group_resources(&v.group_version)
                .await
                .unwrap();
            for r in list.resources {
                out.push((v.group_version.clone(), r));
            }
        }
    }
    out.retain(|(_, r)| !r.name.contains('/'));
    out
}

/// Discovery once /readyz answers ok and two listings a second apart agree.
async fn settled_discovery(client: &kube::Client) -> Vec<(String, APIResource)> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
        if client.request_text(req).await.is_ok_and(|t| t == "ok") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "/readyz not ok");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let key = |d: &[(String, APIResource)]| {
        d.iter()
            .map(|(gv, r)| format!("{gv}/{}", r.name))
            .collect::<BTreeSet<_>>()
    };
    let mut last = discover(client).await;
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let now = discover(client).await;
        if key(&now) == key(&last) {
            return now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "discovery never settled"
        );
        last = now;
    }
}

/// Each name `kubectl get NAME` resolves for a resource, with what it is.
fn names_of(gv: &str, r: &APIResource) -> Vec<(String, String)> {
    let what = format!("{} ({gv})", r.kind);
    let mut names = vec![(r.name.clone(), what.clone())];
    if !r.singular_name.is_empty() {
        names.push((r.singular_name.clone(), what.clone()));
    }
    for s in r.short_names.iter().flatten() {
        names.push((s.clone(), what.clone()));
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_short_name_collides_with_a_built_in_or_widespread_kind() {
    let cp = ControlPlane::start().await.unwrap();
    let client = cp.client();

    // Before anneal's CRDs exist, discovery lists only the built-ins (once
    // the server is ready: groups register after the first request works).
    let built_in = settled_discovery(&client).await;
    assert!(
        built_in
            .iter()
            .any(|(_, r)| r.short_names.iter().flatten().any(|s| s == "pc")),
        "discovery lists PriorityClass's short name pc"
    );
    let mut taken: BTreeMap<String, String> = BTreeMap::new();
    for (gv, r) in &built_in {
        for (name, what) in names_of(gv, r) {
            taken.entry(name).or_insert(what);
        }
    }
    for (project, names) in WIDESPREAD {
        for n in *names {
            taken
                .entry((*n).to_string())
                .or_insert_with(|| (*project).to_string());
        }
    }

    let crds = anneal_api::crds();
    let mut ours: BTreeSet<String> = BTreeSet::new();
    let mut collisions = Vec::new();
    for crd in &crds {
        let n = &crd.spec.names;
        let shorts = n.short_names.clone().unwrap_or_default();
        assert!(!shorts.is_empty(), "{} has no short name", n.kind);
        assert!(
            n.categories
                .as_deref()
                .unwrap_or_default()
                .contains(&"anneal".to_string()),
            "{} is not in the category anneal",
            n.kind
        );
        let singular = n.singular.clone().unwrap_or_default();
        // (a short name may repeat its own kind's singular: Site's `site`)
        let names: BTreeSet<&String> = shorts
            .iter()
            .chain([&n.plural, &singular])
            .filter(|s| !s.is_empty())
            .collect();
        for name in names {
            assert!(
                ours.insert(name.clone()),
                "{}: {name} is also another anneal kind's name",
                n.kind
            );
            if let Some(other) = taken.get(name) {
                collisions.push(format!("{}: {name} is {other}'s", n.kind));
            }
        }
    }
    assert!(collisions.is_empty(), "{collisions:#?}");

    // Installed, each kind is served with its short names and categories.
    cp.install_crds(&crds).await.unwrap();
    let after = discover(&client).await;
    for crd in &crds {
        let n = &crd.spec.names;
        let (_, served) = after
            .iter()
            .find(|(gv, r)| gv.starts_with(&format!("{}/", crd.spec.group)) && r.kind == n.kind)
            .unwrap_or_else(|| panic!("{} not in discovery", n.kind));
        assert_eq!(served.short_names, n.short_names, "{}", n.kind);
        assert!(
            served.categories.iter().flatten().any(|c| c == "anneal"),
            "{} is served outside the category anneal",
            n.kind
        );
    }
    // and a built-in short name still names the built-in kind alone
    let pc: Vec<_> = after
        .iter()
        .filter(|(_, r)| r.short_names.iter().flatten().any(|s| s == "pc"))
        .map(|(gv, r)| format!("{} ({gv})", r.kind))
        .collect();
    assert_eq!(pc, ["PriorityClass (scheduling.k8s.io/v1)"]);
}

//! Rendering the CustomResourceDefinitions as YAML (`manager crd`, the
//! committed files under `manager/crds/`).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

/// Errors rendering CRDs.
#[derive(Debug, thiserror::Error)]
pub enum CrdGenError {
    /// serialization failed
    #[error("rendering crd {name} as yaml")]
    Yaml {
        /// The CRD's name.
        name: String,
        /// The cause.
        #[source]
        source: serde_saphyr::SerializeError,
    },
}

/// One CRD as a YAML document (no leading `---`).
pub fn render(crd: &CustomResourceDefinition) -> Result<String, CrdGenError> {
    serde_saphyr::to_string(crd).map_err(|source| CrdGenError::Yaml {
        name: crd.metadata.name.clone().unwrap_or_default(),
        source,
    })
}

/// Every CRD as one multi-document YAML stream.
pub fn render_all() -> Result<String, CrdGenError> {
    let mut out = String::new();
    for crd in anneal_api::crds() {
        out.push_str("---\n");
        out.push_str(&render(&crd)?);
    }
    Ok(out)
}

/// File name under `manager/crds/` for a CRD: `<plural>.<group>.yaml`.
pub fn file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}.yaml", crd.metadata.name.as_deref().unwrap_or("unnamed"))
}

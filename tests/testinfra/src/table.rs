//! `kubectl get` as the real API server renders it: a kind's Table
//! (`application/json;as=Table;v=v1;g=meta.k8s.io`), built from the CRD's
//! printer columns.

use serde_json::Value;

/// The Table of `plural` (group anneal.dev, v1alpha1) in namespace `ns`.
pub async fn get_table(client: &kube::Client, ns: &str, plural: &str) -> anyhow::Result<Value> {
    let req = http::Request::get(format!(
        "/apis/anneal.dev/v1alpha1/namespaces/{ns}/{plural}"
    ))
    .header(
        "Accept",
        "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
    )
    .body(Vec::new())?;
    let t: Value = client.request(req).await?;
    anyhow::ensure!(t["kind"] == "Table", "not a Table: {t}");
    Ok(t)
}

/// Column names (priority 0 only unless `wide`) and the cells of row `row`
/// under them; empty when the row does not exist.
pub fn table_row(t: &Value, row: usize, wide: bool) -> (Vec<String>, Vec<Value>) {
    let defs = t["columnDefinitions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let cells = t["rows"][row]["cells"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut names = Vec::new();
    let mut values = Vec::new();
    for (d, c) in defs.iter().zip(cells) {
        if wide || d["priority"].as_i64().unwrap_or(0) == 0 {
            names.push(d["name"].as_str().unwrap_or_default().to_string());
            values.push(c);
        }
    }
    (names, values)
}

/// The row whose Name cell is `name`, as (column, cell) pairs (wide).
pub fn table_row_named(t: &Value, name: &str) -> Option<Vec<(String, Value)>> {
    let rows = t["rows"].as_array()?;
    (0..rows.len()).find_map(|i| {
        let (names, values) = table_row(t, i, true);
        let pairs: Vec<(String, Value)> = names.into_iter().zip(values).collect();
        pairs
            .iter()
            .any(|(n, v)| n == "Name" && v == name)
            .then_some(pairs)
    })
}

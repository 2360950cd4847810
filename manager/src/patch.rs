//! JSON merge patches (RFC 7386) computed from the difference between the
//! object read and the object wanted: fields a controller does not change
//! are never touched by its write.

use serde_json::{Map, Value};

/// A JSON merge patch (RFC 7386) turning `old` into `new`: changed and new
/// keys carry their new value, removed keys `null`; arrays are replaced.
/// None when nothing changed.
pub fn merge_diff(old: &Value, new: &Value) -> Option<Value> {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut out = Map::new();
            for (k, nv) in n {
                match o.get(k) {
                    Some(ov) => {
                        if let Some(d) = merge_diff(ov, nv) {
                            out.insert(k.clone(), d);
                        }
                    }
                    None => {
                        out.insert(k.clone(), nv.clone());
                    }
                }
            }
            for k in o.keys() {
                if !n.contains_key(k) {
                    out.insert(k.clone(), Value::Null);
                }
            }
            if out.is_empty() {
                None
            } else {
                Some(Value::Object(out))
            }
        }
        (o, n) if o == n => None,
        (_, n) => Some(n.clone()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_diff_nulls_removed_keys() {
        let old = json!({"a": 1, "n": {"h": "x", "e": "t"}, "gone": true, "l": [1]});
        let new = json!({"a": 1, "n": {"e": "t"}, "l": [1, 2], "new": "v"});
        assert_eq!(
            merge_diff(&old, &new).unwrap(),
            json!({"n": {"h": null}, "gone": null, "l": [1, 2], "new": "v"})
        );
        assert_eq!(merge_diff(&old, &old), None);
    }

    #[test]
    fn merge_diff_replaces_scalars_and_whole_arrays() {
        assert_eq!(merge_diff(&json!(1), &json!(2)), Some(json!(2)));
        assert_eq!(
            merge_diff(&json!({"l": [1, 2]}), &json!({"l": [2]})),
            Some(json!({"l": [2]}))
        );
        assert_eq!(merge_diff(&json!({"a": null}), &json!({"a": null})), None);
    }
}

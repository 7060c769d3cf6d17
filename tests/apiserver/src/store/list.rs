//! Lists of the store: consistent snapshots at an older revision (from the event log),
//! pagination with continue tokens and `remainingItemCount`, and the 410 answers to
//! compacted resourceVersions and continue tokens.

use super::meta::parse_rv;
use super::{ns_prefix, Kind, Store};
use crate::error::ApiError;
use crate::selector::Selectors;
use base64::Engine as _;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;

/// Parameters of a list request.
#[derive(Debug, Clone, Default)]
pub struct ListOpts {
    /// Restrict to one namespace.
    pub namespace: Option<String>,
    /// Label and field selectors.
    pub selectors: Selectors,
    /// Page size (`limit`); None or 0 means all.
    pub limit: Option<usize>,
    /// Continue token of a previous page.
    pub continue_token: Option<String>,
    /// `resourceVersion` parameter.
    pub resource_version: Option<String>,
    /// `resourceVersionMatch` parameter.
    pub resource_version_match: Option<String>,
}

/// One page of a list: shares the stored objects, serialised outside the store lock.
#[derive(Debug, Clone)]
pub struct ListPage {
    /// Kind of the items.
    pub kind: Kind,
    /// The list's `metadata` (resourceVersion, continue, remainingItemCount).
    pub metadata: Value,
    /// The objects.
    pub items: Vec<Arc<Value>>,
}

impl ListPage {
    /// Serialise as a `<Kind>List` JSON document.
    pub fn to_json_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(256 + self.items.len() * 1024);
        out.extend_from_slice(
            format!(
                "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":",
                self.kind.kind(),
                self.kind.api_version()
            )
            .as_bytes(),
        );
        // Writing JSON values into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut out, &self.metadata);
        out.extend_from_slice(b",\"items\":[");
        for (i, item) in self.items.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let _ = serde_json::to_writer(&mut out, item.as_ref());
        }
        out.extend_from_slice(b"]}");
        out
    }

    /// The page as a JSON value.
    pub fn to_value(&self) -> Value {
        json!({
            "kind": format!("{}List", self.kind.kind()),
            "apiVersion": self.kind.api_version(),
            "metadata": self.metadata,
            "items": self.items.iter().map(|i| (**i).clone()).collect::<Vec<_>>(),
        })
    }
}

/// Decoded continue token.
#[derive(serde::Serialize, serde::Deserialize)]
struct ContinueToken {
    v: String,
    rv: u64,
    start: String,
    /// Items returned by earlier pages (for remainingItemCount).
    #[serde(default)]
    off: usize,
}

fn encode_continue(rv: u64, last_key: &str, off: usize) -> String {
    let t = ContinueToken {
        v: "meta.k8s.io/v1".into(),
        rv,
        start: last_key.to_string(),
        off,
    };
    let raw = serde_json::to_vec(&t).expect("continue token serializes");
    base64::engine::general_purpose::URL_SAFE.encode(raw)
}

fn decode_continue(s: &str) -> Result<ContinueToken, ApiError> {
    let bad = || ApiError::BadRequest {
        message: format!("continue key is not valid: {s:?}"),
    };
    let raw = base64::engine::general_purpose::URL_SAFE.decode(s).map_err(|_| bad())?;
    let t: ContinueToken = serde_json::from_slice(&raw).map_err(|_| bad())?;
    if t.v != "meta.k8s.io/v1" {
        return Err(bad());
    }
    Ok(t)
}

/// Message of the 410 answered to a too-old continue token (as the real server words it).
pub const CONTINUE_EXPIRED: &str = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.";

impl Store {
    /// State of the keys of `kind` that changed after `rv` as they were at `rv`.
    fn overrides(&self, kind: Kind, rv: u64) -> BTreeMap<String, Option<Arc<Value>>> {
        let mut out = BTreeMap::new();
        for e in self.history.iter().rev() {
            if e.rev <= rv {
                break;
            }
            if e.kind == kind {
                out.insert(e.key.clone(), e.prev.clone());
            }
        }
        out
    }

    /// Objects of `kind` at revision `rv` (which must be >= the compaction point), in key
    /// order, starting after `after` and restricted to keys with `prefix`.
    pub fn snapshot_iter<'a>(
        &'a self,
        kind: Kind,
        rv: u64,
        prefix: &'a str,
        after: Option<&'a str>,
        overrides: &'a BTreeMap<String, Option<Arc<Value>>>,
    ) -> impl Iterator<Item = (&'a String, &'a Arc<Value>)> + 'a {
        let _ = rv;
        let owned_after = after.map(str::to_string);
        let lower: (Bound<String>, Bound<String>) = match owned_after {
            Some(a) => (Bound::Excluded(a), Bound::Unbounded),
            None => (Bound::Included(prefix.to_string()), Bound::Unbounded),
        };
        let mut base = self.objects[kind.idx()]
            .range(lower.clone())
            .filter(move |(k, _)| !overrides.contains_key(*k))
            .peekable();
        let mut over = overrides
            .range(lower)
            .filter_map(|(k, v)| v.as_ref().map(|v| (k, v)))
            .peekable();
        std::iter::from_fn(move || {
            let take_base = match (base.peek(), over.peek()) {
                (None, None) => return None,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some((bk, _)), Some((ok, _))) => bk < ok,
            };
            if take_base {
                base.next()
            } else {
                over.next()
            }
        })
        .take_while(move |(k, _)| k.starts_with(prefix))
    }

    /// Number of objects with keys under `prefix` at the snapshot described by `overrides`.
    fn count_at(&self, kind: Kind, prefix: &str, overrides: &BTreeMap<String, Option<Arc<Value>>>) -> usize {
        let current = match prefix.strip_suffix('/') {
            Some(ns) => self.ns_counts[kind.idx()].get(ns).copied().unwrap_or(0),
            None => self.objects[kind.idx()].len(),
        };
        let map = &self.objects[kind.idx()];
        let (mut plus, mut minus) = (0usize, 0usize);
        for (k, v) in overrides.iter().filter(|(k, _)| k.starts_with(prefix)) {
            if map.contains_key(k) {
                minus += 1;
            }
            if v.is_some() {
                plus += 1;
            }
        }
        (current + plus).saturating_sub(minus)
    }

    /// List objects (GET on a collection), returning one page of the `<Kind>List`.
    pub fn list(&self, kind: Kind, opts: &ListOpts) -> Result<ListPage, ApiError> {
        let nonempty = |o: &Option<String>| o.as_deref().filter(|s| !s.is_empty()).map(str::to_string);
        let rv_param = nonempty(&opts.resource_version);
        let mut offset = 0usize;
        let (snap_rv, after) = if let Some(c) = nonempty(&opts.continue_token) {
            if rv_param.is_some() {
                return Err(ApiError::BadRequest {
                    message: "specifying resource version is not allowed when using continue".into(),
                });
            }
            let t = decode_continue(&c)?;
            if t.rv < self.compacted {
                return Err(ApiError::Expired {
                    message: CONTINUE_EXPIRED.into(),
                });
            }
            if t.rv > self.rev {
                return Err(ApiError::BadRequest {
                    message: format!("continue key is not valid: revision {} is in the future", t.rv),
                });
            }
            offset = t.off;
            (t.rv, Some(t.start))
        } else {
            match rv_param.as_deref() {
                None | Some("0") => (self.rev, None),
                Some(s) => {
                    let n = parse_rv(s)?;
                    if n > self.rev {
                        return Err(ApiError::TooLargeResourceVersion {
                            requested: n,
                            current: self.rev,
                        });
                    }
                    if opts.resource_version_match.as_deref() == Some("Exact") {
                        self.check_not_compacted(n)?;
                        (n, None)
                    } else {
                        (self.rev, None)
                    }
                }
            }
        };
        let overrides = if snap_rv < self.rev {
            self.overrides(kind, snap_rv)
        } else {
            BTreeMap::new()
        };
        let prefix = ns_prefix(kind, opts.namespace.as_deref());
        let limit = opts.limit.filter(|l| *l > 0);
        let mut iter = self
            .snapshot_iter(kind, snap_rv, &prefix, after.as_deref(), &overrides)
            .filter(|(_, o)| opts.selectors.matches(o));
        let mut items = Vec::new();
        let mut last_key = None;
        for (k, o) in iter.by_ref() {
            items.push(o.clone());
            last_key = Some(k.clone());
            if limit.is_some_and(|l| items.len() >= l) {
                break;
            }
        }
        let mut metadata = json!({"resourceVersion": snap_rv.to_string()});
        if limit.is_some_and(|l| items.len() >= l) && iter.next().is_some() {
            let returned = offset + items.len();
            metadata["continue"] = json!(encode_continue(snap_rv, last_key.as_deref().unwrap_or(""), returned));
            if opts.selectors.is_empty() {
                let total = self.count_at(kind, &prefix, &overrides);
                metadata["remainingItemCount"] = json!(total.saturating_sub(returned));
            }
        }
        Ok(ListPage { kind, metadata, items })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> Value {
        json!({"metadata": {"name": name, "labels": {"app": "x"}},
               "spec": {"containers": [{"name": "c", "image": "i:1"}]}})
    }

    #[test]
    fn pages_count_remaining_items_at_the_snapshot() {
        let mut s = Store::new(true, 1_000_000);
        for ns in ["a", "b"] {
            s.create(Kind::Namespace, None, json!({"metadata": {"name": ns}}))
                .unwrap();
        }
        for i in 0..250 {
            s.create(Kind::Pod, Some("a"), pod(&format!("p{i:03}"))).unwrap();
        }
        s.create(Kind::Pod, Some("b"), pod("other")).unwrap();
        let mut opts = ListOpts {
            namespace: Some("a".into()),
            limit: Some(100),
            ..Default::default()
        };
        let first = s.list(Kind::Pod, &opts).unwrap();
        assert_eq!(first.metadata["remainingItemCount"], 150);
        // Changes after the first page: one deletion ahead, one creation ahead, one in "b".
        s.delete(Kind::Pod, Some("a"), "p180", None, None).unwrap();
        s.create(Kind::Pod, Some("a"), pod("p150x")).unwrap();
        s.create(Kind::Pod, Some("b"), pod("other2")).unwrap();
        opts.continue_token = first.metadata["continue"].as_str().map(str::to_string);
        let second = s.list(Kind::Pod, &opts).unwrap();
        assert_eq!(second.metadata["remainingItemCount"], 50);
        let names: Vec<&str> = second
            .items
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names.first(), Some(&"p100"));
        assert!(names.contains(&"p180") && !names.contains(&"p150x"));
        opts.continue_token = second.metadata["continue"].as_str().map(str::to_string);
        let third = s.list(Kind::Pod, &opts).unwrap();
        assert_eq!(third.items.len(), 50);
        assert!(third.metadata.get("continue").is_none());
        // The serialised page is the same document as the value form.
        let v: Value = serde_json::from_slice(&third.to_json_bytes()).unwrap();
        assert_eq!(v, third.to_value());
        assert_eq!(v["kind"], "PodList");
        // Current state: 250 pods in "a".
        opts.continue_token = None;
        opts.limit = None;
        assert_eq!(s.list(Kind::Pod, &opts).unwrap().items.len(), 250);
    }
}

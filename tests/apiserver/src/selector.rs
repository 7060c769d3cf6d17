//! Label selectors and field selectors as accepted in `labelSelector=` / `fieldSelector=`.

use crate::error::ApiError;
use serde_json::Value;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelReq {
    /// `key=value` / `key==value`.
    Eq(String, String),
    /// `key!=value` (also true when the key is absent).
    NotEq(String, String),
    /// `key in (a,b)`.
    In(String, Vec<String>),
    /// `key notin (a,b)` (also true when the key is absent).
    NotIn(String, Vec<String>),
    /// `key`.
    Exists(String),
    /// `!key`.
    DoesNotExist(String),
}

/// A parsed label selector: the AND of its requirements.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    /// The requirements, all of which must hold.
    pub reqs: Vec<LabelReq>,
}

/// Split on commas that are not inside parentheses.
fn split_top(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => {
                depth += 1;
                cur.push(c)
            }
            ')' => {
                depth -= 1;
                cur.push(c)
            }
            ',' if depth == 0 => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out
}

fn bad(kind: &str, sel: &str, why: &str) -> ApiError {
    ApiError::BadRequest {
        message: format!("unable to parse requirement: {kind} selector {sel:?}: {why}"),
    }
}

fn parse_set(rest: &str, sel: &str) -> Result<Vec<String>, ApiError> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| bad("label", sel, "expected '(' value list ')'"))?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

impl LabelSelector {
    /// Parse the string form (`a=b,c!=d,e in (x,y),f notin (z),g,!h`).
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self { reqs });
        }
        for part in split_top(s) {
            let p = part.trim();
            if p.is_empty() {
                return Err(bad("label", s, "empty requirement"));
            }
            if let Some(k) = p.strip_prefix('!') {
                reqs.push(LabelReq::DoesNotExist(k.trim().to_string()));
            } else if let Some((k, v)) = p.split_once("!=") {
                reqs.push(LabelReq::NotEq(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = p.split_once("==") {
                reqs.push(LabelReq::Eq(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = p.split_once('=') {
                reqs.push(LabelReq::Eq(k.trim().into(), v.trim().into()));
            } else if let Some(idx) = p.find(" notin ") {
                let vals = parse_set(&p[idx + 7..], s)?;
                reqs.push(LabelReq::NotIn(p[..idx].trim().into(), vals));
            } else if let Some(idx) = p.find(" in ") {
                let vals = parse_set(&p[idx + 4..], s)?;
                reqs.push(LabelReq::In(p[..idx].trim().into(), vals));
            } else if p.contains(char::is_whitespace) || p.contains('(') {
                return Err(bad("label", s, "unknown operator"));
            } else {
                reqs.push(LabelReq::Exists(p.to_string()));
            }
        }
        for r in &reqs {
            let key = match r {
                LabelReq::Eq(k, _)
                | LabelReq::NotEq(k, _)
                | LabelReq::In(k, _)
                | LabelReq::NotIn(k, _)
                | LabelReq::Exists(k)
                | LabelReq::DoesNotExist(k) => k,
            };
            if key.is_empty() {
                return Err(bad("label", s, "empty key"));
            }
        }
        Ok(Self { reqs })
    }

    /// Whether an object (its `metadata.labels`) satisfies the selector.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels");
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.reqs.iter().all(|r| match r {
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => get(k).is_none_or(|x| !vs.iter().any(|v| v == x)),
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::DoesNotExist(k) => get(k).is_none(),
        })
    }
}

/// A parsed field selector: the AND of `field=value` / `field!=value` terms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    /// `(field path, value, negated)` terms.
    pub terms: Vec<(String, String, bool)>,
}

impl FieldSelector {
    /// Parse and check the fields against those the resource supports.
    pub fn parse(s: &str, supported: &[&str]) -> Result<Self, ApiError> {
        let mut terms = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self { terms });
        }
        for part in s.split(',') {
            let p = part.trim();
            let (k, v, neg) = if let Some((k, v)) = p.split_once("!=") {
                (k, v, true)
            } else if let Some((k, v)) = p.split_once("==") {
                (k, v, false)
            } else if let Some((k, v)) = p.split_once('=') {
                (k, v, false)
            } else {
                return Err(bad("field", s, "expected field=value or field!=value"));
            };
            let k = k.trim();
            if !supported.contains(&k) {
                return Err(ApiError::BadRequest {
                    message: format!("field label not supported: {k}"),
                });
            }
            terms.push((k.to_string(), v.trim().to_string(), neg));
        }
        Ok(Self { terms })
    }

    /// Whether the object satisfies the selector (an absent field compares as "").
    pub fn matches(&self, obj: &Value) -> bool {
        self.terms.iter().all(|(path, want, neg)| {
            let ptr = format!("/{}", path.replace('.', "/"));
            let got = match obj.pointer(&ptr) {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            (got == *want) != *neg
        })
    }
}

/// Label and field selector together.
#[derive(Debug, Clone, Default)]
pub struct Selectors {
    /// The label selector.
    pub labels: LabelSelector,
    /// The field selector.
    pub fields: FieldSelector,
}

impl Selectors {
    /// Whether the object satisfies both selectors.
    pub fn matches(&self, obj: &Value) -> bool {
        self.labels.matches(obj) && self.fields.matches(obj)
    }

    /// Whether both selectors are empty.
    pub fn is_empty(&self) -> bool {
        self.labels.reqs.is_empty() && self.fields.terms.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_selector_forms() {
        let pod = json!({"metadata": {"labels": {"app": "web", "tier": "fe", "empty": ""}}});
        let ok = |s: &str| LabelSelector::parse(s).unwrap().matches(&pod);
        assert!(ok("app=web"));
        assert!(ok("app==web,tier=fe"));
        assert!(!ok("app=db"));
        assert!(ok("app!=db"));
        assert!(ok("missing!=x"));
        assert!(ok("app in (db, web)"));
        assert!(!ok("app in (db)"));
        assert!(ok("missing notin (x)"));
        assert!(!ok("app notin (web)"));
        assert!(ok("empty"));
        assert!(ok("!missing"));
        assert!(!ok("!app"));
        assert!(ok(""));
        assert!(LabelSelector::parse("app in x").is_err());
    }

    #[test]
    fn field_selector_forms() {
        let pod = json!({"metadata": {"name": "a", "namespace": "ns"}, "spec": {"nodeName": "n1"}});
        let sup = ["metadata.name", "spec.nodeName", "status.phase"];
        let ok = |s: &str| FieldSelector::parse(s, &sup).unwrap().matches(&pod);
        assert!(ok("metadata.name=a"));
        assert!(ok("spec.nodeName=n1,metadata.name!=b"));
        assert!(!ok("spec.nodeName=n2"));
        assert!(ok("status.phase="));
        assert!(FieldSelector::parse("spec.bogus=x", &sup).is_err());
    }
}

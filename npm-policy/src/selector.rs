//! Label selector matching: `matchLabels` AND `matchExpressions`.
//!
//! Spec (§4): "`In` requires the key to be present with a listed value.
//! `NotIn` is satisfied when the key is **absent** or its value is not
//! listed. `Exists` is satisfied by a key with an empty value.
//! `DoesNotExist`." The empty selector matches everything.

use crate::model::{Labels, Operator, Requirement, Selector};

/// True when `labels` satisfy `requirement`.
pub fn requirement_matches(requirement: &Requirement, labels: &Labels) -> bool {
    let value = labels.get(&requirement.key);
    match requirement.operator {
        Operator::In => value.is_some_and(|v| requirement.values.iter().any(|x| x == v)),
        // NotIn matches absent keys.
        Operator::NotIn => value.is_none_or(|v| !requirement.values.iter().any(|x| x == v)),
        // Exists matches a key with an empty value too.
        Operator::Exists => value.is_some(),
        Operator::DoesNotExist => value.is_none(),
    }
}

impl Selector {
    /// True when `labels` satisfy every matchLabels pair and every
    /// matchExpressions requirement.
    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| requirement_matches(r, labels))
    }

    /// True for the empty selector `{}` (matches everything).
    pub fn is_empty(&self) -> bool {
        self.match_labels.is_empty() && self.match_expressions.is_empty()
    }
}

/// Renders a selector in the kubectl style (`a=b,c in (d,e),!f`); `{}` for
/// the empty selector.
pub fn render(selector: &Selector) -> String {
    if selector.is_empty() {
        return "{}".to_string();
    }
    let mut parts: Vec<String> = selector.match_labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    for r in &selector.match_expressions {
        parts.push(match r.operator {
            Operator::In => format!("{} in ({})", r.key, r.values.join(",")),
            Operator::NotIn => format!("{} notin ({})", r.key, r.values.join(",")),
            Operator::Exists => r.key.clone(),
            Operator::DoesNotExist => format!("!{}", r.key),
        });
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }
    fn req(key: &str, operator: Operator, values: &[&str]) -> Requirement {
        Requirement {
            key: key.into(),
            operator,
            values: values.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn table() {
        let l = labels(&[("app", "web"), ("empty", "")]);
        let cases: Vec<(Selector, bool)> = vec![
            (Selector::default(), true),
            (
                Selector {
                    match_labels: labels(&[("app", "web")]),
                    ..Default::default()
                },
                true,
            ),
            (
                Selector {
                    match_labels: labels(&[("app", "db")]),
                    ..Default::default()
                },
                false,
            ),
            (
                Selector {
                    match_labels: labels(&[("x", "")]),
                    ..Default::default()
                },
                false,
            ),
            (
                Selector {
                    match_expressions: vec![req("app", Operator::In, &["db", "web"])],
                    ..Default::default()
                },
                true,
            ),
            (
                Selector {
                    match_expressions: vec![req("app", Operator::In, &["db"])],
                    ..Default::default()
                },
                false,
            ),
            (
                Selector {
                    match_expressions: vec![req("nope", Operator::In, &["db"])],
                    ..Default::default()
                },
                false,
            ),
            (
                Selector {
                    match_expressions: vec![req("nope", Operator::NotIn, &["db"])],
                    ..Default::default()
                },
                true,
            ),
            (
                Selector {
                    match_expressions: vec![req("app", Operator::NotIn, &["web"])],
                    ..Default::default()
                },
                false,
            ),
            (
                Selector {
                    match_expressions: vec![req("empty", Operator::Exists, &[])],
                    ..Default::default()
                },
                true,
            ),
            (
                Selector {
                    match_expressions: vec![req("nope", Operator::Exists, &[])],
                    ..Default::default()
                },
                false,
            ),
            (
                Selector {
                    match_expressions: vec![req("nope", Operator::DoesNotExist, &[])],
                    ..Default::default()
                },
                true,
            ),
            (
                Selector {
                    match_expressions: vec![req("app", Operator::DoesNotExist, &[])],
                    ..Default::default()
                },
                false,
            ),
            (
                Selector {
                    match_labels: labels(&[("app", "web")]),
                    match_expressions: vec![req("app", Operator::NotIn, &["web"])],
                },
                false,
            ),
        ];
        for (i, (s, want)) in cases.iter().enumerate() {
            assert_eq!(s.matches(&l), *want, "case {i}: {}", render(s));
        }
    }
}

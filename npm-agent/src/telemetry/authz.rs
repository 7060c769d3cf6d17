//! Who may read the named series of `/metrics`: the bearer token of a
//! scrape is authenticated by a `TokenReview` and authorized by a
//! `SubjectAccessReview` of `get` on the non-resource URL `/metrics`, as
//! the kubelet, kube-rbac-proxy and controller-runtime's metrics filter do
//! (the agent's service account needs `create` on both reviews: the
//! chart's ClusterRole grants it). A grant is what a cluster role with
//! `nonResourceURLs: ["/metrics"], verbs: ["get"]` bound to the caller
//! gives.
//!
//! Decisions are cached per token (a grant for [`ALLOW_TTL`], a refusal
//! for [`DENY_TTL`], at most [`CACHE_MAX`] tokens), so that a Prometheus
//! scraping every 15 s costs the API server two reviews every two minutes;
//! a failed review is never cached and answers 503 (fail closed: no named
//! series without a decision).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::{Api, PostParams};

/// How long a granted token is trusted without a new review.
pub const ALLOW_TTL: Duration = Duration::from_secs(120);
/// How long a refused token is refused without a new review.
pub const DENY_TTL: Duration = Duration::from_secs(10);
/// Tokens whose decision is cached at most (then the cache starts over).
pub const CACHE_MAX: usize = 256;
/// The longest bearer token reviewed (service-account tokens are ~1 KiB).
const TOKEN_MAX: usize = 16 * 1024;

/// The non-resource URL a caller needs `get` on.
pub const METRICS_PATH: &str = "/metrics";

/// Errors of a review.
#[derive(Debug, thiserror::Error)]
pub enum AuthzError {
    /// The API server did not answer the TokenReview.
    #[error("TokenReview failed: {0}")]
    TokenReview(#[source] kube::Error),
    /// The API server did not answer the SubjectAccessReview.
    #[error("SubjectAccessReview failed: {0}")]
    AccessReview(#[source] kube::Error),
}

/// The decision on one scrape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// No `Authorization` header: the public exposition.
    Anonymous,
    /// The token is granted `get` on `/metrics`.
    Allowed,
    /// A malformed header or a token the API server does not authenticate (401).
    Unauthenticated(String),
    /// An authenticated user without the grant (403).
    Forbidden(String),
}

/// The reviews of scrape tokens, with their cache.
pub struct MetricsAuth {
    client: kube::Client,
    cache: Mutex<HashMap<String, (Decision, Instant)>>,
}

impl std::fmt::Debug for MetricsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsAuth").finish_non_exhaustive()
    }
}

/// The bearer token of `headers`: `None` without an `Authorization`
/// header, `Some(Err)` for one that is not `Bearer <token>`.
fn bearer(headers: &HeaderMap) -> Option<Result<&str, &'static str>> {
    let v = headers.get(header::AUTHORIZATION)?;
    let token = v
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .filter(|t| !t.is_empty());
    Some(match token {
        None => Err("the Authorization header is not a bearer token"),
        Some(t) if t.len() > TOKEN_MAX => Err("the bearer token is too long"),
        Some(t) => Ok(t),
    })
}

impl MetricsAuth {
    /// Reviews through `client` (the agent's own credentials).
    pub fn new(client: kube::Client) -> Self {
        MetricsAuth {
            client,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The decision on a request carrying `headers`.
    pub async fn decide(&self, headers: &HeaderMap) -> Result<Decision, AuthzError> {
        let token = match bearer(headers) {
            None => return Ok(Decision::Anonymous),
            Some(Err(why)) => return Ok(Decision::Unauthenticated(why.into())),
            Some(Ok(t)) => t,
        };
        if let Some(d) = self.cached(token) {
            return Ok(d);
        }
        let d = self.review(token).await?;
        self.remember(token, &d);
        Ok(d)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Decision, Instant)>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cached(&self, token: &str) -> Option<Decision> {
        let c = self.lock();
        let (d, until) = c.get(token)?;
        (Instant::now() < *until).then(|| d.clone())
    }

    fn remember(&self, token: &str, d: &Decision) {
        let now = Instant::now();
        let ttl = if *d == Decision::Allowed { ALLOW_TTL } else { DENY_TTL };
        let mut c = self.lock();
        if c.len() >= CACHE_MAX {
            c.retain(|_, (_, until)| *until > now);
            if c.len() >= CACHE_MAX {
                c.clear();
            }
        }
        c.insert(token.to_string(), (d.clone(), now + ttl));
    }

    /// A TokenReview of `token`, then a SubjectAccessReview of its user.
    async fn review(&self, token: &str) -> Result<Decision, AuthzError> {
        let tr = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                ..Default::default()
            },
            ..Default::default()
        };
        let tr = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &tr)
            .await
            .map_err(AuthzError::TokenReview)?;
        let status = tr.status.unwrap_or_default();
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(u)) => u,
            _ => {
                let why = status.error.unwrap_or_else(|| "the token is not authenticated".into());
                return Ok(Decision::Unauthenticated(why));
            }
        };
        let name = user.username.clone().unwrap_or_default();
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(METRICS_PATH.into()),
                    verb: Some("get".into()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let sar = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &sar)
            .await
            .map_err(AuthzError::AccessReview)?;
        let status = sar.status.unwrap_or_default();
        if status.allowed && status.denied != Some(true) {
            Ok(Decision::Allowed)
        } else {
            Ok(Decision::Forbidden(format!(
                "user \"{name}\" cannot get path \"{METRICS_PATH}\""
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(v: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = v {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer(&headers(None)), None);
        assert_eq!(bearer(&headers(Some("Bearer abc"))), Some(Ok("abc")));
        assert!(matches!(bearer(&headers(Some("Basic abc"))), Some(Err(_))));
        assert!(matches!(bearer(&headers(Some("Bearer "))), Some(Err(_))));
        let long = format!("Bearer {}", "a".repeat(TOKEN_MAX + 1));
        assert!(matches!(bearer(&headers(Some(&long))), Some(Err(_))));
    }
}

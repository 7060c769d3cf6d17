//! The task that writes the local pods' npm conditions: a queue of the
//! pods whose conditions differ from what they carry, drained at most
//! `qps` patches a second (bursts of `burst`: a token bucket), each pod
//! patched for its latest reason only. After a failed request the writer
//! waits (500 ms, doubling up to 60 s, reset by a success).
//!
//! What a pod carries is read once (a `GET` of `pods/{name}`, not a write:
//! after an agent restart a pod already `True` is never written again nor
//! turned `False`) and then kept from the patches' answers. A pod the API
//! server no longer has, or that is another pod now (404, 409, 422: the
//! patch names the uid), is dropped; another error leaves it queued,
//! behind the others. `npm_pod_condition_writes_total{result}` counts the
//! patches, `npm_pod_condition_pending` the pods waiting for one.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{conditions_for, patch, Current, Desired};
use crate::telemetry::metrics::Metrics;

/// The first wait after a failed request of the writer.
const MIN_ERROR_BACKOFF: Duration = Duration::from_millis(500);
/// The longest wait after failed requests.
const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(60);

/// The writer's rate limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PodConditionsConfig {
    /// Patches a second, sustained (`--pod-condition-qps`).
    pub qps: f64,
    /// Patches at once after a quiet time (`--pod-condition-burst`).
    pub burst: u32,
}

impl Default for PodConditionsConfig {
    fn default() -> Self {
        PodConditionsConfig { qps: 5.0, burst: 20 }
    }
}

/// Where the sync loop publishes each sync's [`Desired`] set (cheap to
/// clone; never blocks).
#[derive(Clone, Debug)]
pub struct PodConditions {
    tx: Arc<watch::Sender<Arc<Desired>>>,
}

impl PodConditions {
    /// Hand the writer the local pods' reasons of the sync just made (the
    /// whole set: a pod missing from it is no longer written).
    pub fn publish(&self, desired: Desired) {
        self.tx.send_if_modified(|d| {
            if **d == desired {
                false
            } else {
                *d = Arc::new(desired);
                true
            }
        });
    }
}

/// A token bucket of `burst` tokens refilled at `qps` a second.
#[derive(Debug)]
pub struct TokenBucket {
    qps: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// A full bucket (a `qps` below 0.001 is taken as 0.001).
    pub fn new(cfg: PodConditionsConfig) -> TokenBucket {
        let burst = f64::from(cfg.burst.max(1));
        TokenBucket {
            qps: cfg.qps.max(0.001),
            burst,
            tokens: burst,
            at: Instant::now(),
        }
    }

    /// Take a token at `now` if there is one, else say how long until
    /// there is.
    pub fn try_take_at(&mut self, now: Instant) -> Result<(), Duration> {
        self.tokens = (self.tokens + now.saturating_duration_since(self.at).as_secs_f64() * self.qps).min(self.burst);
        self.at = self.at.max(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / self.qps))
        }
    }

    /// Wait until a token is there and take it.
    pub async fn take(&mut self) {
        while let Err(wait) = self.try_take_at(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
    }
}

/// Start the writer on the current runtime: it patches the conditions of
/// the pods the returned handle is given, as `cfg` allows.
pub fn spawn(
    client: kube::Client,
    cfg: PodConditionsConfig,
    metrics: Metrics,
) -> (PodConditions, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(Arc::new(Desired::new()));
    let task = tokio::spawn(run(rx, client, cfg, metrics));
    (PodConditions { tx: Arc::new(tx) }, task)
}

/// The writer's memory: what each pod carries (`None`: not read yet).
#[derive(Default)]
struct Queue {
    known: HashMap<String, Option<Current>>,
    pending: VecDeque<String>,
}

impl Queue {
    /// Queue every pod of `desired` whose conditions would change; forget
    /// the pods no longer in it.
    fn refresh(&mut self, desired: &Desired) {
        self.known.retain(|uid, _| desired.contains_key(uid));
        self.pending.clear();
        for (uid, state) in desired {
            let due = match self.known.entry(uid.clone()).or_insert(None) {
                None => true,
                Some(cur) => conditions_for(cur, state.reason) != Current::default(),
            };
            if due {
                self.pending.push_back(uid.clone());
            }
        }
    }
}

async fn run(mut rx: watch::Receiver<Arc<Desired>>, client: kube::Client, cfg: PodConditionsConfig, metrics: Metrics) {
    let mut bucket = TokenBucket::new(cfg);
    let mut q = Queue::default();
    let mut desired = Arc::new(Desired::new());
    // After a failed request, the wait before the next one (doubling up to
    // `MAX_ERROR_BACKOFF`; a success resets it): a refused grant or an
    // unavailable API server is not hammered at `qps`.
    let mut backoff = MIN_ERROR_BACKOFF;
    loop {
        if rx.has_changed().unwrap_or(false) {
            desired = rx.borrow_and_update().clone();
            q.refresh(&desired);
        }
        metrics.pod_condition_pending(q.pending.len());
        let Some(uid) = q.pending.pop_front() else {
            if rx.changed().await.is_err() {
                return;
            }
            // `changed` marks the value seen: take it here.
            desired = rx.borrow_and_update().clone();
            q.refresh(&desired);
            continue;
        };
        let Some(state) = desired.get(&uid) else { continue };
        let api: Api<Pod> = Api::namespaced(client.clone(), &state.namespace);
        let current = match q.known.get(&uid).cloned().flatten() {
            Some(c) => c,
            None => match api.get_opt(&state.name).await {
                Ok(Some(pod)) if pod.metadata.uid.as_deref() == Some(uid.as_str()) => {
                    let c = Current::of(pod.status.and_then(|s| s.conditions).as_deref().unwrap_or(&[]));
                    q.known.insert(uid.clone(), Some(c.clone()));
                    c
                }
                // Gone, or another pod of that name now.
                Ok(_) => {
                    q.known.remove(&uid);
                    continue;
                }
                Err(e) => {
                    tracing::debug!(pod = %format!("{}/{}", state.namespace, state.name), error = %e, "reading the pod's conditions failed; retrying");
                    q.pending.push_back(uid);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_ERROR_BACKOFF);
                    continue;
                }
            },
        };
        if conditions_for(&current, state.reason) == Current::default() {
            continue;
        }
        bucket.take().await;
        // The state may have changed while waiting for the token: write the
        // pod's latest reason (the token is spent on this pod either way,
        // so a stream of changes never starves the writes).
        if rx.has_changed().unwrap_or(false) {
            desired = rx.borrow_and_update().clone();
            q.refresh(&desired);
            q.pending.retain(|u| *u != uid);
        }
        let Some(state) = desired.get(&uid) else { continue };
        let api: Api<Pod> = Api::namespaced(client.clone(), &state.namespace);
        let next = conditions_for(&current, state.reason);
        if next == Current::default() {
            continue;
        }
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let now = serde_json::to_value(&now).ok();
        let body = patch(
            &uid,
            &current,
            &next,
            now.as_ref().and_then(|v| v.as_str()).unwrap_or_default(),
        );
        match api
            .patch_status(&state.name, &PatchParams::default(), &Patch::Strategic(body))
            .await
        {
            Ok(pod) => {
                backoff = MIN_ERROR_BACKOFF;
                metrics.pod_condition_write("ok");
                let c = Current::of(pod.status.and_then(|s| s.conditions).as_deref().unwrap_or(&[]));
                q.known.insert(uid, Some(c));
            }
            Err(kube::Error::Api(e)) if matches!(e.code, 404 | 409 | 422) => {
                metrics.pod_condition_write("gone");
                tracing::debug!(pod = %format!("{}/{}", state.namespace, state.name), error = %e, "pod gone or replaced; its condition is not written");
                q.known.remove(&uid);
            }
            Err(e) => {
                metrics.pod_condition_write("error");
                tracing::warn!(pod = %format!("{}/{}", state.namespace, state.name), error = %e, "writing the pod's npm.io/PolicyEnforced condition failed; retrying");
                q.known.insert(uid.clone(), None);
                q.pending.push_back(uid);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_ERROR_BACKOFF);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_allows_a_burst_then_qps() {
        let cfg = PodConditionsConfig { qps: 5.0, burst: 20 };
        let mut b = TokenBucket::new(cfg);
        let t0 = b.at;
        for _ in 0..20 {
            assert_eq!(b.try_take_at(t0), Ok(()), "the burst is there at once");
        }
        let wait = b.try_take_at(t0).expect_err("empty");
        assert!((wait.as_secs_f64() - 0.2).abs() < 1e-6, "{wait:?}");
        // Over 20 s, 100 more and no more: qps x seconds.
        let mut taken = 0;
        for ms in (0..=20_000).step_by(10) {
            while b.try_take_at(t0 + Duration::from_millis(ms)).is_ok() {
                taken += 1;
            }
        }
        assert_eq!(taken, 100);
        // A quiet minute refills the burst, not more.
        let later = t0 + Duration::from_secs(80);
        let burst = std::iter::from_fn(|| b.try_take_at(later).ok()).take(100).count();
        assert_eq!(burst, 20);
    }
}

//! Claims of deleting pods that outlive their grace period (incident 1
//! across nodes). When a pod of another node is deleted, its IP goes back
//! to that node's IPAM as soon as its sandbox is torn down and may be given
//! to a new pod at once; until the new owner's status reaches this node,
//! the deleting pod is the address's only claimant here, and its identity
//! (its policies' peers, its Admin Deny) would follow the address to the
//! new owner. A deleting pod whose deletion this agent has seen for longer
//! than its grace period (`metadata.deletionGracePeriodSeconds`, 30 s when
//! absent) plus [`DEFAULT_SLACK`] claims no address any more: the address
//! gets no pod identity (only its CIDR identity) until its next owner
//! arrives.
//!
//! Decided on this agent's own monotonic clock, from when it first saw the
//! pod deleting (never from the API server's `deletionTimestamp`, which
//! another clock wrote). Only pods of other nodes: a local pod's address is
//! attested by npm-cni, and its endpoint follows its interface. A held sync
//! ([`super::hold`]) is built from the objects last programmed, after this
//! stage, so a held removal never expires anything.
//!
//! What this trades: a pod of a node cut off from the API server stays
//! deleting while it may still run; past its grace period its traffic is
//! judged as its address's CIDR, not as the pod.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::k8s::pods::Pod;
use crate::k8s::{ObjKey, Objects};

/// The time past a deleting pod's grace period before it loses its claim:
/// the kubelet's own kill and status write after the grace period, and the
/// other node's watch delay.
pub const DEFAULT_SLACK: Duration = Duration::from_secs(10);

/// The grace period of a deletion without `deletionGracePeriodSeconds`
/// (the API server's default for pods).
const DEFAULT_GRACE: Duration = Duration::from_secs(30);

/// Suffix of the resourceVersion of a pod whose claim expired, so that the
/// compiler's object diff sees the copy as a change.
const EXPIRED_RV: &str = "+claim-expired";

/// A deleting pod of another node, as first seen.
#[derive(Clone, Debug)]
struct Deleting {
    uid: Option<String>,
    since: Instant,
    grace: Duration,
}

/// What [`DeletionClock::apply`] made of a sync's pods.
#[derive(Clone, Debug)]
pub struct Expired {
    /// The pods, with the expired claimants' addresses removed.
    pub pods: Objects<Pod>,
    /// How many claims expired.
    pub expired: usize,
    /// When the next claim expires (the sync loop wakes then).
    pub next: Option<Instant>,
}

/// When this agent first saw each deleting pod of another node.
#[derive(Debug)]
pub struct DeletionClock {
    last: Objects<Pod>,
    deleting: HashMap<ObjKey, Deleting>,
    slack: Duration,
}

impl DeletionClock {
    /// A clock with `slack` past each grace period.
    pub fn new(slack: Duration) -> DeletionClock {
        DeletionClock {
            last: Objects::new(),
            deleting: HashMap::new(),
            slack,
        }
    }

    /// Bring the clock up to `pods` (the complete state this sync
    /// compiles) at `now`, and return `pods` with the addresses of the
    /// expired claimants removed. The work follows the change since the
    /// last call (an object diff), not the number of pods.
    pub fn apply(&mut self, pods: &Objects<Pod>, node: &str, now: Instant) -> Expired {
        let (upserts, removed) = self.last.diff(pods);
        for key in removed {
            self.deleting.remove(&key);
        }
        for pod in upserts {
            let key = crate::k8s::key_of(pod.as_ref());
            if !is_remote_claimant(&pod, node) || pod.metadata.deletion_timestamp.is_none() {
                self.deleting.remove(&key);
                continue;
            }
            let uid = pod.metadata.uid.clone();
            let grace = pod
                .metadata
                .deletion_grace_period_seconds
                .map_or(DEFAULT_GRACE, |s| Duration::from_secs(s.max(0).unsigned_abs()));
            match self.deleting.get_mut(&key) {
                // The same pod, still deleting: its clock runs on (a
                // shorter grace period, as a second delete may set, counts).
                Some(d) if d.uid == uid => d.grace = d.grace.min(grace),
                _ => {
                    self.deleting.insert(key, Deleting { uid, since: now, grace });
                }
            }
        }
        self.last = pods.clone();
        let mut out = pods.clone();
        let mut expired = 0;
        let mut next: Option<Instant> = None;
        for (key, d) in &self.deleting {
            let at = d.since + d.grace + self.slack;
            if now < at {
                next = Some(next.map_or(at, |n| n.min(at)));
                continue;
            }
            let Some(pod) = pods.get(key) else { continue };
            out.insert(Arc::new(without_addresses(pod)));
            expired += 1;
        }
        Expired {
            pods: out,
            expired,
            next,
        }
    }
}

/// Whether `pod` is another node's pod with an address it could claim.
fn is_remote_claimant(pod: &Pod, node: &str) -> bool {
    let spec = pod.spec.as_ref();
    let elsewhere = spec.and_then(|s| s.node_name.as_deref()).is_some_and(|n| n != node);
    let host_network = spec.and_then(|s| s.host_network).unwrap_or(false);
    let addressed = pod
        .status
        .as_ref()
        .is_some_and(|s| s.pod_ip.is_some() || s.pod_ips.as_ref().is_some_and(|v| !v.is_empty()));
    elsewhere && !host_network && addressed
}

/// A copy of `pod` that claims no address.
fn without_addresses(pod: &Pod) -> Pod {
    let mut p = pod.clone();
    if let Some(s) = p.status.as_mut() {
        s.pod_ip = None;
        s.pod_ips = None;
    }
    let rv = p.metadata.resource_version.take().unwrap_or_default();
    p.metadata.resource_version = Some(format!("{rv}{EXPIRED_RV}"));
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::pods::{PodSpec, PodStatus};
    use k8s_openapi::api::core::v1::PodIP;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn pod(name: &str, uid: &str, node: &str, deleting: Option<i64>) -> Arc<Pod> {
        Arc::new(Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("app".into()),
                uid: Some(uid.into()),
                resource_version: Some(format!("{uid}-{deleting:?}")),
                deletion_timestamp: deleting.map(|_| Time(k8s_openapi::jiff::Timestamp::now())),
                deletion_grace_period_seconds: deleting,
                ..ObjectMeta::default()
            },
            labels: Default::default(),
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                pod_ip: Some("10.0.0.5".into()),
                pod_ips: Some(vec![PodIP { ip: "10.0.0.5".into() }]),
            }),
        })
    }

    fn ip_of(pods: &Objects<Pod>, name: &str) -> Option<String> {
        pods.get(&("app".into(), name.into()))
            .and_then(|p| p.status.as_ref()?.pod_ip.clone())
    }

    #[test]
    fn a_remote_claim_expires_after_grace_and_slack_on_the_agents_clock() {
        let slack = Duration::from_secs(2);
        let mut clock = DeletionClock::new(slack);
        let t0 = Instant::now();
        let mut pods: Objects<Pod> = [pod("old", "u1", "node-b", None), pod("local", "u2", "node-a", Some(0))]
            .into_iter()
            .collect();
        let e = clock.apply(&pods, "node-a", t0);
        assert_eq!((e.expired, e.next), (0, None), "nothing deleting elsewhere");
        // Deleted with a 5 s grace period, first seen at t0 + 1 s.
        pods.insert(pod("old", "u1", "node-b", Some(5)));
        let seen = t0 + Duration::from_secs(1);
        let e = clock.apply(&pods, "node-a", seen);
        assert_eq!(e.expired, 0);
        assert_eq!(e.next, Some(seen + Duration::from_secs(7)));
        assert_eq!(ip_of(&e.pods, "old").as_deref(), Some("10.0.0.5"));
        // Nothing changes; the clock still runs from when it was first seen.
        let e = clock.apply(&pods, "node-a", seen + Duration::from_secs(6));
        assert_eq!(e.expired, 0);
        let e = clock.apply(&pods, "node-a", seen + Duration::from_secs(7));
        assert_eq!(e.expired, 1);
        assert_eq!(ip_of(&e.pods, "old"), None, "the expired claimant claims nothing");
        assert_ne!(
            e.pods
                .get(&("app".into(), "old".into()))
                .unwrap()
                .metadata
                .resource_version,
            pods.get(&("app".into(), "old".into()))
                .unwrap()
                .metadata
                .resource_version,
            "the copy is a change to the compiler's diff"
        );
        // A local deleting pod never expires here (npm-cni attests it).
        assert_eq!(ip_of(&e.pods, "local").as_deref(), Some("10.0.0.5"));
        // The pod is gone: forgotten; a new pod under the same name starts
        // a clock of its own.
        pods.remove(&("app".into(), "old".into()));
        let e = clock.apply(&pods, "node-a", seen + Duration::from_secs(8));
        assert_eq!((e.expired, e.next), (0, None));
        pods.insert(pod("old", "u3", "node-b", Some(5)));
        let later = seen + Duration::from_secs(9);
        let e = clock.apply(&pods, "node-a", later);
        assert_eq!((e.expired, e.next), (0, Some(later + Duration::from_secs(7))));
    }

    #[test]
    fn without_a_grace_period_the_default_counts() {
        let mut clock = DeletionClock::new(Duration::ZERO);
        let mut p = (*pod("old", "u1", "node-b", Some(1))).clone();
        p.metadata.deletion_grace_period_seconds = None;
        let pods: Objects<Pod> = [Arc::new(p)].into_iter().collect();
        let t0 = Instant::now();
        assert_eq!(clock.apply(&pods, "node-a", t0).next, Some(t0 + DEFAULT_GRACE));
    }
}

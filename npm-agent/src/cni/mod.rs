//! The agent side of npm-cni: a new pod is never reachable before its
//! policies are enforced.
//!
//! npm-cni (the chained CNI plugin) tells the agent over a unix socket
//! ([`server`], `--cni-socket`, protocol [`npm_cni::proto`]) which pod got
//! which host-side veth and addresses, before the kubelet publishes
//! `status.podIPs`. These are **facts about this node only** ([`facts`]);
//! the API server stays the truth for labels, policies and other nodes.
//!
//! - **ADD** records the attachment (the pod's uid, `namespace/name`,
//!   container id, ifname, its veth, checked in sysfs ([`veth`]): never a
//!   bridge, and the veth's ifindex, the addresses), wakes the sync loop,
//!   and answers only once a successful sync has programmed the pod's
//!   endpoint with these addresses on this veth, i.e. with every policy that
//!   selects the pod ([`handler`]). A pod the cache does not hold yet, or an
//!   agent that has not completed its first full list, is waited for, up to
//!   a bound (30 s by default); then the answer is an error with `retry`.
//! - **DEL** drops the attachment and tombstones the pod: its endpoint and
//!   its addresses are evicted at once, whatever the API object (which may
//!   linger with its old addresses) says; the answer follows the eviction
//!   sync. The tombstone goes when the pod object is gone, or with a new ADD
//!   of that pod. CHECK answers whether the endpoint is programmed, STATUS
//!   whether a full sync was applied on this node since it booted, by this
//!   agent or an earlier one ([`status`]), GC drops the attachments of a
//!   network that the runtime no longer lists.
//! - **Static pods**: the runtime passes the static pod's uid; the API
//!   object is its mirror pod, with another uid and the static one in
//!   `kubernetes.io/config.mirror`. A mirror pod whose static pod the facts
//!   hold under the same namespace and name is compiled under the static
//!   uid (`reconcile::compiler`), so its endpoint is the attachment's.
//! - A background pass ([`handler::maintain`]) drops an attachment whose veth
//!   vanished without a DEL (as a DEL), and lifts tombstones of pods that
//!   are gone.
//!
//! **The overlay.** Where the sync loop converts pods for the compiler
//! (`reconcile::compiler`), the facts are applied to each converted pod
//! before IP ownership is decided ([`facts::NodeFacts::overlay`]), so the
//! one ownership rule of the compiler decides on them, and the facts are
//! part of the level-triggered state: a change of the facts marks the pods
//! it touches changed for the incremental compile. The sync loop puts each
//! attached endpoint on its attachment's veth, whatever route lookup finds.
//!
//! **IP ownership with CNI facts (incident 1).** An address that CNI ADD
//! told the agent for a live local attachment (recorded, not deleted, its
//! veth still present; of two attachments claiming one address, the later
//! ADD) is current truth on this node: the attached pod (matched by uid)
//! gets exactly the attachment's addresses, and every other pod object
//! claiming such an address loses that claim (its copy is stale: the node
//! routes the address into this sandbox). A tombstoned pod claims no
//! address and has no endpoint. All remaining claims are ranked by the
//! compiler's ownership rule as before (live, then newest, then uid).
//!
//! **Restarts.** The facts are written atomically to
//! [`persist::STATE_FILE_NAME`] in the socket's directory on every change;
//! a restarted agent starts from them.

pub mod chain;
pub mod facts;
pub mod handle;
pub mod handler;
pub mod persist;
pub mod server;
pub mod status;
pub mod veth;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use chain::{ChainConfig, CHECK_CNI_CHAINED};
pub use facts::{Attachment, NodeFacts, Programmed, ProgrammedEndpoint};
pub use handle::FactsHandle;
pub use server::CniServerError;

use crate::k8s::Cache;
use crate::telemetry::health::Health;
use crate::telemetry::metrics::Metrics;

/// Default longest wait of an ADD, DEL or GC for its sync.
pub const DEFAULT_WAIT_BOUND: Duration = Duration::from_secs(30);

/// Settings of the CNI server.
#[derive(Clone, Debug)]
pub struct CniConfig {
    /// The unix socket (the state file is next to it).
    pub socket: PathBuf,
    /// Longest wait of an ADD, DEL or GC for its sync.
    pub wait_bound: Duration,
    /// Keep npm-cni chained in the primary CNI's conflist ([`chain`];
    /// `None`: the agent does not look at the conflist). Also makes a local
    /// endpoint that appears with no ADD suspect (logged and counted).
    pub keep_chained: Option<ChainConfig>,
}

impl CniConfig {
    /// The server on `socket`, with the default wait bound, not keeping
    /// npm-cni chained.
    pub fn new(socket: PathBuf) -> CniConfig {
        CniConfig {
            socket,
            wait_bound: DEFAULT_WAIT_BOUND,
            keep_chained: None,
        }
    }
}

/// What the request handlers read and change.
#[derive(Clone)]
pub struct CniContext {
    /// The facts, shared with the sync loop.
    pub facts: FactsHandle,
    /// The agent's cache (waking the sync loop, diagnosing a wait).
    pub cache: Arc<Cache>,
    /// The first-sync flag (STATUS).
    pub readiness: Arc<Health>,
    /// "A full sync was applied on this node since it booted" (STATUS:
    /// [`status`]).
    pub sync_marker: Arc<status::SyncMarker>,
    /// Metrics.
    pub metrics: Metrics,
    /// This node's name.
    pub node_name: String,
    /// Longest wait of an ADD, DEL or GC for its sync.
    pub wait_bound: Duration,
}

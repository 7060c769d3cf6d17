//! Rate-limited flow logs of the datapath's events, with names: deny
//! events, and the allow events of new connections of the endpoints that
//! report them (`report_new`: `--flow-logs-allow`, audit mode; see
//! `crate::reconcile::report_new`).
//!
//! Both dataplanes give the same events ([`DenyEvent`], its verdict told by
//! [`DenyEvent::is_allow`]): eBPF from its ring buffer `NPM_EVENTS`,
//! nftables from NFLOG ([`npm_dataplane::nft::nflog`]).
//!
//! # Where to hook in
//!
//! - [`FlowLog::log_all`] names every event ([`Names::record`]) and writes
//!   what the rate allows as JSON lines to its writer (stdout; the live
//!   stream of `npm-agent observe` tees that writer);
//! - [`FlowLog::on_allow`] registers a consumer that receives EVERY allow
//!   event with its named record, before and regardless of the rate limit
//!   (audit mode's would-deny evaluation): `(event, record)`, in the order
//!   the datapath reported them.
//!
//! Each event becomes one JSON line ([`FlowRecord`], `"verdict":"allow"` or
//! `"deny"`): the
//! pod the event is about (namespace/name), the peer (another pod by
//! namespace/name, this node, another node by name: `node/<name>`, or the
//! world with the longest matching CIDR of the policies), the direction and reason, the 5-tuple, and the
//! policies that isolate the pod in that direction (namespace/name). A
//! deny of a ClusterNetworkPolicy tier (`admin-deny`, `baseline-deny`)
//! names the tier and, when the programmed state still decides the packet
//! that way (`npm_policy::lookup` on it gives the same reason), the CNP and
//! the index of its rule. The names come from the state the agent last
//! programmed ([`Names`]: the compiled endpoints, ipcache and tier entries,
//! the snapshot's pods and policies), so the log says what the agent
//! believed when it read the event.
//!
//! At most `per_sec` deny events and `per_sec` allow events are logged per
//! one-second window (`--flow-logs-per-sec`, a budget per verdict, so
//! allowed connections never crowd out denies); the rest are counted, and
//! the count is logged (to the tracing log) when the window closes.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use npm_common::{DenyEvent, Reason};
use npm_policy::compile::policy_selects;
use npm_policy::compiled::{Compiled, Direction, RuleRef};
use npm_policy::model::Snapshot;
use serde::Serialize;

/// A consumer of every allow event with its named record
/// ([`FlowLog::on_allow`]).
pub type AllowSink = Box<dyn FnMut(&DenyEvent, &FlowRecord) + Send>;

/// The rate limiter and writer of flow logs.
pub struct FlowLog {
    per_sec: u32,
    window: Option<Instant>,
    /// Lines logged in the window: deny, allow.
    logged: [u32; 2],
    /// Lines suppressed in the window: deny, allow.
    suppressed: [u64; 2],
    out: Box<dyn Write + Send>,
    allow_sinks: Vec<AllowSink>,
    log_allows: bool,
}

impl std::fmt::Debug for FlowLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowLog")
            .field("per_sec", &self.per_sec)
            .field("logged", &self.logged)
            .field("suppressed", &self.suppressed)
            .finish_non_exhaustive()
    }
}

/// Whether one event may be logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Log it.
    Log,
    /// Over the rate: count it.
    Suppress,
}

fn addr(family: u8, bytes: [u8; 16]) -> IpAddr {
    if family == 4 {
        IpAddr::V4(Ipv4Addr::new(bytes[12], bytes[13], bytes[14], bytes[15]))
    } else {
        IpAddr::V6(Ipv6Addr::from(bytes))
    }
}

fn direction(e: &DenyEvent) -> &'static str {
    if e.direction == npm_common::DIR_INGRESS {
        "ingress"
    } else {
        "egress"
    }
}

fn protocol(p: u8) -> String {
    match p {
        1 => "ICMP".into(),
        6 => "TCP".into(),
        17 => "UDP".into(),
        58 => "ICMPv6".into(),
        132 => "SCTP".into(),
        n => n.to_string(),
    }
}

fn clock_ns(clock: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec out-pointer.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

/// The wall-clock time, RFC 3339 in UTC, of the `CLOCK_MONOTONIC` time
/// `ts_ns` of an event (both dataplanes stamp events with it: eBPF's
/// `bpf_ktime_get_ns`, the NFLOG reader when it reads the packet); an
/// event without a time or from the future is stamped now.
pub fn wall_time(ts_ns: u64) -> String {
    let (real, mono) = (clock_ns(libc::CLOCK_REALTIME), clock_ns(libc::CLOCK_MONOTONIC));
    let ago = mono - i128::from(ts_ns);
    let at = if ts_ns == 0 || ago < 0 { real } else { real - ago };
    k8s_openapi::jiff::Timestamp::from_nanosecond(at)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// The record's verdict of an event: `allow` or `deny`.
pub fn verdict(e: &DenyEvent) -> &'static str {
    if e.is_allow() {
        "allow"
    } else {
        "deny"
    }
}

/// One line describing an event by ids and addresses only.
pub fn describe(e: &DenyEvent) -> String {
    let reason = Reason::from_u8(e.reason).map(Reason::name).unwrap_or("unknown");
    format!(
        "{} endpoint={} ifindex={} dir={} reason={reason} proto={} {}:{} -> {}:{}",
        verdict(e),
        e.endpoint,
        e.ifindex,
        direction(e),
        e.protocol,
        addr(e.family, e.src),
        e.sport,
        addr(e.family, e.dst),
        e.dport
    )
}

/// A pod by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PodName {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

/// The other end of a denied packet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Peer {
    /// A pod of the cluster.
    Pod {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// This node.
    Host,
    /// Another node of the cluster (an address of its `status.addresses`,
    /// known by its node identity): printed `node/<name>`.
    Node {
        /// The Node's name.
        name: String,
    },
    /// Outside the cluster's pods: `cidr` is the longest prefix of a
    /// policy's ipBlock that contains the address, if any.
    World {
        /// The longest matching policy CIDR.
        cidr: Option<String>,
    },
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Pod { namespace, name } => write!(f, "pod/{namespace}/{name}"),
            Peer::Host => f.write_str("host"),
            Peer::Node { name } => write!(f, "node/{name}"),
            Peer::World { cidr: Some(c) } => write!(f, "world/{c}"),
            Peer::World { cidr: None } => f.write_str("world"),
        }
    }
}

/// The ClusterNetworkPolicy rule that denied a packet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClusterRuleName {
    /// The ClusterNetworkPolicy (cluster-scoped: a name only).
    pub name: String,
    /// Index of the rule in its `ingress` or `egress` list.
    pub rule: usize,
}

/// The tier (`Admin`, `Baseline`) of a tier deny reason.
pub fn tier_of(reason: Option<Reason>) -> Option<&'static str> {
    match reason {
        Some(Reason::AdminDeny | Reason::AdminAccept) => Some("Admin"),
        Some(Reason::BaselineDeny | Reason::BaselineAccept) => Some("Baseline"),
        _ => None,
    }
}

/// One flow log line (serialized as JSON).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlowRecord {
    /// When the datapath saw the packet: the event's kernel timestamp
    /// (`CLOCK_MONOTONIC`) as wall-clock time, RFC 3339 in UTC
    /// (`2026-12-07T15:04:05.123456789Z`), so the records of several nodes
    /// merge in time order (`kubectl npm observe`).
    pub time: String,
    /// `deny` (a dropped packet) or `allow` (the first packet of an allowed
    /// new connection).
    pub verdict: &'static str,
    /// The datapath's reason (`policy-denied`, `policy`, `not-isolated`, ...).
    pub reason: &'static str,
    /// `ingress` (into the pod) or `egress` (out of it).
    pub direction: &'static str,
    /// The pod the event is about; `None` when the endpoint is not known
    /// (any more) to the agent.
    pub pod: Option<PodName>,
    /// The other end.
    pub peer: Peer,
    /// The peer's address.
    pub peer_ip: IpAddr,
    /// The policies that isolate the pod in this direction,
    /// `namespace/name`, sorted.
    pub policies: Vec<String>,
    /// The ClusterNetworkPolicy tier that decided it (`Admin`,
    /// `Baseline`: `admin-deny`, `admin-accept`, ...); absent for other
    /// reasons.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<&'static str>,
    /// The ClusterNetworkPolicy rule that decided it, when the programmed
    /// state still decides the packet so (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_policy: Option<ClusterRuleName>,
    /// Protocol name (or number).
    pub protocol: String,
    /// Source address and port.
    pub src: String,
    /// Destination address and port.
    pub dst: String,
    /// The endpoint id in the datapath.
    pub endpoint: u32,
    /// The host-side interface index.
    pub ifindex: u32,
}

/// What the agent knows to name an event: the compiled state it last
/// programmed (if any) and the snapshot it compiled.
#[derive(Clone, Copy)]
pub struct Names<'a> {
    compiled: Option<&'a Compiled>,
    snapshot: &'a Snapshot,
}

impl<'a> Names<'a> {
    /// Names from `compiled` (the programmed state; `None` before the first
    /// sync) and `snapshot`.
    pub fn new(compiled: Option<&'a Compiled>, snapshot: &'a Snapshot) -> Self {
        Names { compiled, snapshot }
    }

    fn peer(&self, ip: IpAddr) -> Peer {
        let identity = self.compiled.and_then(|c| c.ipcache.get(&ip)).map(|e| e.identity);
        match identity {
            Some(npm_common::IDENTITY_HOST) => return Peer::Host,
            Some(id) if self.compiled.is_some_and(|c| c.ids.node_identities.contains_key(&id)) => {
                // The node of that identity listing the address (the
                // compiler's rule: the first by name).
                let compiled = self.compiled.expect("checked");
                let of_identity = &compiled.ids.node_identities[&id].nodes;
                let by_address = self
                    .snapshot
                    .nodes
                    .values()
                    .find(|n| of_identity.contains(&n.name) && n.addresses.contains(&ip))
                    .map(|n| n.name.clone());
                let name = by_address.unwrap_or_else(|| {
                    let shown = npm_policy::render::identity_name(compiled, id);
                    shown.strip_prefix("node/").map(String::from).unwrap_or(shown)
                });
                return Peer::Node { name };
            }
            Some(id) if id >= npm_common::IDENTITY_FIRST_POD => {
                let ns = self
                    .compiled
                    .and_then(|c| c.ids.identities.get(&id))
                    .map(|k| k.namespace.as_str());
                let pod = self
                    .snapshot
                    .pods
                    .values()
                    .filter(|p| p.ips.contains(&ip))
                    .find(|p| ns.is_none_or(|ns| p.namespace == ns));
                if let Some(p) = pod {
                    return Peer::Pod {
                        namespace: p.namespace.clone(),
                        name: p.name.clone(),
                    };
                }
            }
            _ => {}
        }
        let cidr = self.compiled.and_then(|c| {
            c.cidrs
                .keys()
                .filter(|net| net.contains(&ip))
                .max_by_key(|net| net.prefix_len())
                .map(|net| net.to_string())
        });
        Peer::World { cidr }
    }

    /// The CNP rule that decides `e` on the programmed state, when that
    /// decision has the event's own reason.
    fn cluster_rule(&self, e: &DenyEvent, direction: Direction, peer: IpAddr) -> Option<ClusterRuleName> {
        let compiled = self.compiled?;
        let r = npm_policy::lookup::lookup(compiled, e.endpoint, direction, peer, e.protocol, e.dport);
        if r.reason as u8 != e.reason {
            return None;
        }
        match compiled.ids.rules.get(&r.rule?)? {
            RuleRef::Cluster { name, index, .. } => Some(ClusterRuleName {
                name: name.clone(),
                rule: *index,
            }),
            _ => None,
        }
    }

    /// The named record of one event.
    pub fn record(&self, e: &DenyEvent) -> FlowRecord {
        let (src, dst) = (addr(e.family, e.src), addr(e.family, e.dst));
        let ingress = e.direction == npm_common::DIR_INGRESS;
        let peer_ip = if ingress { src } else { dst };
        let pod = self
            .compiled
            .and_then(|c| c.endpoints.get(&e.endpoint))
            .map(|ep| PodName {
                namespace: ep.pod.namespace.clone(),
                name: ep.pod.name.clone(),
            });
        let mut policies: Vec<String> = match &pod {
            Some(p) => match self.snapshot.pods.get(&(p.namespace.clone(), p.name.clone())) {
                Some(model_pod) => self
                    .snapshot
                    .policies
                    .values()
                    .filter(|pol| {
                        if ingress {
                            pol.ingress_isolation
                        } else {
                            pol.egress_isolation
                        }
                    })
                    .filter(|pol| policy_selects(pol, model_pod))
                    .map(|pol| format!("{}/{}", pol.namespace, pol.name))
                    .collect(),
                None => Vec::new(),
            },
            None => Vec::new(),
        };
        policies.sort();
        let reason = Reason::from_u8(e.reason);
        let tier = tier_of(reason);
        let dir = if ingress { Direction::Ingress } else { Direction::Egress };
        let cluster_policy = tier.and_then(|_| self.cluster_rule(e, dir, peer_ip));
        let hostport = |ip: IpAddr, port: u16| std::net::SocketAddr::new(ip, port).to_string();
        FlowRecord {
            time: wall_time(e.ts_ns),
            verdict: verdict(e),
            reason: reason.map(Reason::name).unwrap_or("unknown"),
            direction: direction(e),
            pod,
            peer: self.peer(peer_ip),
            peer_ip,
            policies,
            tier,
            cluster_policy,
            protocol: protocol(e.protocol),
            src: hostport(src, e.sport),
            dst: hostport(dst, e.dport),
            endpoint: e.endpoint,
            ifindex: e.ifindex,
        }
    }
}

impl FlowLog {
    /// A limiter allowing `per_sec` lines per second, writing to stdout.
    pub fn new(per_sec: u32) -> Self {
        Self::with_writer(per_sec, Box::new(std::io::stdout()))
    }

    /// A limiter writing its JSON lines to `out`.
    pub fn with_writer(per_sec: u32, out: Box<dyn Write + Send>) -> Self {
        FlowLog {
            per_sec,
            window: None,
            logged: [0; 2],
            suppressed: [0; 2],
            out,
            allow_sinks: Vec::new(),
            log_allows: true,
        }
    }

    /// Whether allow events become lines (`--flow-logs-allow`; on by
    /// default here). Off, allow events still reach the
    /// [`FlowLog::on_allow`] sinks (audit mode) but are not logged: an
    /// audited pod's new connections do not appear as allow lines.
    pub fn log_allows(mut self, on: bool) -> Self {
        self.log_allows = on;
        self
    }

    /// Write `record` as one JSON line to this log's writer: the one writer
    /// of [`FlowLog::log_all`]'s lines and of records built elsewhere
    /// (audit mode's would-deny lines, [`super::audit`], which rate-limits
    /// them).
    pub fn write_record(&mut self, record: &FlowRecord) {
        match serde_json::to_string(record) {
            Ok(line) => {
                if let Err(err) = writeln!(self.out, "{line}").and_then(|()| self.out.flush()) {
                    tracing::warn!(error = %err, "writing a flow log line failed");
                }
            }
            Err(err) => tracing::warn!(error = %err, "serializing a flow log record failed"),
        }
    }

    /// Registers `sink`, called by [`FlowLog::log_all`] with every allow
    /// event and its named record (all of them: the rate limit applies to
    /// the lines only), in order.
    pub fn on_allow(&mut self, sink: AllowSink) {
        self.allow_sinks.push(sink);
    }

    /// Decide for one deny event at `now` (see [`FlowLog::admit_verdict`]).
    pub fn admit(&mut self, now: Instant) -> Admit {
        self.admit_verdict(now, false)
    }

    /// Decide for one event at `now`, an allow event when `allow` (each
    /// verdict has its budget of `per_sec` lines per window). When a window
    /// closes with suppressed events, their count is logged.
    pub fn admit_verdict(&mut self, now: Instant, allow: bool) -> Admit {
        let fresh = match self.window {
            None => true,
            Some(start) => now.saturating_duration_since(start) >= Duration::from_secs(1),
        };
        if fresh {
            for (i, what) in ["deny", "allow"].into_iter().enumerate() {
                if self.suppressed[i] > 0 {
                    tracing::warn!(
                        suppressed = self.suppressed[i],
                        verdict = what,
                        "flow logs suppressed by the rate limit"
                    );
                }
            }
            self.window = Some(now);
            self.logged = [0; 2];
            self.suppressed = [0; 2];
        }
        let i = usize::from(allow);
        if self.logged[i] < self.per_sec {
            self.logged[i] += 1;
            Admit::Log
        } else {
            self.suppressed[i] += 1;
            Admit::Suppress
        }
    }

    /// Log what the rate allows of `events`, named by `names`, as JSON
    /// lines, and hand every allow event to the [`FlowLog::on_allow`]
    /// sinks; returns how many lines were suppressed.
    pub fn log_all(&mut self, events: &[DenyEvent], names: &Names<'_>, now: Instant) -> u64 {
        let mut suppressed = 0;
        for e in events {
            let allow = e.is_allow();
            // Allow events without `log_allows` are not lines (and not
            // counted as suppressed); the sinks still get them.
            let admit = (!allow || self.log_allows).then(|| self.admit_verdict(now, allow));
            // A suppressed or unlogged allow is still named for the sinks.
            let for_sinks = allow && !self.allow_sinks.is_empty();
            if admit != Some(Admit::Log) && !for_sinks {
                suppressed += u64::from(admit == Some(Admit::Suppress));
                continue;
            }
            let record = names.record(e);
            if allow {
                for sink in &mut self.allow_sinks {
                    sink(e, &record);
                }
            }
            match admit {
                Some(Admit::Log) => self.write_record(&record),
                Some(Admit::Suppress) => suppressed += 1,
                None => {}
            }
        }
        suppressed
    }
}

#[cfg(test)]
mod tests;

//! The writer of `NPM_SERVICES` and of the `node_exit` attachments
//! ([`ServicesWriter`]) and the OS thread that runs it
//! ([`spawn_thread`]).
//!
//! Order on every pass: the uplinks are re-read and `node_exit` attached
//! to each (attach first, detach what is no longer an uplink), and the
//! `INPUT` rules of `host_in` (the decision for backends on the node's own
//! host network) are checked and written again if another program removed
//! them; only once both were in place (on a node with no uplink at all,
//! once that was read) are keys written, so a deferred packet never leaves
//! by an interface without `node_exit` nor is delivered to the node
//! undecided (except in the interval between an uplink appearing, or the
//! rules being removed, and the next pass, at most one resync). The keys are those of the two complete
//! lists; the map is read back and diffed every pass (level-triggered:
//! whatever else wrote or removed entries is corrected).
//!
//! Mass removals are guarded: a pass that would remove more than half of
//! the keys of a map holding at least [`GUARD_MIN`] is held, and applied
//! only when the same wanted set is computed again at least one resync
//! later (a transient state is never trusted; a real change goes
//! through).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use npm_dataplane::ebpf::{host_in_chain, EbpfError, HostIn, NodeExit, ServicePort, ServicesMap, ServicesSync};

use super::{ServiceKeys, ServiceState, ServicesConfig};
use crate::node::netlink::{Netlink, NetlinkError};
use crate::node::uplinks::{read_uplinks, Uplinks};
use crate::telemetry::metrics::Metrics;

/// Maps with fewer keys are never guarded.
pub const GUARD_MIN: usize = 16;

/// Errors of the writer.
#[derive(Debug, thiserror::Error)]
pub enum ServicesError {
    /// The pinned `NPM_SERVICES` could not be opened, read or written.
    #[error("NPM_SERVICES (pin dir {pin_dir}): {source}")]
    Map {
        /// The pin directory.
        pin_dir: String,
        /// The loader's error.
        #[source]
        source: EbpfError,
    },
    /// `node_exit` could not be loaded or attached.
    #[error("node_exit (pin dir {pin_dir}): {source}")]
    NodeExit {
        /// The pin directory.
        pin_dir: String,
        /// The loader's error.
        #[source]
        source: EbpfError,
    },
    /// `host_in` could not be loaded, or its `INPUT` rules written.
    #[error("host_in (pin dir {pin_dir}): {source}")]
    HostIn {
        /// The pin directory.
        pin_dir: String,
        /// The loader's error.
        #[source]
        source: EbpfError,
    },
    /// The uplinks could not be read.
    #[error("reading the uplinks: {0}")]
    Netlink(#[from] NetlinkError),
}

/// What one [`ServicesWriter::apply`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The map now holds the wanted keys.
    Synced(ServicesSync),
    /// A mass removal is held (the number of keys it would remove).
    Held {
        /// Keys the held set would remove.
        removals: usize,
    },
}

/// `NPM_SERVICES`, `node_exit` and its links, `host_in` and its rules.
pub struct ServicesWriter {
    cfg: ServicesConfig,
    map: ServicesMap,
    exit: NodeExit,
    host_in: HostIn,
    nl: Netlink,
    held: Option<(BTreeMap<ServicePort, u32>, Instant)>,
    attached_once: bool,
}

impl std::fmt::Debug for ServicesWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServicesWriter")
            .field("pin_dir", &self.cfg.pin_dir)
            .field("exit", &self.exit)
            .field("host_in", &self.host_in)
            .finish_non_exhaustive()
    }
}

/// The ifindexes of the endpoint links pinned under `<pin_dir>/links`
/// (`<ifindex>-ingress`, `<ifindex>-egress`): never an uplink.
fn endpoint_ifindexes(pin_dir: &Path) -> BTreeSet<u32> {
    std::fs::read_dir(pin_dir.join("links"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.split_once('-')?.0.parse().ok())
        .collect()
}

impl ServicesWriter {
    /// Opens the pinned `NPM_SERVICES`, loads `node_exit` (adopting its
    /// pinned links) and `host_in` (writing its rules).
    pub fn open(cfg: ServicesConfig) -> Result<Self, ServicesError> {
        let pin_dir = cfg.pin_dir.display().to_string();
        let map = ServicesMap::open(&cfg.pin_dir).map_err(|source| ServicesError::Map {
            pin_dir: pin_dir.clone(),
            source,
        })?;
        let exit = NodeExit::open_in(cfg.object.as_deref(), &cfg.pin_dir, cfg.attach).map_err(|source| {
            ServicesError::NodeExit {
                pin_dir: pin_dir.clone(),
                source,
            }
        })?;
        let host_in = HostIn::open(cfg.object.as_deref(), &cfg.pin_dir, &host_in_chain(&cfg.pin_dir))
            .map_err(|source| ServicesError::HostIn { pin_dir, source })?;
        let nl = Netlink::open(None)?;
        Ok(ServicesWriter {
            cfg,
            map,
            exit,
            host_in,
            nl,
            held: None,
            attached_once: false,
        })
    }

    /// Reads the uplinks and makes `node_exit` attached to exactly them;
    /// checks `host_in`'s rules (written again where they were removed).
    pub fn attach_uplinks(&mut self) -> Result<Uplinks, ServicesError> {
        self.host_in.ensure().map_err(|source| ServicesError::HostIn {
            pin_dir: self.cfg.pin_dir.display().to_string(),
            source,
        })?;
        let up = read_uplinks(&mut self.nl, &endpoint_ifindexes(&self.cfg.pin_dir))?;
        let wanted: BTreeSet<u32> = up.chosen.keys().copied().collect();
        if wanted != self.exit.attached() {
            tracing::info!(uplinks = ?up.chosen, "node_exit on the uplinks");
        }
        if !up.l3.is_empty() {
            tracing::info!(devices = ?up.l3, "node_exit_l3 on the uplinks without an Ethernet header (L3 tunnels)");
        }
        self.exit
            .set_interfaces(&wanted)
            .map_err(|source| ServicesError::NodeExit {
                pin_dir: self.cfg.pin_dir.display().to_string(),
                source,
            })?;
        self.attached_once = true;
        Ok(up)
    }

    /// What `host_in`'s rules do with a deferred packet delivered here.
    pub fn host_in_mode(&self) -> npm_dataplane::ebpf::HostInMode {
        self.host_in.mode()
    }

    /// Whether `node_exit` was attached to the uplinks (and `host_in`'s
    /// rules were in place) at least once.
    pub fn attached_once(&self) -> bool {
        self.attached_once
    }

    /// The interfaces `node_exit` is on.
    pub fn uplinks(&self) -> BTreeSet<u32> {
        self.exit.attached()
    }

    /// Makes `NPM_SERVICES` hold `keys`, unless that is a held mass
    /// removal (see the module doc); `now` is the pass's clock.
    pub fn apply(&mut self, keys: &ServiceKeys, now: Instant) -> Result<Applied, ServicesError> {
        let err = |source| ServicesError::Map {
            pin_dir: self.cfg.pin_dir.display().to_string(),
            source,
        };
        let have = self.map.entries().map_err(err)?;
        let removals = have.keys().filter(|k| !keys.keys.contains_key(k)).count();
        if have.len() >= GUARD_MIN && removals * 2 > have.len() {
            let confirmed = matches!(&self.held, Some((w, since)) if *w == keys.keys && now.duration_since(*since) >= self.cfg.resync);
            if !confirmed {
                if self.held.as_ref().map(|(w, _)| w) != Some(&keys.keys) {
                    tracing::warn!(
                        removals,
                        have = have.len(),
                        "mass removal of Service keys held until it is computed again"
                    );
                    self.held = Some((keys.keys.clone(), now));
                }
                return Ok(Applied::Held { removals });
            }
        }
        self.held = None;
        let s = self.map.sync(&keys.keys).map_err(|source| ServicesError::Map {
            pin_dir: self.cfg.pin_dir.display().to_string(),
            source,
        })?;
        if s.written + s.removed > 0 {
            tracing::info!(
                written = s.written,
                removed = s.removed,
                total = s.total,
                "NPM_SERVICES synced"
            );
        }
        Ok(Applied::Synced(s))
    }
}

/// Stops the writer thread when dropped.
#[derive(Debug)]
pub struct StopGuard(Arc<AtomicBool>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// How often the thread looks for a change.
const TICK: Duration = Duration::from_millis(200);

/// Runs the writer on its own thread until the guard is dropped: opens
/// it (retried every resync), attaches the uplinks every resync, and
/// applies the keys of `state` whenever they changed, every resync, and
/// while a mass removal is held.
pub fn spawn_thread(cfg: ServicesConfig, state: Arc<ServiceState>, metrics: Metrics) -> StopGuard {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let spawned = std::thread::Builder::new()
        .name("npm-services".into())
        .spawn(move || run(cfg, state, &metrics, &flag));
    if let Err(e) = spawned {
        tracing::error!(error = %e, "starting the Services thread: Service traffic stays decided before the DNAT");
    }
    StopGuard(stop)
}

fn run(cfg: ServicesConfig, state: Arc<ServiceState>, metrics: &Metrics, stop: &AtomicBool) {
    let mut writer: Option<ServicesWriter> = None;
    let mut last_open: Option<Instant> = None;
    let mut last_resync: Option<Instant> = None;
    let mut last_gen = u64::MAX;
    while !stop.load(Ordering::Acquire) {
        let now = Instant::now();
        let due = |t: Option<Instant>| t.is_none_or(|t| now.duration_since(t) >= cfg.resync);
        if writer.is_none() && due(last_open) {
            last_open = Some(now);
            match ServicesWriter::open(cfg.clone()) {
                Ok(w) => writer = Some(w),
                Err(e) => tracing::error!(error = %e, "Services: not deferring egress past the DNAT (retrying)"),
            }
        }
        if let Some(w) = writer.as_mut() {
            let resync = due(last_resync);
            if resync {
                last_resync = Some(now);
                if let Err(e) = w.attach_uplinks() {
                    tracing::error!(error = %e, "attaching node_exit to the uplinks");
                }
                metrics.host_in_mode(w.host_in_mode() == npm_dataplane::ebpf::HostInMode::DropAll);
            }
            let gen = state.generation();
            if w.attached_once() && (gen != last_gen || resync) {
                if let Some(keys) = state.keys() {
                    if !keys.skipped.is_empty() {
                        tracing::warn!(skipped = ?keys.skipped, "Service keys skipped");
                    }
                    match w.apply(&keys, now) {
                        Ok(Applied::Synced(_)) => last_gen = gen,
                        Ok(Applied::Held { .. }) => {}
                        Err(e) => tracing::error!(error = %e, "writing NPM_SERVICES"),
                    }
                }
            }
        }
        std::thread::sleep(TICK);
    }
}

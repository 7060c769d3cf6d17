//! The nftables dataplane and bridged pods: traffic between two ports of
//! one Linux bridge (pod to pod on a flannel `cni0`, a kubenet `cbr0`, the
//! reference `bridge` plugin) is switched at L2 and never reaches the
//! `inet` hooks the nftables table decides in, unless `br_netfilter` is
//! loaded and `net.bridge.bridge-nf-call-iptables` (IPv4) and
//! `net.bridge.bridge-nf-call-ip6tables` (IPv6) are 1. Nothing else tells
//! an operator that same-node traffic between bridged pods is unenforced,
//! so the agent checks it ([`BridgeNfCheck`]) at every stats tick (5 s by
//! default) with the nftables dataplane, only when a local endpoint's interface is a bridge
//! port, and only for the families its endpoints have:
//!
//! - readiness check [`CHECK_BRIDGE_NETFILTER`] fails with a reason naming
//!   the sysctl (or the missing module) and the number of endpoints;
//! - `npm_bridge_nf_unfiltered_endpoints{family}` counts those endpoints.
//!
//! The agent never writes the sysctls (they belong to the node's
//! configuration). They are per network namespace (a new namespace starts
//! with its own copy; checked on 6.18 by this module's tests), so the check
//! reads them in the namespace the endpoints' interfaces are in.

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::path::Path;

use npm_dataplane::Interfaces;
use npm_policy::compiled::Compiled;

use super::netlink::{netns_path, LinkKind, Netlink, NetlinkError};
use crate::telemetry::health::Health;
use crate::telemetry::metrics::Metrics;

/// Name of the readiness check.
pub const CHECK_BRIDGE_NETFILTER: &str = "bridge-netfilter";

/// The sysctl of IPv4.
pub const SYSCTL_V4: &str = "net/bridge/bridge-nf-call-iptables";
/// The sysctl of IPv6.
pub const SYSCTL_V6: &str = "net/bridge/bridge-nf-call-ip6tables";

/// Errors of the check (reported, never fatal).
#[derive(Debug, thiserror::Error)]
pub enum BridgeNfError {
    /// The interfaces could not be listed.
    #[error("listing the interfaces: {0}")]
    Netlink(#[from] NetlinkError),
    /// The namespace could not be entered.
    #[error("network namespace {path}: {source}")]
    Netns {
        /// The namespace file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// One sysctl's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sysctl {
    /// 1: bridged packets of the family traverse the `inet` hooks.
    On,
    /// 0.
    Off,
    /// No such file: `br_netfilter` is not loaded.
    Missing,
}

/// Both families' sysctls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sysctls {
    /// `bridge-nf-call-iptables`.
    pub v4: Sysctl,
    /// `bridge-nf-call-ip6tables`.
    pub v6: Sysctl,
}

fn read_one(name: &str) -> Sysctl {
    match std::fs::read_to_string(Path::new("/proc/sys").join(name)) {
        Ok(v) if v.trim() == "0" => Sysctl::Off,
        Ok(_) => Sysctl::On,
        Err(_) => Sysctl::Missing,
    }
}

/// The sysctls of network namespace `netns` (a name under `/run/netns` or
/// a path; `None`: the agent's own). `/proc/sys/net` answers for the
/// namespace of the reading thread, so another namespace is read from a
/// short-lived thread that enters it.
pub fn read_sysctls(netns: Option<&str>) -> Result<Sysctls, BridgeNfError> {
    let read = || Sysctls {
        v4: read_one(SYSCTL_V4),
        v6: read_one(SYSCTL_V6),
    };
    let Some(ns) = netns else {
        return Ok(read());
    };
    let path = netns_path(ns);
    let err = |source| BridgeNfError::Netns {
        path: path.display().to_string(),
        source,
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            let file = std::fs::File::open(&path).map_err(err)?;
            // SAFETY: setns on this scoped, short-lived thread only, with a
            // valid namespace fd.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(err(std::io::Error::last_os_error()));
            }
            Ok(read())
        })
        .join()
        .unwrap_or_else(|_| Err(err(std::io::Error::other("the namespace thread panicked"))))
    })
}

/// The local endpoints on a bridge port, by family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bridged {
    /// Endpoints with an IPv4 address.
    pub v4: usize,
    /// Endpoints with an IPv6 address.
    pub v6: usize,
}

/// The outcome of one check.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Endpoints on a bridge port whose family is not filtered
    /// (`npm_bridge_nf_unfiltered_endpoints{family}`).
    pub unfiltered: Bridged,
    /// The readiness reason, when any endpoint is unfiltered.
    pub problem: Option<String>,
}

fn missing(what: Sysctl, sysctl: &str) -> Option<String> {
    match what {
        Sysctl::On => None,
        Sysctl::Off => Some(format!("{} is 0", sysctl.replace('/', "."))),
        Sysctl::Missing => Some(format!(
            "{} is absent (br_netfilter not loaded)",
            sysctl.replace('/', ".")
        )),
    }
}

/// What `sysctls` mean for the endpoints `bridged`.
pub fn verdict(bridged: Bridged, sysctls: Sysctls) -> Verdict {
    let v4 = missing(sysctls.v4, SYSCTL_V4).filter(|_| bridged.v4 > 0);
    let v6 = missing(sysctls.v6, SYSCTL_V6).filter(|_| bridged.v6 > 0);
    let unfiltered = Bridged {
        v4: if v4.is_some() { bridged.v4 } else { 0 },
        v6: if v6.is_some() { bridged.v6 } else { 0 },
    };
    let reasons: Vec<String> = [(v4, unfiltered.v4, "IPv4"), (v6, unfiltered.v6, "IPv6")]
        .into_iter()
        .filter_map(|(r, n, family)| {
            r.map(|r| format!("{r}: {family} traffic between the {n} bridged pods is not filtered"))
        })
        .collect();
    let problem = (!reasons.is_empty()).then(|| {
        format!(
            "{}; load br_netfilter and set the sysctl to 1 (nftables decides in the inet hooks, which bridged traffic \
             skips otherwise)",
            reasons.join("; ")
        )
    });
    Verdict { unfiltered, problem }
}

/// Where the check looks (`SyncConfig::bridge_netfilter`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BridgeNfConfig {
    /// The network namespace of the endpoints' interfaces (a name under
    /// `/run/netns` or a path; `None`: the agent's own).
    pub netns: Option<String>,
}

/// The check, kept by the sync loop (run at every stats tick on what is
/// programmed): the bridge ports are looked up again
/// only when the endpoints' interfaces change; the sysctls at every check.
#[derive(Debug, Default)]
pub struct BridgeNfCheck {
    netns: Option<String>,
    /// The interfaces of the last lookup, and which of them are bridge ports.
    looked_up: Option<(BTreeSet<u32>, BTreeSet<u32>)>,
    /// Whether a problem is reported (logged on change only).
    reported: bool,
}

impl BridgeNfCheck {
    /// A check of the interfaces of network namespace `netns` (`None`: the
    /// agent's own).
    pub fn new(netns: Option<String>) -> Self {
        BridgeNfCheck {
            netns,
            looked_up: None,
            reported: false,
        }
    }

    /// Check the endpoints of `compiled` on `interfaces` (endpoint id ->
    /// ifindex), as programmed.
    pub fn check(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<Verdict, BridgeNfError> {
        let indexes: BTreeSet<u32> = interfaces.values().copied().collect();
        let ports = match &self.looked_up {
            Some((seen, ports)) if *seen == indexes => ports.clone(),
            _ => {
                let links = Netlink::open(self.netns.as_deref())?.links()?;
                let ports: BTreeSet<u32> = indexes
                    .iter()
                    .filter(|i| {
                        links
                            .get(i)
                            .and_then(|l| l.master)
                            .and_then(|m| links.get(&m))
                            .is_some_and(|m| m.kind == Some(LinkKind::Bridge))
                    })
                    .copied()
                    .collect();
                self.looked_up = Some((indexes, ports.clone()));
                ports
            }
        };
        let mut bridged = Bridged::default();
        for (id, ep) in &compiled.endpoints {
            if !interfaces.get(id).is_some_and(|i| ports.contains(i)) {
                continue;
            }
            bridged.v4 += usize::from(ep.ipv4.is_some());
            bridged.v6 += usize::from(ep.ipv6.is_some());
        }
        if bridged == Bridged::default() {
            return Ok(Verdict::default());
        }
        Ok(verdict(bridged, read_sysctls(self.netns.as_deref())?))
    }

    /// [`Self::check`], reported: the readiness check
    /// [`CHECK_BRIDGE_NETFILTER`] and the metric (module doc). A check that
    /// cannot be made keeps the last report (logged).
    pub fn report(&mut self, compiled: &Compiled, interfaces: &Interfaces, health: &Health, metrics: &Metrics) {
        match self.check(compiled, interfaces) {
            Ok(v) => {
                metrics.bridge_nf_unfiltered("ipv4", v.unfiltered.v4);
                metrics.bridge_nf_unfiltered("ipv6", v.unfiltered.v6);
                if v.problem.is_some() != self.reported {
                    match &v.problem {
                        Some(p) => tracing::error!(problem = %p, "bridged pods are not enforced by nftables"),
                        None => tracing::info!("bridged pods' traffic reaches nftables again"),
                    }
                }
                self.reported = v.problem.is_some();
                health.set_problem(CHECK_BRIDGE_NETFILTER, v.problem);
            }
            Err(e) => tracing::warn!(error = %e, "br_netfilter check not made"),
        }
    }
}

#[cfg(test)]
mod tests;

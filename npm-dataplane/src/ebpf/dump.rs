//! Reading the programmed maps back for `npm-agent inspect` and the tests:
//! the [`EbpfDump`] of a loaded dataplane ([`EbpfDataplane::dump`]) or,
//! read-only, of the maps pinned under a pin directory ([`dump_pinned`],
//! which loads no program and touches no link), and the program id on each
//! attached hook, tcx link or tc filter ([`pinned_link_programs`]).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray};
use aya::programs::links::{FdLink, PinnedLink};
use ipnet::IpNet;
use npm_common::{maps, Counter, EndpointInfo, IpInfo, IpKey, PolicyKey, PolicyValue, Reason, POLICY_KEY_LEN};
use npm_common::{TierValue, TIER_ACCEPT, TIER_ADMIN, TIER_DENY};
use npm_common::{DIR_EGRESS, DIR_INGRESS};
use serde::Serialize;

use super::conntrack::Flows;
use super::counters::sum_counters;
use super::endpoints;
use super::errors::{link_err, EbpfError};
use super::links::{dir_name, ifname};
use super::pins::{link_pins, open_pinned};
use super::{tc_filters, translate, EbpfDataplane};

/// One endpoint in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpEndpoint {
    /// Host-side ifindex (the map key).
    pub ifindex: u32,
    /// Endpoint id.
    pub id: u32,
    /// Its policy subject: the pod identity whose `NPM_POLICY` keys
    /// govern it ([`DumpPolicy::subject`]).
    pub subject: u32,
    /// `EP_*` flags.
    pub flags: u32,
    /// IPv4 address.
    pub ipv4: Option<std::net::Ipv4Addr>,
    /// IPv6 address.
    pub ipv6: Option<std::net::Ipv6Addr>,
    /// Attached hooks (pod directions): tcx links or npm tc filters.
    pub attached: Vec<&'static str>,
}

/// One ipcache entry in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpIp {
    /// Address.
    pub addr: IpAddr,
    /// Identity.
    pub identity: u32,
    /// CIDR identity (0: none).
    pub cidr_identity: u32,
}

/// One CIDR entry in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpCidr {
    /// Prefix.
    pub prefix: IpNet,
    /// CIDR identity.
    pub identity: u32,
}

/// One policy key in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpPolicy {
    /// The key's subject: the pod identity of the local endpoints it
    /// governs (those whose [`DumpEndpoint::subject`] it is).
    pub subject: u32,
    /// "ingress" or "egress".
    pub direction: &'static str,
    /// Peer identity (0: any).
    pub peer: u32,
    /// Protocol number, `None` for any protocol.
    pub protocol: Option<u8>,
    /// Inclusive port range (every port for `protocol: None`).
    pub ports: (u16, u16),
    /// LPM prefix length of the key.
    pub prefix_len: u32,
    /// Rule id.
    pub rule: u32,
}

/// One `NPM_TIERS` key in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpTier {
    /// Subject: the pod identity of the endpoints the key governs.
    pub subject: u32,
    /// "ingress" or "egress".
    pub direction: &'static str,
    /// "admin" or "baseline".
    pub tier: &'static str,
    /// Peer identity (0: any).
    pub peer: u32,
    /// Protocol number, `None` for any protocol.
    pub protocol: Option<u8>,
    /// Inclusive port range (every port for `protocol: None`).
    pub ports: (u16, u16),
    /// LPM prefix length of the key.
    pub prefix_len: u32,
    /// "accept", "deny" or "pass".
    pub action: &'static str,
    /// Rank in the tier (lower decides first).
    pub rank: u32,
    /// Rule id.
    pub rule: u32,
}

/// One counter slot in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpCounter {
    /// "ingress" or "egress".
    pub direction: &'static str,
    /// Reason name.
    pub reason: &'static str,
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}

/// The programmed maps' contents, for `npm-agent inspect`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EbpfDump {
    /// Pin directory.
    pub pin_dir: PathBuf,
    /// `NPM_ENDPOINTS`.
    pub endpoints: Vec<DumpEndpoint>,
    /// `NPM_IPCACHE`, sorted by address.
    pub ipcache: Vec<DumpIp>,
    /// `NPM_CIDRS`, sorted by prefix.
    pub cidrs: Vec<DumpCidr>,
    /// `NPM_POLICY`, sorted.
    pub policy: Vec<DumpPolicy>,
    /// `NPM_TIERS`, sorted (empty when not pinned: an older agent's pins).
    pub tiers: Vec<DumpTier>,
    /// Entries of `NPM_CT` and `NPM_CT4`.
    pub ct_entries: usize,
    /// Entries of `NPM_FRAGS`.
    pub frag_entries: usize,
    /// Non-zero counters.
    pub counters: Vec<DumpCounter>,
}

/// Borrowed views of the maps a dump reads (from a loaded dataplane or
/// opened read-only from their pins).
struct MapsRef<'a> {
    ep_slots: &'a Array<MapData, EndpointInfo>,
    endpoints: &'a BpfHashMap<MapData, u32, EndpointInfo>,
    ipcache: &'a BpfHashMap<MapData, IpKey, IpInfo>,
    cidrs: &'a LpmTrie<MapData, [u8; 16], u32>,
    policy: &'a LpmTrie<MapData, [u8; POLICY_KEY_LEN], PolicyValue>,
    tiers: Option<&'a LpmTrie<MapData, [u8; POLICY_KEY_LEN], TierValue>>,
    flows: &'a Flows,
    counters: &'a PerCpuArray<MapData, Counter>,
}

impl EbpfDataplane {
    /// The programmed maps' contents.
    pub fn dump(&self) -> Result<EbpfDump, EbpfError> {
        let (ep_slots, endpoints) = self.endpoints.maps();
        dump_maps(
            &self.pin_dir,
            &MapsRef {
                ep_slots,
                endpoints,
                ipcache: self.ipcache.hash(),
                cidrs: self.cidrs.trie(),
                policy: self.policy.lpm(),
                tiers: Some(self.tiers.lpm()),
                flows: &self.flows,
                counters: self.reports.counter_map(),
            },
            |ifindex, d| self.links.contains_key(&(ifindex, d)),
        )
    }
}

/// Reads every map of `m` into an [`EbpfDump`]; `attached(ifindex, dir)`
/// tells whether the hook of pod direction `dir` is attached.
fn dump_maps(pin_dir: &Path, m: &MapsRef<'_>, attached: impl Fn(u32, u8) -> bool) -> Result<EbpfDump, EbpfError> {
    let mut endpoints: Vec<DumpEndpoint> = endpoints::read_entries(m.ep_slots, m.endpoints)?
        .into_iter()
        .map(|(ifindex, info)| DumpEndpoint {
            ifindex,
            id: info.id,
            subject: info.subject,
            flags: info.flags,
            ipv4: translate::endpoint_ipv4(&info),
            ipv6: translate::endpoint_ipv6(&info),
            attached: [DIR_INGRESS, DIR_EGRESS]
                .into_iter()
                .filter(|d| attached(ifindex, *d))
                .map(dir_name)
                .collect(),
        })
        .collect();
    endpoints.sort_by_key(|e| e.ifindex);
    let mut ipcache: Vec<DumpIp> = m
        .ipcache
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| DumpIp {
            addr: translate::ip_from_key(&k),
            identity: v.identity,
            cidr_identity: v.cidr_identity,
        })
        .collect();
    ipcache.sort_by_key(|e| e.addr);
    let mut cidrs = Vec::new();
    for (k, v) in m.cidrs.iter().filter_map(Result::ok) {
        cidrs.push(DumpCidr {
            prefix: translate::cidr_from_key(k.prefix_len(), k.data())?,
            identity: v,
        });
    }
    cidrs.sort_by_key(|c| c.prefix);
    let mut policy: Vec<DumpPolicy> = m
        .policy
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| {
            let (key, protocol, ports) = key_ports(&k);
            DumpPolicy {
                subject: key.subject(),
                direction: dir_name(key.direction()),
                peer: key.identity(),
                protocol,
                ports,
                prefix_len: key.prefix_len,
                rule: v.rule,
            }
        })
        .collect();
    policy.sort_by(|a, b| {
        (a.subject, a.direction, a.peer, a.protocol, a.ports).cmp(&(
            b.subject,
            b.direction,
            b.peer,
            b.protocol,
            b.ports,
        ))
    });
    let mut tiers: Vec<DumpTier> = m
        .tiers
        .into_iter()
        .flat_map(|t| t.iter().filter_map(Result::ok))
        .map(|(k, v)| {
            let (key, protocol, ports) = key_ports(&k);
            let d = key.direction();
            DumpTier {
                subject: key.subject(),
                direction: dir_name(d & DIR_EGRESS),
                tier: if d & TIER_ADMIN != 0 { "admin" } else { "baseline" },
                peer: key.identity(),
                protocol,
                ports,
                prefix_len: key.prefix_len,
                action: match v.action() {
                    TIER_ACCEPT => "accept",
                    TIER_DENY => "deny",
                    _ => "pass",
                },
                rank: v.rank(),
                rule: v.rule,
            }
        })
        .collect();
    tiers.sort_by(|a, b| {
        (a.subject, a.direction, a.tier, a.peer, a.protocol, a.ports).cmp(&(
            b.subject,
            b.direction,
            b.tier,
            b.peer,
            b.protocol,
            b.ports,
        ))
    });
    let counters = sum_counters(m.counters)?
        .by_reason
        .into_iter()
        .filter_map(|((d, r), (packets, bytes))| {
            Some(DumpCounter {
                direction: dir_name(d),
                reason: Reason::from_u8(r)?.name(),
                packets,
                bytes,
            })
        })
        .collect();
    Ok(EbpfDump {
        pin_dir: pin_dir.to_path_buf(),
        endpoints,
        ipcache,
        cidrs,
        policy,
        tiers,
        ct_entries: m.flows.ct_len(),
        frag_entries: m.flows.frag_len(),
        counters,
    })
}

/// The program id attached to every hook of the pin directory `pin_dir`,
/// keyed by (ifindex, pod direction `"ingress"`/`"egress"`), in either
/// attach mode: each tcx link pinned under `<pin_dir>/links`, and each npm
/// tc filter whose program uses the maps pinned there (a hook with both, a
/// mode change under way, reports the tcx link's). Read-only: the links
/// are opened by their pins and closed again, filters are listed by a
/// netlink dump; nothing is updated. Pins whose link cannot be opened are
/// left out.
pub fn pinned_link_programs(pin_dir: &Path) -> Result<BTreeMap<(u32, &'static str), u32>, EbpfError> {
    let mut out: BTreeMap<(u32, &'static str), u32> = tc_filters::filters_of(pin_dir)?
        .into_iter()
        .map(|((ifindex, d), prog)| ((ifindex, dir_name(d)), prog))
        .collect();
    let pins = match link_pins(pin_dir) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(source) => {
            return Err(EbpfError::PinDir {
                path: pin_dir.join("links"),
                op: "read",
                source,
            })
        }
    };
    for (hook, path) in pins {
        let Some((ifindex, d)) = hook else {
            continue;
        };
        let link = match PinnedLink::from_pin(&path) {
            Ok(l) => FdLink::from(l),
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "pinned link unreadable");
                continue;
            }
        };
        let info = link.info().map_err(link_err(&path, "link info"))?;
        out.insert((ifindex, dir_name(d)), info.program_id());
    }
    Ok(out)
}

/// Read-only dump of the maps pinned under `pin_dir`, for `npm-agent
/// inspect`: opens the pinned maps by path, loads no program, attaches
/// nothing and replaces no link, so inspecting never touches enforcement.
/// An endpoint's hook counts as attached when its link is pinned, its link
/// can be opened and its interface exists.
///
/// Errors: [`EbpfError::NotPinned`] when a map is not pinned there (no
/// agent ran with this pin directory), [`EbpfError::Map`] when a pinned map
/// cannot be opened or has another layout.
pub fn dump_pinned(pin_dir: &Path) -> Result<EbpfDump, EbpfError> {
    let ep_slots: Array<MapData, EndpointInfo> = open_pinned(pin_dir, maps::EP_SLOTS)?;
    let endpoints: BpfHashMap<MapData, u32, EndpointInfo> = open_pinned(pin_dir, maps::ENDPOINTS)?;
    let ipcache: BpfHashMap<MapData, IpKey, IpInfo> = open_pinned(pin_dir, maps::IPCACHE)?;
    let cidrs: LpmTrie<MapData, [u8; 16], u32> = open_pinned(pin_dir, maps::CIDRS)?;
    let policy: LpmTrie<MapData, [u8; POLICY_KEY_LEN], PolicyValue> = open_pinned(pin_dir, maps::POLICY)?;
    // Pins of an agent from before the tiers have no NPM_TIERS.
    let tiers: Option<LpmTrie<MapData, [u8; POLICY_KEY_LEN], TierValue>> = match open_pinned(pin_dir, maps::TIERS) {
        Ok(t) => Some(t),
        Err(EbpfError::NotPinned { .. }) => None,
        Err(e) => return Err(e),
    };
    let flows = Flows::open_pinned(pin_dir)?;
    let counters: PerCpuArray<MapData, Counter> = open_pinned(pin_dir, maps::COUNTERS)?;
    let links = pinned_link_programs(pin_dir)?;
    dump_maps(
        pin_dir,
        &MapsRef {
            ep_slots: &ep_slots,
            endpoints: &endpoints,
            ipcache: &ipcache,
            cidrs: &cidrs,
            policy: &policy,
            tiers: tiers.as_ref(),
            flows: &flows,
            counters: &counters,
        },
        |ifindex, d| links.contains_key(&(ifindex, dir_name(d))) && ifname(ifindex).is_ok(),
    )
}

/// The policy key of an LPM key of `NPM_POLICY` or `NPM_TIERS`, with its
/// protocol and port range (`None` and every port for a protocol-less key).
fn key_ports(k: &Key<[u8; POLICY_KEY_LEN]>) -> (PolicyKey, Option<u8>, (u16, u16)) {
    let key = PolicyKey {
        prefix_len: k.prefix_len(),
        data: k.data(),
    };
    match translate::policy_key_ports(&key) {
        Some((p, lo, hi)) => (key, Some(p), (lo, hi)),
        None => (key, None, (0, u16::MAX)),
    }
}

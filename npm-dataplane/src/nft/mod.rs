//! The nftables dataplane: the compiled policy rendered as nftables tables
//! (family `inet`, which takes every verdict, and family `bridge`, which
//! validates the source addresses of bridged pods; both named `npm` by
//! default) and loaded with `nft -f -`.
//!
//! # Layout of the table
//!
//! ```text
//! table inet npm {
//!     counter in_policy { }  ...          one named counter per direction and
//!                                          npm_common::Reason that the chains count
//!                                          ("in_"/"out_" + the reason's name, '-' -> '_');
//!                                          in_/out_admin_accept, _admin_deny,
//!                                          _baseline_accept, _baseline_deny only once
//!                                          some endpoint has a tier chain (kept after)
//!     set id_<n>_v4 / id_<n>_v6            addresses of pod identity n (and of
//!                                          IDENTITY_HOST, n = 2), from the ipcache
//!     set cidr_<n>_v4 / cidr_<n>_v6        interval sets: addresses whose longest
//!                                          ipBlock prefix is CIDR identity n
//!     set not_world_v4 / not_world_v6      (only if IDENTITY_WORLD is a peer) every
//!                                          ipcache address: world is "not in the
//!                                          ipcache", as in the datapath
//!     chain ep_<id>_in / ep_<id>_out       one per endpoint and direction, with
//!                                          the policy entries of the endpoint's
//!                                          subject (its pod identity)
//!     chain ep_<id>_in_nat                 the ingress chain's decision steps on
//!                                          `ct original ip[6] saddr`, for connections
//!                                          source-NATed on this node (`ct status snat
//!                                          goto`, chain.rs `Source`); only when the
//!                                          chain decides (isolated or tiered), with
//!                                          its tier chains ep_<id>_in_nat_admin, _baseline
//!     chain ep_<id>_in_admin, _in_baseline, ClusterNetworkPolicy tier chains, only
//!           _out_admin, _out_baseline      for an endpoint, direction and tier whose
//!                                          Endpoint::tiers flag is set: its
//!                                          Compiled::tiers entries in rank order
//!                                          (chain.rs)
//!     map dispatch_out / dispatch_in       iface_index : verdict,
//!                                          { <ifindex> : jump ep_<id>_out / _in }
//!     map bridged_out_v4 / _v6,            ipv4_addr / ipv6_addr : verdict,
//!         bridged_in_v4 / _v6              { <endpoint address> : jump ep_<id>_out / _in }
//!     chain base_forward  hook forward     egress (pod -> other pods, the world):
//!                         priority filter  iif vmap @dispatch_out;
//!                                          meta iifkind "bridge" ip saddr vmap @bridged_out_v4 (and ip6)
//!     chain base_input    hook input       egress (pod -> this node), the same rules
//!                         priority filter
//!     chain base_postrouting               ingress (anything -> pod), after every NAT:
//!                         hook postrouting oif vmap @dispatch_in;
//!                         priority srcnat + 1   meta oifkind "bridge" ip daddr vmap @bridged_in_v4 (and ip6)
//! }
//! table bridge npm {
//!     counter out_spoofed                  spoofed frames of bridged pods
//!     chain port_<id>                      the endpoint's source addresses only
//!     map ports                            iface_index : verdict, { <ifindex> : jump port_<id> }
//!     chain base_prerouting hook prerouting (priority filter, -200)   iif vmap @ports
//! }
//! ```
//!
//! # Bridged pods (the reference `bridge` CNI, flannel's `cni0`, kubenet)
//!
//! A bridged pod's interface is its veth, a port of a bridge. The `inet`
//! hooks never see that port: with br_netfilter (`bridge-nf-call-iptables`
//! and `-ip6tables` = 1, as kube-proxy needs them) a frame bridged between
//! two ports passes the `inet` forward hook with `iif` = `oif` = the bridge
//! (br_netfilter passes the bridge as the logical device); traffic routed
//! from or to a bridged pod has the bridge as `iif` or `oif` too. The
//! `inet` hooks offer no port of br_netfilter'd packets (`meta ibrname` is
//! refused in `inet` tables, there is no native `physdev` match), and the
//! `bridge` family, which sees the port, has no `ct` on kernels without
//! `nf_conntrack_bridge` (refused with EPROTO, the case of the CI kernel),
//! so stateful verdicts cannot be taken there. Hence:
//!
//! | traffic | hook deciding | endpoint found by |
//! |---|---|---|
//! | routed pod -> other node, pod, world (egress) | inet forward | `iif` (its veth) |
//! | routed pod -> this node (egress) | inet input | `iif` (its veth) |
//! | anything -> routed pod, this node included (ingress) | inet postrouting, priority srcnat + 1 | `oif` (its veth) |
//! | bridged pod -> bridged pod, same bridge (L2) | egress: inet forward, ingress: inet postrouting, both via br_netfilter | source address (egress), destination address (ingress), `iifkind`/`oifkind` `bridge` |
//! | bridged pod -> other node, routed pod, world | inet forward | source address, `iifkind bridge` |
//! | bridged pod -> this node | inet input | source address, `iifkind bridge` |
//! | anything -> bridged pod, this node included | inet postrouting, priority srcnat + 1 | destination address, `oifkind bridge` |
//! | source validation of a bridged pod | bridge prerouting, before br_netfilter and conntrack | the port (`iif`) |
//!
//! # Why ingress is decided in postrouting
//!
//! A pod's ingress is decided on the packet the pod receives, after all NAT,
//! as the eBPF datapath does in `to_pod` (tc on the pod's host-side veth,
//! after the whole IP stack). kube-proxy's source NAT (the masquerade of an
//! `externalTrafficPolicy: Cluster` NodePort, of hairpin traffic) runs in
//! nat postrouting at priority `srcnat` (100); the ingress chain runs just
//! after it (101), where the pod's port (after the DNAT) and source are
//! final. A connection that masquerade gave the node's own address is not
//! admitted as the host for that: `ct status snat` sends it to the
//! chain's copy `ep_<id>_in_nat`, which decides on conntrack's original
//! source (the client, the pod), so only a connection that began at a host
//! address is the host (chain.rs, `Source`). Egress stays in forward and input (priority `filter`): destination
//! NAT (prerouting, output) is done by then, source NAT is not, so it sees
//! the pod's own source and the translated destination. Forwarded, locally generated (kubelet probes) and, with
//! br_netfilter, bridged packets (`oif` = the bridge) all cross inet
//! postrouting exactly once; traffic for this node's own sockets never
//! does (that is only ever a pod's egress). Conntrack is attached in
//! prerouting/output and confirmed after postrouting, so `ct state
//! established,related` in the ingress chain admits replies as before, and
//! a new connection dropped there is never confirmed.
//!
//! Each packet meets each endpoint chain at most once: a bridge is never
//! an endpoint's interface, and a veth is never of kind `bridge`. The
//! address maps hold every endpoint that has an interface; a routed pod's
//! address is never seen with a bridge as `oif`, and as a source from a
//! bridge only when spoofed from a port that is not an endpoint's (it then
//! meets that endpoint's egress chain: it can only be denied more).
//! Attributing by address is exact because the bridge table drops, on the
//! port, every IP frame of an endpoint whose source is not one of its
//! addresses (ICMPv6 neighbour discovery and MLD excepted), as the eBPF
//! datapath's egress does. Limits: without br_netfilter, bridged pod-to-pod
//! traffic never reaches `inet` and is not enforced (routed traffic is);
//! a bridge with a VLAN device on top (the logical device is then the VLAN
//! device) is not covered; traffic to an address a bridged pod holds that
//! is not its endpoint's passes without its ingress chain.
//!
//! All base chains are `type filter`, policy `accept` (priority `filter`,
//! the ingress chain `srcnat + 1`), so traffic that touches no endpoint
//! interface is untouched. Packets from a
//! pod's host-side interface (`iif`) are the pod's egress, packets to it
//! (`oif`) its ingress. Dispatch is one verdict-map lookup keyed on the
//! ifindex (from [`crate::Interfaces`]; rendering needs no interface names, so
//! [`render`] is pure and the table can be loaded before the interface
//! exists), so the per-packet cost does not grow with the number of
//! endpoints. Endpoint chains are entered with `jump` and end an allowed
//! packet with `return`: a pod-to-pod packet on one node is checked by the
//! source's egress chain (forward), then by the destination's ingress chain
//! (postrouting), and is dropped if either denies.
//!
//! # Order inside an endpoint chain (the datapath's steps of `npm-common`)
//!
//! 1. ICMPv6 neighbour discovery and MLD (types 130-137, 143): allowed
//!    (`icmpv6_control`), in both directions as in the eBPF datapath, so that
//!    the node's link-local neighbour solicitations reach isolated pods.
//! 2. Egress only: a source address that is not the endpoint's own (or any
//!    packet of a family the endpoint has no address in): drop (`spoofed`).
//! 3. Kernel conntrack `ct state established,related`: allowed (`tracked`).
//!    Replies of allowed connections pass both chains, and connections that
//!    were established before a policy change **survive it** (the table is
//!    replaced, conntrack is not flushed) — the same as the eBPF datapath's
//!    own conntrack. `ct state invalid`: drop (`malformed`).
//! 4. Not isolated in this direction and no tier chain: allowed
//!    (`not_isolated`). An endpoint without ClusterNetworkPolicy entries
//!    stops here exactly as before tiers existed.
//! 5. Ingress only: source in the [`npm_common::IDENTITY_HOST`] set: allowed
//!    (`host`), before every tier (kubelet probes always work).
//! 6. Admin tier chain, if any (`jump ep_<id>_<dir>_admin`): its entries as
//!    rules in rank order, so the first match is the lowest-ranked entry,
//!    i.e. the first matching rule of the highest-priority CNP: `Accept` ->
//!    `accept` (`admin_accept`), `Deny` -> `drop` (`admin_deny`, silent),
//!    `Pass` -> `return` to this chain; no match -> the chain ends (return).
//! 7. NetworkPolicy isolates the endpoint in this direction: one rule per
//!    policy entry of the endpoint's subject (`PolicyEntry::subject` equal
//!    to `Endpoint::identity`: the endpoints of one pod identity each have
//!    their own chain with the same entries, so log prefixes, allow
//!    reporting and the deny counter stay per endpoint): peer set (source for ingress, destination for egress;
//!    none for [`npm_common::IDENTITY_ANY`]), `meta l4proto`, `th dport`
//!    (single port or range): allowed (`policy`); otherwise drop
//!    (`policy_denied`). The Baseline tier is not consulted.
//! 8. Not isolated: Baseline tier chain, if any (`jump ..._baseline`), the
//!    same way (`baseline_accept`, `baseline_deny`, Pass and no match
//!    return), then allowed (`not_isolated`).
//!
//! Drops are silent (no RST, no ICMP). A tier entry's peer is the same
//! per-identity set as a policy entry's (pod or node identity, CIDR
//! identity; [`npm_common::IDENTITY_ANY`] matches everything) and
//! `protocol: None` matches every protocol, ICMP included. A tier chain
//! exists when the endpoint's `Endpoint::tiers` flag is set for the tier
//! and direction, as the datapath consults a tier (the compiler sets the
//! flag iff there are entries). Service traffic needs nothing more:
//! egress is decided in forward/input after DNAT (on the backend's
//! address), ingress in postrouting, by the same chains.
//!
//! Fragments are reassembled by conntrack's defragmentation before the
//! filter hooks, so the datapath's fragment tracking has no counterpart here;
//! non-IP traffic never reaches an `inet` table.
//!
//! A CIDR identity `P` matches the addresses whose longest prefix among
//! `Compiled::cidrs` is `P`, i.e. `P` minus the more specific prefixes inside
//! it; the difference is computed exactly into disjoint ranges. For pod
//! addresses this equals the ipcache's `cidr_identity`, which the compiler
//! derives the same way. Sets are per family: an IPv6 ipBlock never matches
//! an IPv4 address, as the NetworkPolicy API means it (the eBPF datapath's
//! single IPv4-mapped prefix trie lets e.g. `::/0` match IPv4 peers).
//!
//! # Updates
//!
//! [`NftDataplane::sync_full`](crate::Dataplane::sync_full) replaces the whole
//! table with one `nft -f -` (add table, delete table, add table with
//! contents: a single atomic transaction, so no packet ever sees a partial
//! table). Deleting the table would reset its named counters, so the
//! dataplane reads them just before and declares the new table's counters
//! with those values: the table always holds the totals, and a restarted
//! agent (a new [`NftDataplane`]) carries them on (packets counted between
//! that read and the replace are lost from the counters, not from
//! enforcement).
//!
//! [`NftDataplane::apply`](crate::Dataplane::apply) renders the next state
//! into objects (sets with their elements, endpoint chains with their rules,
//! dispatch entries), compares them with what it programmed, and sends only
//! the differences (element adds and deletes, a flush and refill of each
//! changed chain, added and removed chains and sets, tier chains included:
//! new chains are all created before any rule, so a jump never precedes its
//! target; the tier counters are added, never removed) as one `nft -f -`
//! transaction, so an update is atomic too and the kernel work follows the
//! size of the change rather than of the table (rendering the objects stays
//! linear in the compiled form). Counters are untouched by an update. If the
//! transaction fails, it falls back to the full replace.

mod adopt;
mod chain;
pub mod conntrack;
pub mod nflog;
mod ranges;
mod render;
mod rule_counts;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::net::IpAddr;
use std::process::{Command, Stdio};

use npm_common::{DIR_EGRESS, DIR_INGRESS};
use npm_policy::compiled::{Compiled, CompiledDiff, Direction};

pub use adopt::NftAdopted;
pub use chain::tier_chain_name;
pub use render::{chain_name, counter_name, render};

use crate::{Counters, Dataplane, DataplaneError, Interfaces};

/// Settings of the nftables dataplane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftOptions {
    /// Name of the `inet` table (letters, digits and `_`, starting with a letter).
    pub table: String,
    /// Network namespace (a name under `/run/netns`) to program through
    /// `ip netns exec`; `None` programs the caller's namespace.
    pub netns: Option<String>,
}

impl Default for NftOptions {
    fn default() -> Self {
        NftOptions {
            table: "npm".to_string(),
            netns: None,
        }
    }
}

/// Errors of the nftables dataplane.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// The table or namespace name cannot be used.
    #[error("invalid {what} name {name:?}: {why}")]
    InvalidName {
        /// `table` or `netns`.
        what: &'static str,
        /// The rejected name.
        name: String,
        /// Why it is rejected.
        why: &'static str,
    },
    /// `nft` (or `ip netns exec`) could not be started or fed.
    #[error("cannot run `{command}`: {source}")]
    Spawn {
        /// The command line.
        command: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `nft` exited with an error.
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        /// The command line.
        command: String,
        /// Exit status as text (`exit status: 1`, or the signal).
        status: String,
        /// What `nft` wrote to stderr.
        stderr: String,
    },
    /// `nft -j` output is not JSON.
    #[error("unexpected output of `{command}`: not JSON: {source}")]
    NotJson {
        /// The command line.
        command: String,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// `nft -j` output could not be understood.
    #[error("unexpected output of `{command}`: {detail}")]
    BadOutput {
        /// The command line.
        command: String,
        /// What was wrong with it.
        detail: String,
    },
}

impl From<NftError> for DataplaneError {
    fn from(e: NftError) -> Self {
        let op = match &e {
            NftError::InvalidName { what, .. } => format!("nft: {what} name"),
            NftError::Spawn { command, .. }
            | NftError::Failed { command, .. }
            | NftError::NotJson { command, .. }
            | NftError::BadOutput { command, .. } => command.clone(),
        };
        DataplaneError::Nft { op, source: e }
    }
}

fn check_name(what: &'static str, name: &str, extra: &[char]) -> Result<(), NftError> {
    let bad = |why| NftError::InvalidName {
        what,
        name: name.to_string(),
        why,
    };
    if name.is_empty() || name.len() > 64 {
        return Err(bad("must be 1 to 64 characters long"));
    }
    if !name.starts_with(|c: char| c.is_ascii_alphabetic()) {
        return Err(bad("must start with an ASCII letter"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || extra.contains(&c))
    {
        return Err(bad("may only hold ASCII letters, digits and '_'"));
    }
    Ok(())
}

/// Runs `nft` with `args` (in `opts.netns` if set), feeding `stdin`; returns stdout.
fn run_nft(opts: &NftOptions, args: &[&str], stdin: Option<&str>) -> Result<String, NftError> {
    let mut cmd = match &opts.netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns.as_str(), "nft"]);
            c
        }
        None => Command::new("nft"),
    };
    cmd.args(args);
    let command = match &opts.netns {
        Some(ns) => format!("ip netns exec {ns} nft {}", args.join(" ")),
        None => format!("nft {}", args.join(" ")),
    };
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|source| NftError::Spawn {
        command: command.clone(),
        source,
    })?;
    if let Some(input) = stdin {
        // Take the pipe so it is closed (EOF) once written.
        if let Some(mut pipe) = child.stdin.take() {
            pipe.write_all(input.as_bytes()).map_err(|source| NftError::Spawn {
                command: command.clone(),
                source,
            })?;
        }
    }
    let out = child.wait_with_output().map_err(|source| NftError::Spawn {
        command: command.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(NftError::Failed {
            command,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// (direction, reason) -> (packets, bytes), as in [`Counters::by_reason`].
type CounterMap = BTreeMap<(u8, u8), (u64, u64)>;

/// True when `e` says the table does not exist.
fn is_missing_table(e: &NftError) -> bool {
    matches!(e, NftError::Failed { stderr, .. } if stderr.contains("No such file or directory"))
}

/// Parses `nft -j list counters ...` into raw per-(direction, reason) values.
fn parse_counters(command: &str, json: &str) -> Result<CounterMap, NftError> {
    let bad = |detail: String| NftError::BadOutput {
        command: command.to_string(),
        detail,
    };
    let v: serde_json::Value = serde_json::from_str(json).map_err(|source| NftError::NotJson {
        command: command.to_string(),
        source,
    })?;
    let items = v
        .get("nftables")
        .and_then(|n| n.as_array())
        .ok_or_else(|| bad("no \"nftables\" array".to_string()))?;
    let mut names = BTreeMap::new();
    for dir in [DIR_INGRESS, DIR_EGRESS] {
        for reason in render::counted_reasons(dir).iter().chain(&chain::TIER_REASONS) {
            names.insert(counter_name(dir, *reason), (dir, *reason as u8));
        }
    }
    let mut out = BTreeMap::new();
    for item in items {
        let Some(c) = item.get("counter") else { continue };
        let name = c
            .get("name")
            .and_then(|n| n.as_str())
            .ok_or_else(|| bad(format!("counter without a name: {c}")))?;
        let Some(key) = names.get(name) else { continue };
        let num = |field: &str| {
            c.get(field)
                .and_then(|x| x.as_u64())
                .ok_or_else(|| bad(format!("counter {name} has no numeric {field:?}")))
        };
        out.insert(*key, (num("packets")?, num("bytes")?));
    }
    Ok(out)
}

/// The nftables dataplane (see the module documentation).
#[derive(Debug)]
pub struct NftDataplane {
    opts: NftOptions,
    /// What the table holds since the last successful load or update.
    programmed: Option<render::Model>,
    /// Whole-table replaces done.
    full_loads: u64,
    /// Incremental updates applied.
    incremental_updates: u64,
    /// What the table held when the dataplane was created (`adopt.rs`).
    adopted: Option<NftAdopted>,
    /// The NFLOG reader of the flow events, once opened
    /// ([`NftDataplane::open_flow_events`], `nflog.rs`).
    nflog: Option<nflog::NflogReader>,
    /// Each endpoint address's owner (pod UID) as last programmed, once the
    /// conntrack entries of the addresses that changed owner were deleted
    /// (`conntrack.rs`); `None` before the first sync.
    owners: Option<BTreeMap<IpAddr, u64>>,
    /// Conntrack entries deleted for addresses that changed owner.
    ct_flushed: u64,
    /// The endpoints under connection semantics `enforce`
    /// ([`Dataplane::set_established_enforce`]).
    enforce: BTreeSet<u32>,
    /// The connections cut since the last [`NftDataplane::take_cut_events`],
    /// as flow events (`Reason::ConnectionCut`).
    cut_events: Vec<npm_common::DenyEvent>,
}

impl NftDataplane {
    /// A dataplane for the table and namespace of `opts`. Reads the table
    /// a previous agent left ([`NftDataplane::adopted`]) and writes nothing
    /// until the first [`Dataplane::sync_full`].
    pub fn new(opts: NftOptions) -> Result<Self, NftError> {
        check_name("table", &opts.table, &[])?;
        if let Some(ns) = &opts.netns {
            check_name("netns", ns, &['-', '.'])?;
        }
        let mut dp = NftDataplane {
            opts,
            programmed: None,
            full_loads: 0,
            incremental_updates: 0,
            adopted: None,
            nflog: None,
            owners: None,
            ct_flushed: 0,
            enforce: BTreeSet::new(),
            cut_events: Vec::new(),
        };
        // A previous agent's table, read only: the first full sync is
        // guarded against it.
        dp.adopted = dp.read_adopted().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "reading the nft table a previous agent left (the first sync is not guarded against it)");
            None
        });
        Ok(dp)
    }

    /// The settings.
    pub fn options(&self) -> &NftOptions {
        &self.opts
    }

    /// Number of whole-table replaces so far (each `sync_full`, plus updates
    /// that fell back to a replace).
    pub fn full_loads(&self) -> u64 {
        self.full_loads
    }

    /// Number of incremental updates applied so far (no-op updates excluded).
    pub fn incremental_updates(&self) -> u64 {
        self.incremental_updates
    }

    /// Replaces the whole table with the rendering of `compiled` in one
    /// transaction, carrying the counters of the table it replaces over.
    pub fn load(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), NftError> {
        self.load_model(render::model(compiled, interfaces))
    }

    fn load_model(&mut self, model: render::Model) -> Result<(), NftError> {
        // The replace resets the named counters: the new table starts at the
        // values the old one holds now.
        let counters = self.table_counters("inet")?.unwrap_or_default();
        let bridge_counters = self.table_counters("bridge")?.unwrap_or_default();
        self.programmed = None;
        let script = render::full_script(&model, &self.opts.table, &counters, &bridge_counters);
        run_nft(&self.opts, &["-f", "-"], Some(&script))?;
        self.programmed = Some(model);
        self.full_loads += 1;
        Ok(())
    }

    /// Updates the table to the rendering of `compiled`, changing only the
    /// sets, elements, chains and dispatch entries that differ, in one
    /// transaction; counters keep counting. Without a known programmed state
    /// (nothing loaded yet, or a failed update) this is [`NftDataplane::load`].
    pub fn update(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), NftError> {
        let next = render::model(compiled, interfaces);
        let Some(current) = self.programmed.take() else {
            return self.load_model(next);
        };
        let Some(script) = render::incremental_script(&current, &next, &self.opts.table) else {
            self.programmed = Some(current);
            return Ok(());
        };
        match run_nft(&self.opts, &["-f", "-"], Some(&script)) {
            Ok(_) => {
                self.programmed = Some(next);
                self.incremental_updates += 1;
                Ok(())
            }
            Err(e) => {
                // The transaction did not apply: the table is as it was, but
                // may differ from what we think (edited by hand?). Replace it.
                tracing::warn!(table = %self.opts.table, error = %e, "incremental nft update failed, replacing the table");
                self.load_model(next)
            }
        }
    }

    /// Counters of the table of `family` (`inet` or `bridge`) as it is
    /// now, `None` when there is no such table.
    fn table_counters(&self, family: &str) -> Result<Option<CounterMap>, NftError> {
        let table = self.opts.table.as_str();
        let args = ["-j", "list", "counters", "table", family, table];
        match run_nft(&self.opts, &args, None) {
            Ok(json) => Ok(Some(parse_counters(&format!("nft {}", args.join(" ")), &json)?)),
            Err(e) if is_missing_table(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `nft list table inet <table>` as text, followed by `nft list table
    /// bridge <table>` when that table exists (an error only when the
    /// `inet` table is missing).
    pub fn list_table(&self) -> Result<String, NftError> {
        let mut text = run_nft(&self.opts, &["list", "table", "inet", &self.opts.table], None)?;
        match run_nft(&self.opts, &["list", "table", "bridge", &self.opts.table], None) {
            Ok(bridge) => text.push_str(&bridge),
            Err(e) if is_missing_table(&e) => {}
            Err(e) => return Err(e),
        }
        Ok(text)
    }

    /// Deletes the `inet` and the `bridge` table (no error if they do not
    /// exist). Traffic is no longer filtered afterwards.
    pub fn remove(&mut self) -> Result<(), NftError> {
        let t = &self.opts.table;
        let script =
            format!("table inet {t} {{}}\ndelete table inet {t}\ntable bridge {t} {{}}\ndelete table bridge {t}\n");
        self.programmed = None;
        run_nft(&self.opts, &["-f", "-"], Some(&script))?;
        Ok(())
    }
}

impl NftDataplane {
    /// After a table change to `c`: deletes the kernel conntrack entries of
    /// the addresses that left their endpoint or changed owner since the
    /// last call (`conntrack.rs`). On failure the previous owners are kept,
    /// so the next table change tries them again.
    fn flush_changed_owners(&mut self, c: &Compiled) {
        let new = conntrack::owners(c);
        let stale = match &self.owners {
            Some(old) => conntrack::changed_owners(old, &new),
            None => Vec::new(),
        };
        match conntrack::flush_addresses(self.opts.netns.as_deref(), &stale) {
            Ok(n) => {
                if n > 0 {
                    tracing::info!(entries = n, addresses = ?stale, "conntrack entries of addresses that changed owner deleted");
                }
                self.ct_flushed += n as u64;
                self.owners = Some(new);
            }
            Err(e) => {
                tracing::error!(error = %e, addresses = ?stale, "deleting the conntrack entries of addresses that changed owner (retried at the next change)");
            }
        }
    }

    /// Conntrack entries deleted so far for addresses that changed owner.
    pub fn conntrack_flushed(&self) -> u64 {
        self.ct_flushed
    }

    /// Connection semantics `enforce`, after a table change to `c`: the
    /// kernel conntrack entries of the `enforce` endpoints' connections
    /// that `c` denies are deleted (`conntrack::cut_denied`), each becoming
    /// a flow event (`Reason::ConnectionCut`). A failure is logged: the
    /// next table change tries again.
    fn cut_denied(&mut self, c: &Compiled, interfaces: &Interfaces) {
        if self.enforce.is_empty() {
            return;
        }
        match conntrack::cut_denied(self.opts.netns.as_deref(), c, &self.enforce) {
            Ok(cuts) => {
                if !cuts.is_empty() {
                    tracing::info!(
                        connections = cuts.len(),
                        "established connections the new policy denies cut"
                    );
                }
                let now = monotonic_ns();
                for cut in cuts {
                    self.cut_events.push(cut_event(&cut, interfaces, now));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "cutting the established connections the new policy denies (retried at the next change)");
            }
        }
    }

    /// The connections cut since the last call, as flow events (reason
    /// `Reason::ConnectionCut`, direction the one that now denies, the
    /// 5-tuple of the original packet as the endpoint saw it).
    pub fn take_cut_events(&mut self) -> Vec<npm_common::DenyEvent> {
        std::mem::take(&mut self.cut_events)
    }
}

/// `CLOCK_MONOTONIC` in ns (the clock of the datapath's events).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The flow event of a cut: the original packet (egress: the endpoint to
/// the destination it reached; ingress: the source the pod saw to the
/// endpoint).
fn cut_event(cut: &conntrack::Cut, interfaces: &Interfaces, ts_ns: u64) -> npm_common::DenyEvent {
    let f = &cut.flow;
    let (src, dst, sport) = match cut.direction {
        Direction::Egress => (f.orig_src, f.reply_src, f.orig_sport),
        Direction::Ingress => (f.reply_dst, f.reply_src, f.orig_sport),
    };
    let mapped = |a: IpAddr| match a {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    npm_common::DenyEvent {
        ts_ns,
        endpoint: cut.endpoint,
        ifindex: interfaces.get(&cut.endpoint).copied().unwrap_or(0),
        direction: match cut.direction {
            Direction::Ingress => DIR_INGRESS,
            Direction::Egress => DIR_EGRESS,
        },
        reason: npm_common::Reason::ConnectionCut as u8,
        protocol: f.protocol,
        family: if src.is_ipv4() { 4 } else { 6 },
        sport,
        dport: f.reply_sport,
        src: mapped(src),
        dst: mapped(dst),
    }
}

impl Dataplane for NftDataplane {
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.load(compiled, interfaces)?;
        self.flush_changed_owners(compiled);
        self.cut_denied(compiled, interfaces);
        Ok(())
    }

    fn apply(&mut self, _diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        // The rendered objects are compared, not the diff: a change of one
        // CIDR prefix reshapes other identities' sets, and interfaces may
        // change without a diff.
        self.update(next, interfaces)?;
        self.flush_changed_owners(next);
        self.cut_denied(next, interfaces);
        Ok(())
    }

    fn counters(&self) -> Result<Counters, DataplaneError> {
        // Spoofed frames of bridged pods are counted in the bridge table.
        let mut by_reason = self.table_counters("inet")?.unwrap_or_default();
        for (key, (packets, bytes)) in self.table_counters("bridge")?.unwrap_or_default() {
            let e = by_reason.entry(key).or_default();
            e.0 += packets;
            e.1 += bytes;
        }
        let rules = self.rule_counts()?;
        Ok(Counters { by_reason, rules })
    }

    fn set_established_enforce(&mut self, endpoints: BTreeSet<u32>) {
        self.enforce = endpoints;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_common::Reason;

    #[test]
    fn names_are_checked() {
        assert!(NftDataplane::new(NftOptions::default()).is_ok());
        for bad in ["", "1abc", "a b", "a;b", "x}"] {
            let opts = NftOptions {
                table: bad.to_string(),
                netns: None,
            };
            let err = NftDataplane::new(opts).unwrap_err();
            assert!(
                matches!(err, NftError::InvalidName { what: "table", .. }),
                "{bad}: {err}"
            );
        }
        let opts = NftOptions {
            table: "t".into(),
            netns: Some("ns;rm".into()),
        };
        assert!(matches!(
            NftDataplane::new(opts).unwrap_err(),
            NftError::InvalidName { what: "netns", .. }
        ));
    }

    #[test]
    fn counters_parse_and_reject_garbage() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
            {"counter": {"family": "inet", "name": "in_policy_denied", "table": "x", "handle": 3, "packets": 4, "bytes": 240}},
            {"counter": {"family": "inet", "name": "out_spoofed", "table": "x", "handle": 4, "packets": 1, "bytes": 60}},
            {"counter": {"family": "inet", "name": "foreign", "table": "x", "handle": 5, "packets": 9, "bytes": 9}}]}"#;
        let got = parse_counters("nft", json).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[&(DIR_INGRESS, Reason::PolicyDenied as u8)], (4, 240));
        assert_eq!(got[&(DIR_EGRESS, Reason::Spoofed as u8)], (1, 60));
        assert!(matches!(parse_counters("nft", "{"), Err(NftError::NotJson { .. })));
        assert!(matches!(parse_counters("nft", "{}"), Err(NftError::BadOutput { .. })));
        let no_packets = r#"{"nftables": [{"counter": {"name": "in_policy", "bytes": 1}}]}"#;
        assert!(matches!(
            parse_counters("nft", no_packets),
            Err(NftError::BadOutput { .. })
        ));
    }
}

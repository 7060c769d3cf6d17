//! Shared helpers of the eBPF tests: a packet builder, kernel object guards
//! (dummy interfaces, pin directories, network namespaces) with unique
//! names that are removed on drop and swept when a crashed run left them.
#![allow(dead_code)]

pub use crate::netns_common::*;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::process::Command;

use npm_dataplane::ebpf::tc_filters::{list_filters, TcFilter};
use npm_dataplane::ebpf::{AttachMode, EbpfDataplane, EbpfOptions};
use npm_policy::compiled::{Compiled, Direction, PolicyEntry, Tier, TierAction, TierEntry, TierValue};
use npm_policy::model::Protocol;

/// Removes interfaces, netns and pin dirs left by crashed runs of any of
/// these tests (names carry the pid of their creator).
pub fn sweep_leftovers() {
    for n in dead_names(dir_names("/sys/class/net").into_iter(), "npt") {
        sh_quiet(&["ip", "link", "del", &n]);
    }
    clear_netns_leftovers("npmt-");
    for n in dead_names(dir_names("/sys/fs/bpf").into_iter(), "npm-test-") {
        let _ = std::fs::remove_dir_all(format!("/sys/fs/bpf/{n}"));
    }
}

/// Program ids attached with tcx to `ifname`: (ingress hook, egress hook).
pub fn tcx_prog_ids(ifname: &str) -> (Vec<u32>, Vec<u32>) {
    let ids = |t| {
        aya::programs::SchedClassifier::query_tcx(ifname, t)
            .expect("query tcx")
            .1
            .iter()
            .map(|p| p.id())
            .collect::<Vec<_>>()
    };
    (
        ids(aya::programs::TcAttachType::Ingress),
        ids(aya::programs::TcAttachType::Egress),
    )
}

/// The `bpf` filters on the `clsact` hooks of `ifname` (netlink dump):
/// (ingress hook, egress hook).
pub fn tc_filters(ifname: &str) -> (Vec<TcFilter>, Vec<TcFilter>) {
    let i = ifindex_of(ifname);
    (
        list_filters(i, aya::programs::TcAttachType::Ingress).expect("dump ingress filters"),
        list_filters(i, aya::programs::TcAttachType::Egress).expect("dump egress filters"),
    )
}

/// Program ids attached to `ifname` in `mode` (tcx links, or every `bpf`
/// filter on the `clsact` hooks): (ingress hook, egress hook).
pub fn prog_ids(ifname: &str, mode: AttachMode) -> (Vec<u32>, Vec<u32>) {
    match mode {
        AttachMode::Tc => {
            let (i, e) = tc_filters(ifname);
            let ids = |f: Vec<TcFilter>| f.iter().map(|f| f.prog_id).collect();
            (ids(i), ids(e))
        }
        _ => tcx_prog_ids(ifname),
    }
}

/// [`prog_ids`] once each hook of `ifname` holds `counts` (ingress, egress)
/// programs, or after 2 s (see [`tcx_prog_ids_settled`]).
pub fn prog_ids_settled(ifname: &str, mode: AttachMode, counts: (usize, usize)) -> (Vec<u32>, Vec<u32>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let ids = prog_ids(ifname, mode);
        if (ids.0.len(), ids.1.len()) == counts || std::time::Instant::now() >= deadline {
            return ids;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// `tc filter show dev <ifname> <ingress|egress>` as iproute2 prints it
/// (an independent view of the kernel's filters).
pub fn tc_show(ifname: &str, hook: &str) -> String {
    let out = Command::new("tc")
        .args(["filter", "show", "dev", ifname, hook])
        .output()
        .expect("run tc");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The qdiscs of `ifname` as `tc qdisc show` prints them.
pub fn tc_qdiscs(ifname: &str) -> String {
    let out = Command::new("tc")
        .args(["qdisc", "show", "dev", ifname])
        .output()
        .expect("run tc");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// [`tcx_prog_ids`] once each hook of `ifname` holds `counts` (ingress,
/// egress) programs, or after 2 s: the kernel releases an unpinned link
/// (and detaches its program) from a workqueue, not within the unlink.
pub fn tcx_prog_ids_settled(ifname: &str, counts: (usize, usize)) -> (Vec<u32>, Vec<u32>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let ids = tcx_prog_ids(ifname);
        if (ids.0.len(), ids.1.len()) == counts || std::time::Instant::now() >= deadline {
            return ids;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A veth pair in the root netns (this kernel has no dummy driver), deleted
/// on drop. Its ifindex is a valid endpoint interface for test runs (the
/// kernel binds the test skb to it).
pub struct Dummy {
    /// Name.
    pub name: String,
    /// ifindex.
    pub ifindex: u32,
}

impl Dummy {
    /// Creates `npt<pid><tag>` (tag: a few letters).
    pub fn new(tag: &str) -> Dummy {
        let name = format!("npt{}{}", std::process::id(), tag);
        let peer = format!("{name}x");
        assert!(peer.len() < 16, "interface name {peer} too long");
        sh_quiet(&["ip", "link", "del", &name]);
        sh(&["ip", "link", "add", &name, "type", "veth", "peer", "name", &peer]);
        // No IPv6 on either end: with it, the kernel sends its own ICMPv6
        // control packets (router solicitations, MLD reports) through the
        // up end even without a carrier, and they run the attached
        // `to_pod`, moving counters under a test run (the fuzzer saw them
        // as frames counted twice).
        for n in [&name, &peer] {
            std::fs::write(format!("/proc/sys/net/ipv6/conf/{n}/disable_ipv6"), "1")
                .unwrap_or_else(|e| panic!("disable IPv6 on {n}: {e}"));
        }
        sh(&["ip", "link", "set", &name, "up"]);
        let ifindex = ifindex_of(&name);
        Dummy { name, ifindex }
    }
}

impl Drop for Dummy {
    fn drop(&mut self) {
        sh_quiet(&["ip", "link", "del", &self.name]);
    }
}

/// The ifindex of an interface in the current netns.
pub fn ifindex_of(name: &str) -> u32 {
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .unwrap_or_else(|e| panic!("ifindex of {name}: {e}"))
        .trim()
        .parse()
        .unwrap()
}

/// A bpffs pin directory, removed (maps and links unpinned) on drop.
pub struct PinDir {
    /// The path.
    pub path: PathBuf,
}

/// The tests' attach mode: tcx, or tc `clsact` filters where the kernel
/// has no tcx (before 6.6: the Debian 6.1 row of `cargo xtask vm matrix`).
pub fn default_mode() -> AttachMode {
    if npm_dataplane::ebpf::tcx_supported() {
        AttachMode::Tcx
    } else {
        AttachMode::Tc
    }
}

impl PinDir {
    /// `/sys/fs/bpf/npm-test-<pid>-<tag>`.
    pub fn new(tag: &str) -> PinDir {
        npm_dataplane::ebpf::ensure_bpffs().unwrap();
        let path = PathBuf::from(format!("/sys/fs/bpf/npm-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        PinDir { path }
    }

    /// Options pinning there, attaching with tcx (tests that run in
    /// parallel must not let `auto` see each other's tc filters), or with tc
    /// `clsact` filters on a kernel without tcx (before 6.6), so the tests
    /// that are not about the attach mode run on both.
    pub fn options(&self) -> EbpfOptions {
        self.options_in(default_mode())
    }

    /// Options pinning there, attaching in `mode`.
    pub fn options_in(&self, mode: AttachMode) -> EbpfOptions {
        EbpfOptions {
            object: None,
            pin_dir: self.path.clone(),
            bench_no_ct_create: false,
            attach: mode,
        }
    }

    /// Opens a dataplane pinned there, in [`default_mode`].
    pub fn open(&self) -> EbpfDataplane {
        self.open_in(default_mode())
    }

    /// Opens a dataplane pinned there, attaching in `mode`.
    pub fn open_in(&self, mode: AttachMode) -> EbpfDataplane {
        EbpfDataplane::open(self.options_in(mode)).unwrap_or_else(|e| panic!("open: {e}"))
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A network namespace `npmt-<pid>-<tag>`, deleted on drop.
pub fn test_netns(tag: &str) -> Netns {
    Netns::new(&format!("npmt-{}-{tag}", std::process::id()))
}

// ---------------------------------------------------------------- packets

/// An L4 header to put in a packet.
#[derive(Clone, Debug)]
pub enum L4 {
    /// TCP with flags (0x02 SYN, 0x10 ACK, 0x01 FIN, 0x04 RST).
    Tcp(u16, u16, u8),
    /// UDP.
    Udp(u16, u16),
    /// SCTP common header.
    Sctp(u16, u16),
    /// ICMP (type, id).
    Icmp(u8, u16),
    /// ICMPv6 (type, id).
    Icmp6(u8, u16),
    /// Raw protocol number and payload.
    Raw(u8, Vec<u8>),
}

impl L4 {
    /// Protocol number.
    pub fn proto(&self) -> u8 {
        match self {
            L4::Tcp(..) => 6,
            L4::Udp(..) => 17,
            L4::Sctp(..) => 132,
            L4::Icmp(..) => 1,
            L4::Icmp6(..) => 58,
            L4::Raw(p, _) => *p,
        }
    }

    /// Header bytes (plus a few payload bytes).
    pub fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            L4::Tcp(s, d, f) => {
                b.extend(s.to_be_bytes());
                b.extend(d.to_be_bytes());
                b.extend([0, 0, 0, 1, 0, 0, 0, 0]);
                b.push(5 << 4);
                b.push(*f);
                b.extend([0xff, 0xff, 0, 0, 0, 0]);
            }
            L4::Udp(s, d) => {
                b.extend(s.to_be_bytes());
                b.extend(d.to_be_bytes());
                // 12 payload bytes: an IPv4 frame is then 54 bytes, long
                // enough for the datapath's IPv4 fast path.
                b.extend(20u16.to_be_bytes());
                b.extend([0, 0]);
                b.extend(*b"ping-padding");
            }
            L4::Sctp(s, d) => {
                b.extend(s.to_be_bytes());
                b.extend(d.to_be_bytes());
                b.extend([0, 0, 0, 1, 0, 0, 0, 0]);
            }
            L4::Icmp(t, id) | L4::Icmp6(t, id) => {
                b.extend([*t, 0, 0, 0]);
                b.extend(id.to_be_bytes());
                b.extend([0, 1, 1, 2, 3, 4]);
            }
            L4::Raw(_, p) => b.extend(p),
        }
        b
    }
}

fn eth(ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
    f.extend(ethertype.to_be_bytes());
    f.extend(payload);
    f
}

/// An IPv4 header (with `options`) and payload; `frag` is the 16-bit
/// flags/offset field.
pub fn ipv4_raw(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    id: u16,
    frag: u16,
    options: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    assert_eq!(options.len() % 4, 0);
    let ihl = 20 + options.len();
    let tot = (ihl + payload.len()) as u16;
    let mut h = vec![0x40 | (ihl / 4) as u8, 0];
    h.extend(tot.to_be_bytes());
    h.extend(id.to_be_bytes());
    h.extend(frag.to_be_bytes());
    h.extend([64, proto, 0, 0]);
    h.extend(src.octets());
    h.extend(dst.octets());
    h.extend(options);
    h.extend(payload);
    eth(0x0800, &h)
}

/// An IPv4 packet.
pub fn v4(src: &str, dst: &str, l4: L4) -> Vec<u8> {
    ipv4_raw(
        src.parse().unwrap(),
        dst.parse().unwrap(),
        l4.proto(),
        1,
        0,
        &[],
        &l4.bytes(),
    )
}

/// An IPv6 extension header.
#[derive(Clone, Debug)]
pub enum Ext {
    /// Hop-by-hop options (8 bytes).
    HopByHop,
    /// Routing header (8 bytes, type 0 with 0 segments left).
    Routing,
    /// Destination options (8 bytes).
    DestOpts,
    /// Authentication header (12 bytes).
    Ah,
    /// Fragment header (offset in 8-byte units, more-fragments, id).
    Fragment(u16, bool, u32),
}

impl Ext {
    fn code(&self) -> u8 {
        match self {
            Ext::HopByHop => 0,
            Ext::Routing => 43,
            Ext::DestOpts => 60,
            Ext::Ah => 51,
            Ext::Fragment(..) => 44,
        }
    }
}

/// An IPv6 packet with extension headers; a non-first fragment carries
/// `l4`'s bytes as opaque payload.
pub fn v6_ext(src: &str, dst: &str, exts: &[Ext], l4: L4) -> Vec<u8> {
    let src: Ipv6Addr = src.parse().unwrap();
    let dst: Ipv6Addr = dst.parse().unwrap();
    let mut body = Vec::new();
    for (i, e) in exts.iter().enumerate() {
        let next = exts.get(i + 1).map(Ext::code).unwrap_or(l4.proto());
        match e {
            Ext::HopByHop | Ext::DestOpts => body.extend([next, 0, 1, 4, 0, 0, 0, 0]),
            Ext::Routing => body.extend([next, 0, 0, 0, 0, 0, 0, 0]),
            Ext::Ah => body.extend([next, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1]),
            Ext::Fragment(off, more, id) => {
                body.extend([next, 0]);
                body.extend(((off << 3) | u16::from(*more)).to_be_bytes());
                body.extend(id.to_be_bytes());
            }
        }
    }
    body.extend(l4.bytes());
    let first = exts.first().map(Ext::code).unwrap_or(l4.proto());
    let mut h = vec![0x60, 0, 0, 0];
    h.extend((body.len() as u16).to_be_bytes());
    h.extend([first, 64]);
    h.extend(src.octets());
    h.extend(dst.octets());
    h.extend(body);
    eth(0x86dd, &h)
}

/// An IPv6 packet.
pub fn v6(src: &str, dst: &str, l4: L4) -> Vec<u8> {
    v6_ext(src, dst, &[], l4)
}

/// An ARP request frame.
pub fn arp() -> Vec<u8> {
    eth(
        0x0806,
        &[
            0, 1, 8, 0, 6, 4, 0, 1, 2, 0, 0, 0, 0, 1, 10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 10, 0, 0, 2,
        ],
    )
}

// ---------------------------------------------------------------- compiled

/// The policy subject of endpoint `ep` of `c` (its pod identity: the
/// `subject` of the entries that govern it).
pub fn subject_of(c: &Compiled, ep: u32) -> u32 {
    c.endpoints
        .get(&ep)
        .unwrap_or_else(|| panic!("endpoint {ep} is not in the compiled state"))
        .identity
}

/// A policy entry of the subject of endpoint `ep` (its pod identity: the
/// entry governs every endpoint of that identity). The endpoint must be in
/// `c` already.
pub fn allow(
    c: &mut Compiled,
    ep: u32,
    dir: Direction,
    peer: u32,
    proto: Option<Protocol>,
    ports: (u16, u16),
    rule: u32,
) {
    let subject = subject_of(c, ep);
    c.policy.insert(
        PolicyEntry {
            subject,
            direction: dir,
            peer,
            protocol: proto,
            ports,
        },
        rule,
    );
}

/// The tier tests' pod identity of 10.0.0.2 (which also has the CIDR
/// identity [`TIER_BLOCK`]).
pub const TIER_POD_B: u32 = 300;
/// The tier tests' pod identity of 10.0.0.3 (no CIDR identity).
pub const TIER_POD_C: u32 = 301;
/// The tier tests' CIDR identity of 10.0.0.2 (`10.0.0.2/32`).
pub const TIER_BLOCK: u32 = npm_common::IDENTITY_FIRST_CIDR + 1;

/// The tier tests' base state: endpoint 1 (10.0.0.1, identity 256,
/// isolated for ingress, and for egress when `egress_isolated`) and
/// endpoint 2 (10.0.0.5, 257, isolated by no NetworkPolicy); peers
/// 10.0.0.2 ([`TIER_POD_B`], CIDR [`TIER_BLOCK`]) and 10.0.0.3
/// ([`TIER_POD_C`]). No policy or tier entry.
pub fn tier_fixture(egress_isolated: bool) -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), None, true, egress_isolated));
    c.endpoints
        .insert(2, endpoint("b", 257, Some("10.0.0.5"), None, false, false));
    ip(&mut c, "10.0.0.1", 256, 0);
    ip(&mut c, "10.0.0.5", 257, 0);
    ip(&mut c, "10.0.0.2", TIER_POD_B, TIER_BLOCK);
    ip(&mut c, "10.0.0.3", TIER_POD_C, 0);
    c.cidrs.insert("10.0.0.2/32".parse().unwrap(), TIER_BLOCK);
    c
}

/// Adds the tier entry (endpoint `ep`, `direction`, `tier`, `peer`,
/// `protocol`, `ports`) -> (`action`, `rank`, `rule`) and sets the
/// endpoint's presence flag for that tier and direction.
// The table tests call it with one positional row per entry.
#[allow(clippy::too_many_arguments)]
pub fn tier_entry(
    c: &mut Compiled,
    ep: u32,
    direction: Direction,
    tier: Tier,
    peer: u32,
    protocol: Option<Protocol>,
    ports: (u16, u16),
    action: TierAction,
    rank: u32,
    rule: u32,
) {
    // Keyed by the endpoint's subject (its pod identity).
    let subject = c.endpoints[&ep].identity;
    c.tiers.insert(
        TierEntry {
            subject,
            direction,
            tier,
            peer,
            protocol,
            ports,
        },
        TierValue { action, rank, rule },
    );
    c.endpoints.get_mut(&ep).unwrap().tiers.set(tier, direction);
}

/// [`tier_entry`] for ingress, with rule id `100 + rank`.
// The table tests call it with one positional row per entry.
#[allow(clippy::too_many_arguments)]
pub fn tier_in(
    c: &mut Compiled,
    ep: u32,
    tier: Tier,
    peer: u32,
    protocol: Option<Protocol>,
    ports: (u16, u16),
    action: TierAction,
    rank: u32,
) {
    tier_entry(
        c,
        ep,
        Direction::Ingress,
        tier,
        peer,
        protocol,
        ports,
        action,
        rank,
        100 + rank,
    );
}

/// The entry forms every tier test of both tiers starts from, for endpoint
/// `ep`: a range over edge ports and 64-port blocks, an exact port, a whole
/// protocol, a CIDR peer's block, an any-protocol Pass, an any-peer exact
/// port, and a Baseline range.
pub fn tier_entry_forms(c: &mut Compiled, ep: u32) {
    use TierAction::*;
    let (tcp, udp) = (Some(Protocol::Tcp), Some(Protocol::Udp));
    tier_in(c, ep, Tier::Admin, TIER_POD_B, tcp, (60, 200), Deny, 5);
    tier_in(c, ep, Tier::Admin, TIER_POD_B, tcp, (443, 443), Accept, 2);
    tier_in(c, ep, Tier::Admin, TIER_POD_B, udp, (0, u16::MAX), Deny, 7);
    tier_in(c, ep, Tier::Admin, TIER_BLOCK, tcp, (64, 127), Accept, 3);
    tier_in(c, ep, Tier::Admin, TIER_POD_C, None, (0, 0), Pass, 9);
    tier_in(c, ep, Tier::Admin, npm_common::IDENTITY_ANY, tcp, (9000, 9000), Deny, 1);
    tier_in(c, ep, Tier::Baseline, TIER_POD_C, tcp, (8000, 8100), Deny, 4);
}

/// One probe of [`TierDp::probe_grid`]: (endpoint, source, UDP, port,
/// (verdict, reason)).
pub type TierProbe = (u32, &'static str, bool, u16, (i32, Option<npm_common::Reason>));

/// The tier tests' dataplane: endpoints 1 (10.0.0.1) and 2 (10.0.0.5) of
/// [`tier_fixture`] on veths of their own, probed on ingress.
pub struct TierDp {
    /// The dataplane.
    pub dp: EbpfDataplane,
    /// Endpoint 1's interface.
    pub a: Dummy,
    /// Endpoint 2's interface.
    pub b: Dummy,
    /// Its pins.
    pub pins: PinDir,
}

impl TierDp {
    /// A dataplane with `switches`, fully synced to `c`.
    pub fn new(tag: &str, c: &Compiled, switches: npm_dataplane::ebpf::BenchSwitches) -> TierDp {
        let pins = PinDir::new(tag);
        let a = Dummy::new(&format!("{tag}a"));
        let b = Dummy::new(&format!("{tag}b"));
        let mut dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
        npm_dataplane::Dataplane::sync_full(&mut dp, c, &ifaces(&[(1, a.ifindex), (2, b.ifindex)])).unwrap();
        TierDp { dp, a, b, pins }
    }

    /// The endpoints' interfaces.
    pub fn ifs(&self) -> BTreeMap<u32, u32> {
        ifaces(&[(1, self.a.ifindex), (2, self.b.ifindex)])
    }

    /// Applies the diff from `prev` to `next`.
    pub fn apply(&mut self, prev: &Compiled, next: &Compiled) {
        let ifs = self.ifs();
        npm_dataplane::Dataplane::apply(&mut self.dp, &prev.diff(next), next, &ifs).unwrap();
    }

    /// (verdict, reason) of a new flow from `src` (source port `sport`) to
    /// endpoint `ep`'s `port`, TCP SYN or UDP.
    pub fn probe(&self, ep: u32, src: &str, sport: u16, udp: bool, port: u16) -> (i32, Option<npm_common::Reason>) {
        let (ifindex, dst) = if ep == 1 {
            (self.a.ifindex, "10.0.0.1")
        } else {
            (self.b.ifindex, "10.0.0.5")
        };
        let l4 = if udp {
            L4::Udp(sport, port)
        } else {
            L4::Tcp(sport, port, 0x02)
        };
        self.dp
            .test_run(Direction::Ingress, ifindex, &v4(src, dst, l4))
            .unwrap()
    }

    /// Every (endpoint, source, TCP and UDP, port)'s probe, each a new flow
    /// from source port `sport`.
    pub fn probe_grid(&mut self, sources: &[&'static str], ports: &[u16], sport: u16) -> Vec<TierProbe> {
        let mut out = Vec::new();
        for ep in [1, 2] {
            for src in sources {
                for udp in [false, true] {
                    for port in ports {
                        out.push((ep, *src, udp, *port, self.probe(ep, src, sport, udp, *port)));
                    }
                }
            }
        }
        out
    }

    /// Endpoint `id`'s record flags.
    pub fn flags(&self, id: u32) -> u32 {
        record_flags(&self.dp, id)
    }
}

/// The flags of endpoint `id`'s record, as the dataplane dumps it.
pub fn record_flags(dp: &EbpfDataplane, id: u32) -> u32 {
    dp.dump()
        .unwrap()
        .endpoints
        .iter()
        .find(|e| e.id == id)
        .unwrap_or_else(|| panic!("endpoint {id} not in the dump"))
        .flags
}

/// Interfaces map of one endpoint.
pub fn ifaces(pairs: &[(u32, u32)]) -> BTreeMap<u32, u32> {
    pairs.iter().copied().collect()
}

// ---------------------------------------------------------------- topology

/// A pod network namespace joined to the root netns by a veth pair: the
/// host side (`host_if`, in the root netns) is where the classifier is
/// attached; the root netns plays the remote peer. Addresses are a /30 of
/// 198.18.0.0/16 derived from the pid and a per-process count, so parallel
/// runs and parallel tests do not collide.
pub struct PodNet {
    /// The pod's namespace.
    pub ns: Netns,
    /// Host-side interface name.
    pub host_if: String,
    /// Host-side ifindex.
    pub ifindex: u32,
    /// The root netns (peer) address.
    pub peer_ip: Ipv4Addr,
    /// The pod address.
    pub pod_ip: Ipv4Addr,
    servers: Vec<std::process::Child>,
}

impl PodNet {
    /// Creates the namespace, the veth pair and the addresses.
    pub fn new(tag: &str) -> PodNet {
        let pid = std::process::id();
        let ns = test_netns(tag);
        let host_if = format!("npt{pid}{tag}");
        let pod_if = format!("{host_if}x");
        assert!(pod_if.len() < 16);
        sh_quiet(&["ip", "link", "del", &host_if]);
        sh(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", &pod_if]);
        sh(&["ip", "link", "set", &pod_if, "netns", &ns.name]);
        // 16 pod networks per process (the tests of all modules run in
        // parallel in one binary and must not share addresses), 1024
        // processes, all in 198.18.0.0/16 (198.19.0.0/16 is `pmtu_net`'s).
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 16;
        let slot = ((pid % 1024) * 16 + n) * 4;
        let base = u32::from(Ipv4Addr::new(198, 18, 0, 0)) + slot;
        let peer_ip = Ipv4Addr::from(base + 1);
        let pod_ip = Ipv4Addr::from(base + 2);
        sh(&["ip", "addr", "add", &format!("{peer_ip}/30"), "dev", &host_if]);
        sh(&["ip", "link", "set", &host_if, "up"]);
        sh(&[
            "ip",
            "-n",
            &ns.name,
            "addr",
            "add",
            &format!("{pod_ip}/30"),
            "dev",
            &pod_if,
        ]);
        sh(&["ip", "-n", &ns.name, "link", "set", &pod_if, "up"]);
        let ifindex = ifindex_of(&host_if);
        PodNet {
            ns,
            host_if,
            ifindex,
            peer_ip,
            pod_ip,
            servers: Vec::new(),
        }
    }

    /// Starts echo servers in the pod: TCP on `tcp_port` (echoes lines),
    /// UDP on each of `udp_ports` (echoes datagrams).
    pub fn start_servers(&mut self, tcp_port: u16, udp_ports: &[u16]) {
        let ip = self.pod_ip.to_string();
        let tcp = format!(
            "import socket,threading\n\
             s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
             s.bind(('{ip}',{tcp_port})); s.listen(64)\n\
             def h(c):\n  f=c.makefile('rwb')\n  for l in f:\n    f.write(l); f.flush()\n\
             while True:\n  c,_=s.accept(); threading.Thread(target=h,args=(c,),daemon=True).start()\n"
        );
        let udp_ports: Vec<String> = udp_ports.iter().map(|p| p.to_string()).collect();
        let udp = format!(
            "import socket,select\n\
             ss=[]\n\
             for p in [{}]:\n  u=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('{ip}',p)); ss.append(u)\n\
             while True:\n  r,_,_=select.select(ss,[],[])\n  for u in r:\n    d,a=u.recvfrom(2048); u.sendto(d,a)\n",
            udp_ports.join(",")
        );
        for code in [tcp, udp] {
            let child = Command::new("ip")
                .args(["netns", "exec", &self.ns.name, "python3", "-c", &code])
                .spawn()
                .expect("spawn python3 server");
            self.servers.push(child);
        }
    }

    /// One TCP exchange with the pod (connect, send a line, read it back).
    pub fn tcp_exchange(&self, port: u16, timeout: std::time::Duration) -> std::io::Result<()> {
        use std::io::{BufRead, BufReader, Write};
        let addr = std::net::SocketAddr::from((self.pod_ip, port));
        let s = std::net::TcpStream::connect_timeout(&addr, timeout)?;
        s.set_read_timeout(Some(timeout))?;
        let mut w = s.try_clone()?;
        w.write_all(b"hello\n")?;
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line)?;
        if line != "hello\n" {
            return Err(std::io::Error::other(format!("echo returned {line:?}")));
        }
        Ok(())
    }

    /// One UDP request/reply with the pod, from a fresh socket (a new flow).
    pub fn udp_exchange(&self, port: u16, timeout: std::time::Duration) -> std::io::Result<()> {
        let u = std::net::UdpSocket::bind((self.peer_ip, 0))?;
        u.set_read_timeout(Some(timeout))?;
        u.send_to(b"ping", (self.pod_ip, port))?;
        let mut buf = [0u8; 64];
        let (n, _) = u.recv_from(&mut buf)?;
        if &buf[..n] != b"ping" {
            return Err(std::io::Error::other("bad udp echo"));
        }
        Ok(())
    }

    /// Waits until the servers answer (before any policy isolates the pod).
    pub fn wait_ready(&self, tcp_port: u16, udp_port: u16) {
        let short = std::time::Duration::from_millis(300);
        for _ in 0..50 {
            if self.tcp_exchange(tcp_port, short).is_ok() && self.udp_exchange(udp_port, short).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("pod servers did not come up");
    }
}

impl Drop for PodNet {
    fn drop(&mut self) {
        for c in &mut self.servers {
            let _ = c.kill();
            let _ = c.wait();
        }
        sh_quiet(&["ip", "link", "del", &self.host_if]);
    }
}

/// The compiled state of the veth tests: endpoint 1 is the pod (isolated
/// both ways), the root-netns peer has identity 300; `allow` lists the
/// (protocol, port) the peer may reach on the pod. No egress rule: replies
/// pass only as tracked connections.
pub fn pod_policy(net: &PodNet, allow_ports: &[(Protocol, u16)]) -> Compiled {
    policy_for(net.pod_ip, net.peer_ip, allow_ports)
}

/// [`pod_policy`] by addresses.
pub fn policy_for(pod_ip: Ipv4Addr, peer_ip: Ipv4Addr, allow_ports: &[(Protocol, u16)]) -> Compiled {
    let mut c = Compiled::default();
    let pod = pod_ip.to_string();
    c.endpoints
        .insert(1, endpoint("pod", 256, Some(&pod), None, true, true));
    ip(&mut c, &pod, 256, 0);
    ip(&mut c, &peer_ip.to_string(), 300, 0);
    for (i, (p, port)) in allow_ports.iter().enumerate() {
        allow(&mut c, 1, Direction::Ingress, 300, Some(*p), (*port, *port), i as u32);
    }
    c
}

//! Packet-table tests of the datapath through `BPF_PROG_TEST_RUN`: every row
//! is a crafted frame run through the real, verifier-loaded program against
//! maps programmed by the real loader, with the expected verdict and reason.
//! Needs root (loads eBPF, creates dummy interfaces and bpffs pins).

use crate::ebpf_common::*;
use npm_common::{Reason, CT_CLOSING, CT_SEEN_REPLY, IDENTITY_ANY, IDENTITY_FIRST_CIDR, IDENTITY_HOST};
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction, Direction::Egress as EG, Direction::Ingress as IN};
use npm_policy::model::Protocol::{Sctp, Tcp, Udp};

const POD_B: u32 = 300;
const POD_ANYPROTO: u32 = 301;
const POD_IN_BLOCK: u32 = 303;
const C_BLOCK: u32 = IDENTITY_FIRST_CIDR;
const C_EXCEPT: u32 = IDENTITY_FIRST_CIDR + 1;
const C_PODS: u32 = IDENTITY_FIRST_CIDR + 2;

/// Endpoint 1 (isolated both ways) and endpoint 2 (not isolated) with the
/// policy of the table.
fn compiled() -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), Some("fd00::1"), true, true));
    c.endpoints
        .insert(2, endpoint("c", 257, Some("10.0.0.9"), None, false, false));
    ip(&mut c, "10.0.0.1", 256, 0);
    ip(&mut c, "fd00::1", 256, 0);
    ip(&mut c, "10.0.0.2", POD_B, 0);
    ip(&mut c, "fd00::2", POD_B, 0);
    ip(&mut c, "10.0.0.3", POD_ANYPROTO, 0);
    ip(&mut c, "fd00::3", POD_ANYPROTO, 0);
    ip(&mut c, "10.1.5.5", POD_IN_BLOCK, C_PODS);
    ip(&mut c, "192.168.1.1", IDENTITY_HOST, 0);
    c.cidrs.insert("172.16.0.0/16".parse().unwrap(), C_BLOCK);
    c.cidrs.insert("172.16.5.0/24".parse().unwrap(), C_EXCEPT);
    c.cidrs.insert("10.1.0.0/16".parse().unwrap(), C_PODS);
    c.cidrs.insert("2001:db8::/32".parse().unwrap(), C_BLOCK);
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (80, 80), 1);
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (1000, 2000), 2);
    allow(&mut c, 1, IN, POD_B, Some(Udp), (53, 53), 3);
    allow(&mut c, 1, IN, POD_B, Some(Sctp), (9000, 9000), 4);
    allow(&mut c, 1, IN, POD_ANYPROTO, None, (0, 65535), 5);
    allow(&mut c, 1, IN, C_BLOCK, Some(Tcp), (443, 443), 6);
    allow(&mut c, 1, IN, C_PODS, Some(Tcp), (8080, 8080), 7);
    allow(&mut c, 1, EG, POD_B, Some(Tcp), (5432, 5432), 8);
    allow(&mut c, 1, EG, IDENTITY_ANY, Some(Udp), (53, 53), 9);
    allow(&mut c, 1, EG, POD_ANYPROTO, None, (0, 65535), 10);
    c
}

struct Fixture {
    dp: EbpfDataplane,
    ep1: Dummy,
    ep2: Dummy,
    none: Dummy,
    _pins: PinDir,
}

fn fixture(tag: &str) -> Fixture {
    fixture_with(tag, BenchSwitches::default())
}

/// A fixture whose datapath never takes its IPv4 fast path: the tables run
/// on both paths and must give every row the same verdict.
fn general_fixture(tag: &str) -> Fixture {
    fixture_with(
        tag,
        BenchSwitches {
            no_fast_v4: true,
            ..BenchSwitches::default()
        },
    )
}

fn fixture_with(tag: &str, switches: BenchSwitches) -> Fixture {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let ep1 = Dummy::new(&format!("{tag}a"));
    let ep2 = Dummy::new(&format!("{tag}b"));
    let none = Dummy::new(&format!("{tag}n"));
    let mut dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
    let c = compiled();
    dp.sync_full(&c, &ifaces(&[(1, ep1.ifindex), (2, ep2.ifindex)]))
        .unwrap();
    Fixture {
        dp,
        ep1,
        ep2,
        none,
        _pins: pins,
    }
}

fn allow_r(r: Reason) -> Expect {
    (VERDICT_ALLOW, Some(r))
}

fn deny_r(r: Reason) -> Expect {
    (VERDICT_DROP, Some(r))
}

/// Expected (verdict, reason) of a row.
type Expect = (i32, Option<Reason>);
/// A table row: name, direction, interface, frame, expectation.
type Row<'a> = (&'a str, Direction, u32, Vec<u8>, Expect);

fn check(f: &Fixture, rows: &[Row<'_>]) {
    let mut failures = Vec::new();
    for (name, dir, ifindex, pkt, want) in rows {
        let got =
            f.dp.test_run(*dir, *ifindex, pkt)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        if got != *want {
            failures.push(format!("{name}: got {got:?}, want {want:?}"));
        }
    }
    assert!(failures.is_empty(), "failing rows:\n{}", failures.join("\n"));
}

#[test]
fn ipv4_table() {
    ipv4_table_on(fixture("p4"));
}

#[test]
fn ipv4_table_general_path() {
    ipv4_table_on(general_fixture("p4g"));
}

fn ipv4_table_on(f: Fixture) {
    let a = f.ep1.ifindex;
    let c = f.ep2.ifindex;
    let mut frag_first = v4("10.0.0.2", "10.0.0.1", L4::Udp(40300, 53));
    frag_first[20..22].copy_from_slice(&0x2000u16.to_be_bytes()); // MF, offset 0
    frag_first[18..20].copy_from_slice(&500u16.to_be_bytes());
    let mut frag_later = frag_first.clone();
    frag_later[20..22].copy_from_slice(&3u16.to_be_bytes()); // offset 24 bytes, last
    let mut frag_orphan = frag_later.clone();
    frag_orphan[18..20].copy_from_slice(&501u16.to_be_bytes());
    let mut denied_first = v4("10.0.0.2", "10.0.0.1", L4::Udp(40301, 54));
    denied_first[20..22].copy_from_slice(&0x2000u16.to_be_bytes());
    denied_first[18..20].copy_from_slice(&502u16.to_be_bytes());
    let mut denied_later = denied_first.clone();
    denied_later[20..22].copy_from_slice(&3u16.to_be_bytes());
    let opts = ipv4_raw(
        "10.0.0.2".parse().unwrap(),
        "10.0.0.1".parse().unwrap(),
        6,
        9,
        0,
        &[1, 1, 1, 0],
        &L4::Tcp(40400, 80, 0x02).bytes(),
    );
    let short_tcp = ipv4_raw(
        "10.0.0.2".parse().unwrap(),
        "10.0.0.1".parse().unwrap(),
        6,
        9,
        0,
        &[],
        &L4::Tcp(40401, 80, 0x02).bytes()[..10],
    );
    let mut bad_ihl = v4("10.0.0.2", "10.0.0.1", L4::Tcp(40402, 80, 0x02));
    bad_ihl[14] = 0x44;
    let mut bad_doff = v4("10.0.0.2", "10.0.0.1", L4::Tcp(40404, 80, 0x02));
    bad_doff[14 + 20 + 12] = 4 << 4; // a TCP data offset of 4 words
    let mut cut = v4("10.0.0.2", "10.0.0.1", L4::Tcp(40403, 80, 0x02));
    cut.truncate(14 + 20 + 8);
    // Packet fuzzer findings (docs/packet-spec.md, "readable"): an IP
    // length that ends inside the TCP header, the rest of the header in
    // the frame's padding (the fast path read it from there).
    let mut l4_in_padding = v4("10.0.0.2", "10.0.0.1", L4::Tcp(40405, 80, 0x02));
    l4_in_padding[16..18].copy_from_slice(&30u16.to_be_bytes());
    l4_in_padding.resize(60, 0);
    // A tiny first fragment: 8 bytes of TCP in the datagram (ports, no
    // flags), then its later fragment (passed on the tiny one's record).
    let mut tiny_first = ipv4_raw(
        "10.0.0.2".parse().unwrap(),
        "10.0.0.1".parse().unwrap(),
        6,
        503,
        0x2000,
        &[],
        &L4::Tcp(40406, 80, 0x02).bytes(),
    );
    tiny_first[16..18].copy_from_slice(&28u16.to_be_bytes());
    tiny_first.resize(60, 0);
    let tiny_later = ipv4_raw(
        "10.0.0.2".parse().unwrap(),
        "10.0.0.1".parse().unwrap(),
        6,
        503,
        1,
        &[],
        &[0x63; 16],
    );
    // An IPv4 header under the IPv6 ethertype (parsed by its version).
    let mut v4_as_v6 = v4("10.0.0.2", "10.0.0.1", L4::Tcp(40407, 80, 0x02));
    v4_as_v6[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
    let rows = vec![
        (
            "tcp allowed",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Tcp(40001, 80, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "tcp reply tracked",
            EG,
            a,
            v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 40001, 0x12)),
            allow_r(Reason::Tracked),
        ),
        (
            "tcp next packet tracked",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Tcp(40001, 80, 0x10)),
            allow_r(Reason::Tracked),
        ),
        (
            "tcp wrong port",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Tcp(40002, 81, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "tcp unknown peer",
            IN,
            a,
            v4("10.9.9.9", "10.0.0.1", L4::Tcp(40003, 80, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "endPort lo-1",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Tcp(40010, 999, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "endPort lo",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Tcp(40011, 1000, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "endPort hi",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Tcp(40012, 2000, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "endPort hi+1",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Tcp(40013, 2001, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "udp allowed",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Udp(40020, 53)),
            allow_r(Reason::Policy),
        ),
        (
            "udp reply",
            EG,
            a,
            v4("10.0.0.1", "10.0.0.2", L4::Udp(53, 40020)),
            allow_r(Reason::Tracked),
        ),
        (
            "udp denied",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Udp(40021, 54)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "udp port of tcp rule",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Udp(40022, 80)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "sctp allowed",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Sctp(40030, 9000)),
            allow_r(Reason::Policy),
        ),
        (
            "sctp reply",
            EG,
            a,
            v4("10.0.0.1", "10.0.0.2", L4::Sctp(9000, 40030)),
            allow_r(Reason::Tracked),
        ),
        (
            "sctp denied",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Sctp(40031, 9001)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "icmp from port-only peer",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Icmp(8, 7)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "icmp from any-proto peer",
            IN,
            a,
            v4("10.0.0.3", "10.0.0.1", L4::Icmp(8, 7)),
            allow_r(Reason::Policy),
        ),
        (
            "icmp echo reply",
            EG,
            a,
            v4("10.0.0.1", "10.0.0.3", L4::Icmp(0, 7)),
            allow_r(Reason::Tracked),
        ),
        (
            "icmp other echo id",
            EG,
            a,
            v4("10.0.0.1", "10.0.0.2", L4::Icmp(0, 8)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "ipBlock allowed",
            IN,
            a,
            v4("172.16.1.1", "10.0.0.1", L4::Tcp(40040, 443, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "ipBlock except",
            IN,
            a,
            v4("172.16.5.1", "10.0.0.1", L4::Tcp(40041, 443, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "ipBlock outside",
            IN,
            a,
            v4("8.8.8.8", "10.0.0.1", L4::Tcp(40042, 443, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "pod ip inside ipBlock",
            IN,
            a,
            v4("10.1.5.5", "10.0.0.1", L4::Tcp(40043, 8080, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "pod ip inside ipBlock other port",
            IN,
            a,
            v4("10.1.5.5", "10.0.0.1", L4::Tcp(40044, 8081, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "host ingress",
            IN,
            a,
            v4("192.168.1.1", "10.0.0.1", L4::Tcp(40050, 9999, 0x02)),
            allow_r(Reason::Host),
        ),
        (
            "host egress is policy",
            EG,
            a,
            v4("10.0.0.1", "192.168.1.1", L4::Tcp(40051, 9999, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "egress allowed",
            EG,
            a,
            v4("10.0.0.1", "10.0.0.2", L4::Tcp(40060, 5432, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "egress reply",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Tcp(5432, 40060, 0x12)),
            allow_r(Reason::Tracked),
        ),
        (
            "egress denied",
            EG,
            a,
            v4("10.0.0.1", "10.0.0.2", L4::Tcp(40061, 5433, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "egress any peer",
            EG,
            a,
            v4("10.0.0.1", "8.8.8.8", L4::Udp(40062, 53)),
            allow_r(Reason::Policy),
        ),
        (
            "egress icmp any-proto peer",
            EG,
            a,
            v4("10.0.0.1", "10.0.0.3", L4::Icmp(8, 99)),
            allow_r(Reason::Policy),
        ),
        (
            "egress spoofed",
            EG,
            a,
            v4("10.0.0.77", "10.0.0.2", L4::Tcp(40063, 5432, 0x02)),
            deny_r(Reason::Spoofed),
        ),
        (
            "not isolated ingress",
            IN,
            c,
            v4("8.8.8.8", "10.0.0.9", L4::Tcp(40070, 22, 0x02)),
            allow_r(Reason::NotIsolated),
        ),
        (
            "not isolated egress",
            EG,
            c,
            v4("10.0.0.9", "8.8.8.8", L4::Udp(40071, 123)),
            allow_r(Reason::NotIsolated),
        ),
        (
            "not isolated spoofed",
            EG,
            c,
            v4("10.0.0.10", "8.8.8.8", L4::Udp(40072, 123)),
            deny_r(Reason::Spoofed),
        ),
        ("non-ip", IN, a, arp(), allow_r(Reason::NonIp)),
        (
            "no endpoint",
            IN,
            f.none.ifindex,
            v4("10.0.0.2", "10.0.0.1", L4::Tcp(40080, 81, 0x02)),
            allow_r(Reason::NoEndpoint),
        ),
        ("ip options", IN, a, opts, allow_r(Reason::Policy)),
        ("short tcp header", IN, a, short_tcp, deny_r(Reason::Malformed)),
        ("ihl below 5", IN, a, bad_ihl, deny_r(Reason::Malformed)),
        ("tcp data offset below 5", IN, a, bad_doff, deny_r(Reason::Malformed)),
        ("truncated below total length", IN, a, cut, deny_r(Reason::Malformed)),
        // (the kernel refuses test runs of IP frames shorter than an IP
        // header, so truncation is tested against the length fields)
        (
            "version 5 in ipv4 frame",
            IN,
            a,
            {
                let mut p = v4("10.0.0.2", "10.0.0.1", L4::Udp(40404, 53));
                p[14] = 0x55;
                p
            },
            deny_r(Reason::Malformed),
        ),
        ("first fragment", IN, a, frag_first, allow_r(Reason::Policy)),
        ("later fragment", IN, a, frag_later, allow_r(Reason::Policy)),
        ("orphan fragment", IN, a, frag_orphan, deny_r(Reason::Fragment)),
        (
            "denied first fragment",
            IN,
            a,
            denied_first,
            deny_r(Reason::PolicyDenied),
        ),
        (
            "later of denied fragment",
            IN,
            a,
            denied_later,
            deny_r(Reason::Fragment),
        ),
        (
            "tcp header past the ip length, in the padding",
            IN,
            a,
            l4_in_padding,
            deny_r(Reason::Malformed),
        ),
        ("tiny first fragment", IN, a, tiny_first, deny_r(Reason::Malformed)),
        (
            "later of tiny first fragment",
            IN,
            a,
            tiny_later,
            deny_r(Reason::Fragment),
        ),
        (
            "ipv4 header under the ipv6 ethertype",
            IN,
            a,
            v4_as_v6,
            deny_r(Reason::Malformed),
        ),
    ];
    check(&f, &rows);
}

#[test]
fn ipv6_table() {
    let f = fixture("p6");
    let a = f.ep1.ifindex;
    let dopts = |n: usize| vec![Ext::DestOpts; n];
    let rows = vec![
        (
            "tcp allowed",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Tcp(41001, 80, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "tcp reply",
            EG,
            a,
            v6("fd00::1", "fd00::2", L4::Tcp(80, 41001, 0x12)),
            allow_r(Reason::Tracked),
        ),
        (
            "tcp denied",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Tcp(41002, 81, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "udp allowed",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Udp(41003, 53)),
            allow_r(Reason::Policy),
        ),
        (
            "udp reply",
            EG,
            a,
            v6("fd00::1", "fd00::2", L4::Udp(53, 41003)),
            allow_r(Reason::Tracked),
        ),
        (
            "sctp allowed",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Sctp(41004, 9000)),
            allow_r(Reason::Policy),
        ),
        (
            "sctp denied",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Sctp(41005, 9002)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "endPort hi",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Tcp(41006, 2000, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "endPort hi+1",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Tcp(41007, 2001, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "icmpv6 echo port-only peer",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Icmp6(128, 5)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "icmpv6 echo any-proto peer",
            IN,
            a,
            v6("fd00::3", "fd00::1", L4::Icmp6(128, 5)),
            allow_r(Reason::Policy),
        ),
        (
            "icmpv6 echo reply",
            EG,
            a,
            v6("fd00::1", "fd00::3", L4::Icmp6(129, 5)),
            allow_r(Reason::Tracked),
        ),
        (
            "neighbour solicitation in",
            IN,
            a,
            v6("fe80::1", "ff02::1:ff00:1", L4::Icmp6(135, 0)),
            allow_r(Reason::Icmpv6Control),
        ),
        (
            "router solicitation out (link-local src)",
            EG,
            a,
            v6("fe80::99", "ff02::2", L4::Icmp6(133, 0)),
            allow_r(Reason::Icmpv6Control),
        ),
        (
            "mld report out",
            EG,
            a,
            v6("fe80::99", "ff02::16", L4::Icmp6(143, 0)),
            allow_r(Reason::Icmpv6Control),
        ),
        (
            "egress allowed",
            EG,
            a,
            v6("fd00::1", "fd00::2", L4::Tcp(41010, 5432, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "egress spoofed",
            EG,
            a,
            v6("fd00::99", "fd00::2", L4::Tcp(41011, 5432, 0x02)),
            deny_r(Reason::Spoofed),
        ),
        (
            "egress v4-only endpoint v6 src",
            EG,
            f.ep2.ifindex,
            v6("fd00::9", "fd00::2", L4::Udp(41012, 53)),
            deny_r(Reason::Spoofed),
        ),
        (
            "ipBlock v6",
            IN,
            a,
            v6("2001:db8::7", "fd00::1", L4::Tcp(41013, 443, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "outside ipBlock v6",
            IN,
            a,
            v6("2001:db9::7", "fd00::1", L4::Tcp(41014, 443, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "hbh+routing+dstopts",
            IN,
            a,
            v6_ext(
                "fd00::2",
                "fd00::1",
                &[Ext::HopByHop, Ext::Routing, Ext::DestOpts],
                L4::Tcp(41020, 80, 0x02),
            ),
            allow_r(Reason::Policy),
        ),
        (
            "ah, port denied",
            IN,
            a,
            v6_ext("fd00::2", "fd00::1", &[Ext::Ah], L4::Tcp(41021, 82, 0x02)),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "ah, allowed",
            IN,
            a,
            v6_ext("fd00::2", "fd00::1", &[Ext::Ah], L4::Udp(41022, 53)),
            allow_r(Reason::Policy),
        ),
        (
            "8 ext headers",
            IN,
            a,
            v6_ext("fd00::2", "fd00::1", &dopts(8), L4::Tcp(41023, 80, 0x02)),
            allow_r(Reason::Policy),
        ),
        (
            "9 ext headers",
            IN,
            a,
            v6_ext("fd00::2", "fd00::1", &dopts(9), L4::Tcp(41024, 80, 0x02)),
            deny_r(Reason::Malformed),
        ),
        (
            "truncated ext header",
            IN,
            a,
            {
                let mut p = v6_ext("fd00::2", "fd00::1", &[Ext::DestOpts], L4::Raw(59, vec![]));
                p[14 + 6] = 60; // claims another dest-opts header after it
                p[14 + 40] = 60;
                p
            },
            deny_r(Reason::Malformed),
        ),
        (
            "truncated ipv6 payload",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Tcp(41025, 80, 0x02))[..64].to_vec(),
            deny_r(Reason::Malformed),
        ),
        (
            "short udp",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Raw(17, vec![0, 1, 0])),
            deny_r(Reason::Malformed),
        ),
        (
            "first fragment",
            IN,
            a,
            v6_ext(
                "fd00::2",
                "fd00::1",
                &[Ext::Fragment(0, true, 77)],
                L4::Tcp(41030, 80, 0x02),
            ),
            allow_r(Reason::Policy),
        ),
        (
            "later fragment",
            IN,
            a,
            v6_ext("fd00::2", "fd00::1", &[Ext::Fragment(100, false, 77)], L4::Tcp(1, 2, 3)),
            allow_r(Reason::Policy),
        ),
        (
            "orphan fragment",
            IN,
            a,
            v6_ext("fd00::2", "fd00::1", &[Ext::Fragment(100, false, 78)], L4::Tcp(1, 2, 3)),
            deny_r(Reason::Fragment),
        ),
        (
            "denied first fragment",
            IN,
            a,
            v6_ext(
                "fd00::2",
                "fd00::1",
                &[Ext::Fragment(0, true, 79)],
                L4::Tcp(41031, 81, 0x02),
            ),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "later of denied",
            IN,
            a,
            v6_ext("fd00::2", "fd00::1", &[Ext::Fragment(100, false, 79)], L4::Tcp(1, 2, 3)),
            deny_r(Reason::Fragment),
        ),
        // Packet fuzzer findings (docs/packet-spec.md, "readable").
        (
            "tcp header past the payload length, in the padding",
            IN,
            a,
            {
                let mut p = v6("fd00::2", "fd00::1", L4::Tcp(41040, 80, 0x02));
                p[18..20].copy_from_slice(&10u16.to_be_bytes());
                p
            },
            deny_r(Reason::Malformed),
        ),
        (
            "ext header past the payload, no next header (any-protocol peer)",
            IN,
            a,
            {
                let mut p = v6_ext("fd00::3", "fd00::1", &[Ext::DestOpts], L4::Raw(59, vec![]));
                p[14 + 40 + 1] = 200;
                p
            },
            deny_r(Reason::Malformed),
        ),
        (
            "ipv6 header under the ipv4 ethertype",
            IN,
            a,
            {
                let mut p = v6("fd00::2", "fd00::1", L4::Tcp(41041, 80, 0x02));
                p[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
                p
            },
            deny_r(Reason::Malformed),
        ),
    ];
    check(&f, &rows);
}

#[test]
fn conntrack_flags_counters_and_events() {
    conntrack_flags_counters_and_events_on(fixture("ct"));
}

#[test]
fn conntrack_flags_counters_and_events_general_path() {
    conntrack_flags_counters_and_events_on(general_fixture("ctg"));
}

fn conntrack_flags_counters_and_events_on(mut f: Fixture) {
    let a = f.ep1.ifindex;
    let base = f.dp.counters().unwrap();
    assert_eq!(f.dp.ct_len(), 0);
    let syn = v4("10.0.0.2", "10.0.0.1", L4::Tcp(42001, 80, 0x02));
    assert_eq!(f.dp.test_run(IN, a, &syn).unwrap(), allow_r(Reason::Policy));
    let ct = f.dp.ct_entries();
    assert_eq!(ct.len(), 1);
    assert_eq!(ct[0].0.endpoint, 1);
    assert_eq!(ct[0].1.flags & (CT_SEEN_REPLY | CT_CLOSING), 0);
    let synack = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 42001, 0x12));
    assert_eq!(f.dp.test_run(EG, a, &synack).unwrap(), allow_r(Reason::Tracked));
    let ct = f.dp.ct_entries();
    assert_eq!(ct.len(), 1, "the reply must hit the same canonical entry");
    assert_ne!(ct[0].1.flags & CT_SEEN_REPLY, 0);
    let fin = v4("10.0.0.2", "10.0.0.1", L4::Tcp(42001, 80, 0x11));
    assert_eq!(f.dp.test_run(IN, a, &fin).unwrap(), allow_r(Reason::Tracked));
    assert_ne!(f.dp.ct_entries()[0].1.flags & CT_CLOSING, 0);

    // A denied packet: counted and reported.
    let _ = f.dp.poll_deny_events();
    let bad = v4("10.0.0.2", "10.0.0.1", L4::Udp(42002, 5555));
    assert_eq!(f.dp.test_run(IN, a, &bad).unwrap(), deny_r(Reason::PolicyDenied));
    let events = f.dp.poll_deny_events();
    assert_eq!(events.len(), 1, "{events:?}");
    let ev = events[0];
    assert_eq!(ev.reason, Reason::PolicyDenied as u8);
    assert_eq!(ev.endpoint, 1);
    assert_eq!(ev.ifindex, a);
    assert_eq!(ev.direction, npm_common::DIR_INGRESS);
    assert_eq!((ev.protocol, ev.family, ev.sport, ev.dport), (17, 4, 42002, 5555));
    assert_eq!(ev.src, npm_common::IpKey::v4([10, 0, 0, 2]).addr);
    assert_eq!(ev.dst, npm_common::IpKey::v4([10, 0, 0, 1]).addr);

    let after = f.dp.counters().unwrap();
    let get = |c: &npm_dataplane::Counters, d: u8, r: Reason| c.by_reason.get(&(d, r as u8)).copied().unwrap_or((0, 0));
    let d_in = npm_common::DIR_INGRESS;
    let d_eg = npm_common::DIR_EGRESS;
    assert_eq!(
        get(&after, d_in, Reason::Policy).0 - get(&base, d_in, Reason::Policy).0,
        1
    );
    assert_eq!(
        get(&after, d_in, Reason::Policy).1 - get(&base, d_in, Reason::Policy).1,
        syn.len() as u64
    );
    assert_eq!(
        get(&after, d_eg, Reason::Tracked).0 - get(&base, d_eg, Reason::Tracked).0,
        1
    );
    assert_eq!(
        get(&after, d_in, Reason::Tracked).0 - get(&base, d_in, Reason::Tracked).0,
        1
    );
    assert_eq!(
        get(&after, d_in, Reason::PolicyDenied).0 - get(&base, d_in, Reason::PolicyDenied).0,
        1
    );
    let dump = f.dp.dump().unwrap();
    assert!(dump
        .counters
        .iter()
        .any(|c| c.reason == "policy-denied" && c.direction == "ingress" && c.packets >= 1));
}

#[test]
fn apply_diff_and_sync_sweep() {
    let mut f = fixture("ap");
    let a = f.ep1.ifindex;
    let ifs = ifaces(&[(1, a), (2, f.ep2.ifindex)]);
    let c0 = compiled();
    let dump = f.dp.dump().unwrap();
    assert_eq!(dump.endpoints.len(), 2);
    assert_eq!(dump.ipcache.len(), c0.ipcache.len());
    assert_eq!(dump.cidrs.len(), c0.cidrs.len());
    // endPort 1000..=2000 splits into several keys.
    assert!(dump.policy.len() > c0.policy.len());
    assert!(dump.endpoints.iter().all(|e| e.attached == vec!["ingress", "egress"]));

    // A flow to open a conntrack entry, then remove the TCP 80 rule: the
    // established flow keeps flowing, a new one is denied.
    let syn = v4("10.0.0.2", "10.0.0.1", L4::Tcp(43001, 80, 0x02));
    assert_eq!(f.dp.test_run(IN, a, &syn).unwrap(), allow_r(Reason::Policy));
    let mut c1 = c0.clone();
    c1.policy.retain(|e, _| e.ports != (80, 80));
    // Overlapping ranges share blocks: 1000..=1023 is a block of both.
    allow(&mut c1, 1, IN, POD_B, Some(Tcp), (1000, 1023), 11);
    f.dp.apply(&c0.diff(&c1), &c1, &ifs).unwrap();
    let ack = v4("10.0.0.2", "10.0.0.1", L4::Tcp(43001, 80, 0x10));
    assert_eq!(f.dp.test_run(IN, a, &ack).unwrap(), allow_r(Reason::Tracked));
    // A SYN opens a new connection: policy decides it, not the entry of the
    // same 5-tuple.
    assert_eq!(f.dp.test_run(IN, a, &syn).unwrap(), deny_r(Reason::PolicyDenied));
    assert_eq!(f.dp.test_run(IN, a, &ack).unwrap(), allow_r(Reason::Tracked));
    let syn2 = v4("10.0.0.2", "10.0.0.1", L4::Tcp(43002, 80, 0x02));
    assert_eq!(f.dp.test_run(IN, a, &syn2).unwrap(), deny_r(Reason::PolicyDenied));
    // Removing the narrower range must keep the shared block of the wider one.
    let mut c2 = c1.clone();
    c2.policy.retain(|_, r| *r != 11);
    f.dp.apply(&c1.diff(&c2), &c2, &ifs).unwrap();
    let p1000 = v4("10.0.0.2", "10.0.0.1", L4::Tcp(43003, 1000, 0x02));
    assert_eq!(f.dp.test_run(IN, a, &p1000).unwrap(), allow_r(Reason::Policy));

    // Isolation off: not isolated.
    let mut c3 = c2.clone();
    c3.endpoints.get_mut(&1).unwrap().isolated_ingress = false;
    f.dp.apply(&c2.diff(&c3), &c3, &ifs).unwrap();
    let p = v4("10.0.0.2", "10.0.0.1", L4::Tcp(43004, 81, 0x02));
    assert_eq!(f.dp.test_run(IN, a, &p).unwrap(), allow_r(Reason::NotIsolated));

    // Remove endpoint 1: no endpoint entry, links detached, flows purged.
    let mut c4 = c3.clone();
    let a_subject = subject_of(&c4, 1);
    c4.endpoints.remove(&1);
    c4.policy.retain(|e, _| e.subject != a_subject);
    let ifs4 = ifaces(&[(2, f.ep2.ifindex)]);
    assert!(f.dp.ct_entries().iter().any(|(k, _)| k.endpoint == 1));
    f.dp.apply(&c3.diff(&c4), &c4, &ifs4).unwrap();
    assert!(f.dp.ct_entries().iter().all(|(k, _)| k.endpoint != 1));
    assert!(!f.dp.attached().contains(&a));
    assert_eq!(f.dp.test_run(IN, a, &p).unwrap(), allow_r(Reason::NoEndpoint));
    let dump = f.dp.dump().unwrap();
    assert_eq!(dump.endpoints.len(), 1);
    assert!(dump.policy.iter().all(|k| k.subject != a_subject));

    // An endpoint without a known interface is held back, then programmed.
    let mut c5 = c4.clone();
    c5.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), None, true, true));
    f.dp.apply(&c4.diff(&c5), &c5, &ifs4).unwrap();
    assert_eq!(f.dp.dump().unwrap().endpoints.len(), 1);
    f.dp.apply(&c5.diff(&c5), &c5, &ifs).unwrap();
    assert_eq!(f.dp.dump().unwrap().endpoints.len(), 2);
    assert_eq!(f.dp.test_run(IN, a, &p).unwrap(), deny_r(Reason::PolicyDenied));

    // sync_full sweeps what the compiled state does not hold.
    let mut small = Compiled::default();
    small
        .endpoints
        .insert(2, endpoint("c", 257, Some("10.0.0.9"), None, true, false));
    ip(&mut small, "10.0.0.2", POD_B, 0);
    allow(&mut small, 2, IN, POD_B, Some(Udp), (53, 53), 1);
    f.dp.sync_full(&small, &ifaces(&[(2, f.ep2.ifindex)])).unwrap();
    let dump = f.dp.dump().unwrap();
    assert_eq!(dump.endpoints.len(), 1);
    assert_eq!(dump.endpoints[0].id, 2);
    assert_eq!(dump.ipcache.len(), 1);
    assert!(dump.cidrs.is_empty());
    assert_eq!(dump.policy.len(), 1);
    assert_eq!(dump.policy[0].ports, (53, 53));
    assert_eq!(dump.policy[0].protocol, Some(17));
    assert!(!f.dp.attached().contains(&a));
    let q = v4("10.0.0.2", "10.0.0.9", L4::Udp(43005, 53));
    assert_eq!(f.dp.test_run(IN, f.ep2.ifindex, &q).unwrap(), allow_r(Reason::Policy));
    let q = v4("10.0.0.2", "10.0.0.9", L4::Udp(43006, 54));
    assert_eq!(
        f.dp.test_run(IN, f.ep2.ifindex, &q).unwrap(),
        deny_r(Reason::PolicyDenied)
    );
}

#[test]
fn missing_object_is_a_clear_error() {
    let pins = PinDir::new("mo");
    let mut opts = pins.options();
    opts.object = Some("/nonexistent/npm-ebpf.o".into());
    let err = EbpfDataplane::open(opts).unwrap_err().to_string();
    assert!(err.contains("cargo xtask build-ebpf"), "{err}");
}

/// The `EP_NO_*_PEER_*` flags of endpoint 1 in the dump.
fn ep1_flags(f: &Fixture) -> u32 {
    let dump = f.dp.dump().unwrap();
    dump.endpoints.iter().find(|e| e.id == 1).expect("endpoint 1").flags
}

#[test]
fn peer_flags_follow_policy_only_diffs() {
    use npm_common::{EP_NO_ANY_PEER_EGRESS, EP_NO_ANY_PEER_INGRESS, EP_NO_CIDR_PEER_EGRESS, EP_NO_CIDR_PEER_INGRESS};
    let mut f = fixture("pf");
    let a = f.ep1.ifindex;
    let ifs = ifaces(&[(1, a), (2, f.ep2.ifindex)]);
    let c0 = compiled();
    // Ingress has CIDR peers but no ANY peer; egress has ANY but no CIDR peer.
    let flags = ep1_flags(&f);
    assert_ne!(flags & EP_NO_ANY_PEER_INGRESS, 0);
    assert_eq!(flags & EP_NO_CIDR_PEER_INGRESS, 0);
    assert_eq!(flags & EP_NO_ANY_PEER_EGRESS, 0);
    assert_ne!(flags & EP_NO_CIDR_PEER_EGRESS, 0);

    let world_in = |sport| v4("172.16.9.9", "10.0.0.1", L4::Tcp(sport, 22, 0x02));
    let world_out = |sport| v4("10.0.0.1", "172.16.9.9", L4::Tcp(sport, 22, 0x02));
    assert_eq!(
        f.dp.test_run(IN, a, &world_in(44001)).unwrap(),
        deny_r(Reason::PolicyDenied)
    );
    assert_eq!(
        f.dp.test_run(EG, a, &world_out(44002)).unwrap(),
        deny_r(Reason::PolicyDenied)
    );

    // A policy-only diff (no endpoint change) adds an ANY-peer ingress entry
    // and a CIDR-peer egress entry: the flags must follow, or the new
    // entries would never be looked up.
    let mut c1 = c0.clone();
    allow(&mut c1, 1, IN, IDENTITY_ANY, Some(Tcp), (22, 22), 20);
    allow(&mut c1, 1, EG, C_BLOCK, Some(Tcp), (22, 22), 21);
    let d = c0.diff(&c1);
    assert!(d.endpoints.upsert.is_empty() && d.endpoints.remove.is_empty());
    f.dp.apply(&d, &c1, &ifs).unwrap();
    let flags = ep1_flags(&f);
    assert_eq!(flags & (EP_NO_ANY_PEER_INGRESS | EP_NO_CIDR_PEER_EGRESS), 0);
    assert_eq!(f.dp.test_run(IN, a, &world_in(44003)).unwrap(), allow_r(Reason::Policy));
    assert_eq!(
        f.dp.test_run(EG, a, &world_out(44004)).unwrap(),
        allow_r(Reason::Policy)
    );

    // And back.
    f.dp.apply(&c1.diff(&c0), &c0, &ifs).unwrap();
    let flags = ep1_flags(&f);
    assert_ne!(flags & EP_NO_ANY_PEER_INGRESS, 0);
    assert_ne!(flags & EP_NO_CIDR_PEER_EGRESS, 0);
    assert_eq!(
        f.dp.test_run(IN, a, &world_in(44005)).unwrap(),
        deny_r(Reason::PolicyDenied)
    );
    assert_eq!(
        f.dp.test_run(EG, a, &world_out(44006)).unwrap(),
        deny_r(Reason::PolicyDenied)
    );
}

#[test]
fn ipv4_mapped_ipv6_shares_the_ipv4_conntrack_entry() {
    ipv4_mapped_ipv6_shares_the_ipv4_conntrack_entry_on(fixture("vm"));
}

#[test]
fn ipv4_mapped_ipv6_shares_the_ipv4_conntrack_entry_general_path() {
    ipv4_mapped_ipv6_shares_the_ipv4_conntrack_entry_on(general_fixture("vmg"));
}

fn ipv4_mapped_ipv6_shares_the_ipv4_conntrack_entry_on(f: Fixture) {
    let a = f.ep1.ifindex;
    // An IPv6 header carrying IPv4-mapped addresses is keyed like the IPv4
    // flow it maps to (one canonical key per address pair).
    let syn6 = v6("::ffff:10.0.0.2", "::ffff:10.0.0.1", L4::Tcp(45001, 80, 0x02));
    assert_eq!(f.dp.test_run(IN, a, &syn6).unwrap(), allow_r(Reason::Policy));
    let ct = f.dp.ct_entries();
    assert_eq!(ct.len(), 1);
    assert_eq!(ct[0].0.addr_lo, npm_common::IpKey::v4([10, 0, 0, 1]).addr);
    assert_eq!(ct[0].0.addr_hi, npm_common::IpKey::v4([10, 0, 0, 2]).addr);
    assert_eq!((ct[0].0.port_lo, ct[0].0.port_hi), (80, 45001));
    let synack = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 45001, 0x12));
    assert_eq!(f.dp.test_run(EG, a, &synack).unwrap(), allow_r(Reason::Tracked));
    assert_eq!(f.dp.ct_len(), 1);
    // A real IPv6 flow gets its own entry.
    let syn = v6("fd00::2", "fd00::1", L4::Tcp(45002, 80, 0x02));
    assert_eq!(f.dp.test_run(IN, a, &syn).unwrap(), allow_r(Reason::Policy));
    let ack = v6("fd00::2", "fd00::1", L4::Tcp(45002, 80, 0x10));
    assert_eq!(f.dp.test_run(IN, a, &ack).unwrap(), allow_r(Reason::Tracked));
    assert_eq!(f.dp.ct_len(), 2);
}

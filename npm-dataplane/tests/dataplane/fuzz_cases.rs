//! The cases of the packet fuzzer (`ebpf_fuzz`): each a short sequence of
//! frames at one endpoint (a first packet with random decorations; a
//! conversation of a first packet, next packets, replies and ICMP errors
//! about it; a fragmented datagram in a random order with overlaps,
//! duplicates and orphans; an unreadable frame), with the [`Shape`] the
//! judge decides each by.
#![allow(dead_code)]

use std::net::IpAddr;

use npm_policy::compiled::Direction;

use crate::fuzz_judge::{is_echo, quoted_flow, Flow, Shape};
use crate::fuzz_packets::{
    echo_rest, ext, frag6, icmp, malform, mapped, random_chunks, random_exts, random_options, random_tcp_flags, sctp,
    tcp, udp, Frame, ICMP, ICMPV6, MALFORMS, SCTP, TCP, UDP,
};
use crate::random_compiled::{Pod, Rng};

/// One frame of a case: direction (hook), bytes, shape.
pub struct Packet {
    /// The hook it runs through.
    pub dir: Direction,
    /// The Ethernet frame.
    pub bytes: Vec<u8>,
    /// What the judge decides it by.
    pub shape: Shape,
    /// A short name of how it was made.
    pub what: &'static str,
}

/// What a case draws from: the endpoint, every address, the ports of the
/// round.
pub struct Scope<'a> {
    /// The pod.
    pub pod: Pod<'a>,
    /// Every address of the random states.
    pub addrs: &'a [&'a str],
    /// Destination ports at the edges of the round's rules.
    pub ports: &'a [u16],
}

/// Protocols "other" flows use (no ports).
const OTHER: [u8; 3] = [47, 59, 253];

/// A flow's frame pieces before decoration.
#[derive(Clone)]
struct Base {
    /// IPv4 header.
    v4: bool,
    src: [u8; 16],
    dst: [u8; 16],
    proto: u8,
    sport: u16,
    dport: u16,
    tcp_flags: u8,
    icmp_type: u8,
}

fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[rng.below(xs.len() as u64) as usize]
}

fn addr(a: &str) -> IpAddr {
    a.parse().expect("address")
}

/// A random flow of `dir` at the scope's pod.
fn random_base(rng: &mut Rng, s: &Scope<'_>, dir: Direction) -> Base {
    let family4 = rng.below(2) == 0;
    let own = if family4 { s.pod.v4 } else { s.pod.v6 };
    let peers: Vec<&str> = s
        .addrs
        .iter()
        .copied()
        .filter(|a| a.contains(':') != family4 && *a != own)
        .collect();
    let peer = pick(rng, &peers);
    let mut own = mapped(addr(own));
    // Now and then an egress source that is not the pod's.
    if dir == Direction::Egress && rng.below(25) == 0 {
        own = mapped(addr(pick(rng, &peers)));
    }
    let peer = mapped(addr(peer));
    let (src, dst) = match dir {
        Direction::Ingress => (peer, own),
        Direction::Egress => (own, peer),
    };
    // IPv4 flows in an IPv6 header with IPv4-mapped addresses.
    let v4 = family4 && rng.below(8) != 0;
    let proto = match rng.below(20) {
        0..=6 => TCP,
        7..=11 => UDP,
        12..=14 => SCTP,
        15..=17 => {
            if v4 {
                ICMP
            } else {
                ICMPV6
            }
        }
        _ => pick(rng, &OTHER),
    };
    let dport = if rng.below(4) == 0 {
        rng.next() as u16
    } else {
        pick(rng, s.ports)
    };
    let icmp_type = if proto == ICMP || proto == ICMPV6 {
        let echo = if proto == ICMP { [8, 0] } else { [128, 129] };
        let error: &[u8] = if proto == ICMP { &[3, 11, 12] } else { &[1, 2, 3, 4] };
        match rng.below(10) {
            0..=4 => echo[0],
            5 => echo[1],
            6 | 7 => pick(rng, error),
            8 if proto == ICMPV6 => pick(rng, &[130, 133, 135, 136, 143]),
            _ => rng.next() as u8,
        }
    } else {
        0
    };
    Base {
        v4,
        src,
        dst,
        proto,
        sport: 1024 + rng.below(64_512) as u16,
        dport,
        tcp_flags: random_tcp_flags(rng),
        icmp_type,
    }
}

/// The quoted packet of an ICMP error: a header of `b`'s flow or of random
/// addresses and ports, cut or of the other family now and then.
fn random_quote(rng: &mut Rng, s: &Scope<'_>, b: &Base) -> Vec<u8> {
    let mut q = if rng.below(2) == 0 {
        // About a flow of the pod's, as sent by the error's destination.
        let mut inner = b.clone();
        std::mem::swap(&mut inner.src, &mut inner.dst);
        inner.proto = pick(rng, &[TCP, UDP, SCTP, if b.v4 { ICMP } else { ICMPV6 }, 47]);
        inner.icmp_type = if b.v4 { 8 } else { 128 };
        frame_of(rng, &inner, false).ip()
    } else {
        let mut inner = random_base(rng, s, Direction::Ingress);
        inner.v4 = if rng.below(6) == 0 { !b.v4 } else { b.v4 };
        frame_of(rng, &inner, false).ip()
    };
    match rng.below(6) {
        0 => q.truncate(rng.below(q.len() as u64) as usize),
        1 if q.len() > 2 => q[0] = rng.next() as u8,
        _ => q.truncate(q.len().min(if b.v4 { 28 } else { 48 } + rng.below(40) as usize)),
    }
    q
}

/// The L4 bytes of `b` (random decorations when `decorate`).
fn l4_of(rng: &mut Rng, b: &Base, decorate: bool) -> Vec<u8> {
    let payload = vec![0x61; if decorate { rng.below(24) as usize } else { 4 }];
    match b.proto {
        TCP => {
            let doff = if decorate && rng.below(4) == 0 {
                5 + rng.below(11) as u8
            } else {
                5
            };
            tcp(b.sport, b.dport, b.tcp_flags, doff, &payload)
        }
        UDP => {
            let len = if decorate && rng.below(4) == 0 {
                rng.next() as u16
            } else {
                (8 + payload.len()) as u16
            };
            udp(b.sport, b.dport, len, &payload)
        }
        SCTP => sctp(
            b.sport,
            b.dport,
            &if decorate { random_chunks(rng) } else { Vec::new() },
        ),
        ICMP | ICMPV6 => {
            let rest = if is_echo(b.proto, b.icmp_type) {
                echo_rest(b.sport)
            } else {
                [0, 0, 5, 0xdc]
            };
            icmp(b.icmp_type, 0, rest, &payload)
        }
        _ => payload,
    }
}

/// The frame of `b`, decorated: IPv4 options, IPv6 extension headers,
/// Ethernet padding.
fn frame_of(rng: &mut Rng, b: &Base, decorate: bool) -> Frame {
    let mut f = Frame::new(b.v4, b.src, b.dst, b.proto, l4_of(rng, b, decorate));
    f.id = rng.next() as u16;
    if decorate {
        if b.v4 && rng.below(4) == 0 {
            let words = 1 + rng.below(10) as usize;
            f.options = random_options(rng, words);
        }
        if !b.v4 && rng.below(3) == 0 {
            let n = 1 + rng.below(8) as usize;
            f.exts = random_exts(rng, n);
        }
        if rng.below(4) == 0 {
            f.pad = rng.below(40) as usize;
        }
        if b.v4 && rng.below(8) == 0 {
            // Don't-fragment (not a fragment).
            f.frag_field = 0x4000;
        }
    }
    f
}

/// The judge's flow of `b`.
fn flow_of(b: &Base) -> Flow {
    let (sport, dport) = match b.proto {
        TCP | UDP | SCTP => (b.sport, b.dport),
        ICMP | ICMPV6 if is_echo(b.proto, b.icmp_type) => (b.sport, b.sport),
        _ => (0, 0),
    };
    Flow {
        src: b.src,
        dst: b.dst,
        proto: b.proto,
        sport,
        dport,
    }
}

/// The readable shape of frame `f` of `b`.
fn readable(b: &Base, f: &Frame, first_fragment: Option<(u32, u8)>) -> Shape {
    let icmp = b.proto == ICMP || b.proto == ICMPV6;
    let quoted = if icmp && f.l4.len() >= 8 {
        let mut body = f.l4[8..].to_vec();
        body.extend(std::iter::repeat_n(0u8, f.pad));
        quoted_flow(b.v4, &body)
    } else {
        None
    };
    Shape::Readable {
        v4: b.v4,
        flow: flow_of(b),
        tcp_flags: if b.proto == TCP { b.tcp_flags } else { 0 },
        icmp_type: icmp.then_some(b.icmp_type),
        first_fragment,
        quoted,
    }
}

/// A readable packet of `b` (decorated; an ICMP error quotes a random
/// header).
fn single(rng: &mut Rng, s: &Scope<'_>, dir: Direction, b: &Base, what: &'static str) -> Packet {
    let mut f = frame_of(rng, b, true);
    if (b.proto == ICMP || b.proto == ICMPV6) && crate::fuzz_judge::is_error(b.proto, b.icmp_type) {
        f.l4.truncate(8);
        f.l4.extend(random_quote(rng, s, b));
    }
    Packet {
        dir,
        shape: readable(b, &f, None),
        bytes: f.bytes(),
        what,
    }
}

fn other(dir: Direction) -> Direction {
    match dir {
        Direction::Ingress => Direction::Egress,
        Direction::Egress => Direction::Ingress,
    }
}

/// A conversation: a first packet, then next packets, replies and ICMP
/// errors about it in either direction.
fn conversation(rng: &mut Rng, s: &Scope<'_>, dir: Direction) -> Vec<Packet> {
    let b = random_base(rng, s, dir);
    let mut out = vec![single(rng, s, dir, &b, "first")];
    for _ in 0..1 + rng.below(4) {
        let mut n = b.clone();
        n.tcp_flags = random_tcp_flags(rng);
        match rng.below(3) {
            0 => out.push(single(rng, s, dir, &n, "next")),
            1 => {
                std::mem::swap(&mut n.src, &mut n.dst);
                std::mem::swap(&mut n.sport, &mut n.dport);
                if n.proto == ICMP || n.proto == ICMPV6 {
                    // The echo identifier stays; a request's reply.
                    n.sport = b.sport;
                    n.icmp_type = match n.icmp_type {
                        8 => 0,
                        128 => 129,
                        t => t,
                    };
                }
                out.push(single(rng, s, other(dir), &n, "reply"));
            }
            _ => {
                // An ICMP error about the first packet, to its source.
                let quote = frame_of(rng, &b, false).ip();
                let cut = (if b.v4 { 28 } else { 48 } + rng.below(32) as usize).min(quote.len());
                let reporter = if rng.below(3) == 0 {
                    // A router of the flow's kind of address.
                    let v4ish = b.src[..12] == mapped(addr("0.0.0.0"))[..12];
                    let kind: Vec<&str> = s.addrs.iter().copied().filter(|a| a.contains(':') != v4ish).collect();
                    mapped(addr(pick(rng, &kind)))
                } else {
                    b.dst
                };
                let e = Base {
                    v4: b.v4,
                    src: reporter,
                    dst: b.src,
                    proto: if b.v4 { ICMP } else { ICMPV6 },
                    sport: 0,
                    dport: 0,
                    tcp_flags: 0,
                    icmp_type: if b.v4 {
                        pick(rng, &[3, 11, 12])
                    } else {
                        pick(rng, &[1, 2, 3, 4])
                    },
                };
                let mut f = Frame::new(
                    e.v4,
                    e.src,
                    e.dst,
                    e.proto,
                    icmp(e.icmp_type, 4, [0, 0, 5, 0xdc], &quote[..cut]),
                );
                if rng.below(5) == 0 {
                    f.pad = rng.below(30) as usize;
                }
                out.push(Packet {
                    dir: other(dir),
                    shape: readable(&e, &f, None),
                    bytes: f.bytes(),
                    what: "error",
                });
            }
        }
    }
    out
}

/// A fragmented datagram: its first fragment and 1 to 3 later ones
/// (overlapping offsets, a duplicate, another protocol or identification
/// now and then) in a random order, the first missing or cut short
/// sometimes.
fn fragments(rng: &mut Rng, s: &Scope<'_>, dir: Direction) -> Vec<Packet> {
    let mut b = random_base(rng, s, dir);
    if !matches!(b.proto, TCP | UDP | SCTP) {
        b.proto = UDP;
    }
    let id = rng.next() as u32 & if b.v4 { 0xffff } else { u32::MAX };
    let mut first = frame_of(rng, &b, false);
    first.l4.extend(vec![0x62; 16]);
    let frag_proto;
    if b.v4 {
        first.id = id as u16;
        first.frag_field = 0x2000 | if rng.below(4) == 0 { 0x4000 } else { 0 };
        frag_proto = b.proto;
    } else {
        let n = rng.below(3) as usize;
        let before = random_exts(rng, n);
        let n = rng.below(2) as usize;
        let after = random_exts(rng, n);
        frag_proto = after.first().map(|e| e.0).unwrap_or(b.proto);
        first.exts = before;
        first.exts.push(frag6(0, true, id));
        first.exts.extend(after);
    }
    let mut out = Vec::new();
    match rng.below(6) {
        0 => {}
        1 => {
            // A tiny first fragment: its L4 header cut by the IP length.
            if let Some(m) = malform(rng, &first, crate::fuzz_packets::Malform::L4CutByLength) {
                out.push(Packet {
                    dir,
                    bytes: m.bytes(),
                    shape: Shape::Malformed(crate::fuzz_packets::Malform::L4CutByLength),
                    what: "tiny first fragment",
                });
            }
        }
        _ => out.push(Packet {
            dir,
            bytes: first.bytes(),
            shape: readable(&b, &first, Some((id, frag_proto))),
            what: "first fragment",
        }),
    }
    for k in 0..1 + rng.below(3) {
        let off = if rng.below(3) == 0 {
            1
        } else {
            1 + rng.below(200) as u16
        };
        let more = k < 2 && rng.below(2) == 0;
        let mut lid = id;
        let mut lproto = frag_proto;
        match rng.below(10) {
            0 => lid ^= 1,
            1 => lproto = if lproto == UDP { TCP } else { UDP },
            _ => {}
        }
        let mut f = Frame::new(b.v4, b.src, b.dst, lproto, vec![0x63; 8 * (1 + rng.below(4) as usize)]);
        if b.v4 {
            f.id = lid as u16;
            f.frag_field = off | if more { 0x2000 } else { 0 };
        } else {
            // The later fragment's next header is the first's.
            f.exts = vec![frag6(off, more, lid)];
        }
        if rng.below(5) == 0 {
            f.pad = rng.below(30) as usize;
        }
        let shape = Shape::Later {
            v4: b.v4,
            src: b.src,
            dst: b.dst,
            id: lid,
            proto: lproto,
        };
        out.push(Packet {
            dir,
            bytes: f.bytes(),
            shape,
            what: "later fragment",
        });
    }
    // A random order; the first fragment twice now and then.
    for i in (1..out.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        out.swap(i, j);
    }
    if rng.below(6) == 0 {
        if let Some(p) = out.iter().find(|p| p.what == "first fragment") {
            let dup = Packet {
                dir: p.dir,
                bytes: p.bytes.clone(),
                shape: p.shape.clone(),
                what: "first fragment again",
            };
            out.push(dup);
        }
    }
    out
}

/// An unreadable frame, now and then after a first packet of its flow.
fn malformed(rng: &mut Rng, s: &Scope<'_>, dir: Direction) -> Vec<Packet> {
    let mut b = random_base(rng, s, dir);
    if !matches!(b.proto, TCP | UDP | SCTP | ICMP | ICMPV6) && rng.below(2) == 0 {
        b.proto = TCP;
    }
    let mut out = Vec::new();
    if rng.below(4) == 0 {
        out.push(single(rng, s, dir, &b, "first"));
    }
    let f = frame_of(rng, &b, true);
    for _ in 0..8 {
        let m = pick(rng, &MALFORMS);
        if let Some(bad) = malform(rng, &f, m) {
            out.push(Packet {
                dir,
                bytes: bad.bytes(),
                shape: Shape::Malformed(m),
                what: "malformed",
            });
            return out;
        }
    }
    out
}

/// One case at the scope's pod.
pub fn case(rng: &mut Rng, s: &Scope<'_>) -> Vec<Packet> {
    let dir = if rng.below(2) == 0 {
        Direction::Ingress
    } else {
        Direction::Egress
    };
    match rng.below(10) {
        0..=2 => {
            let b = random_base(rng, s, dir);
            vec![single(rng, s, dir, &b, "first")]
        }
        3..=5 => conversation(rng, s, dir),
        6 | 7 => fragments(rng, s, dir),
        _ => malformed(rng, s, dir),
    }
}

/// An extension header of `code` (re-exported for rows).
pub fn ext_header(code: u8, units: u8) -> (u8, Vec<u8>) {
    ext(code, units)
}

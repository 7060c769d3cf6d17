//! The packet generator of the packet fuzzer (`ebpf_fuzz`): frames built
//! byte by byte from a description ([`Frame`]), random well-formed
//! decorations (IPv4 options, IPv6 extension chains, TCP flag
//! combinations, SCTP chunks, wrong checksums and L4 length fields,
//! Ethernet padding, IPv4-mapped IPv6 addresses) and the malformations of
//! `docs/packet-spec.md` ([`Malform`]), each of which makes the frame
//! unreadable by the specification's rules.
#![allow(dead_code)]

use std::net::IpAddr;

use crate::random_compiled::Rng;

/// Protocol numbers.
pub const TCP: u8 = 6;
/// UDP.
pub const UDP: u8 = 17;
/// SCTP.
pub const SCTP: u8 = 132;
/// ICMP.
pub const ICMP: u8 = 1;
/// ICMPv6.
pub const ICMPV6: u8 = 58;

/// The 16-byte form of an address (IPv4 as `::ffff:a.b.c.d`), as the
/// datapath keys it.
pub fn mapped(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

/// The address of a 16-byte form (IPv4-mapped back to IPv4): the peer the
/// reference evaluator decides on.
pub fn unmapped(b: [u8; 16]) -> IpAddr {
    let a = std::net::Ipv6Addr::from(b);
    match a.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(a),
    }
}

/// An IP frame to build: header fields, extension headers, the L4 bytes
/// and the corruptions to apply.
#[derive(Clone, Debug)]
pub struct Frame {
    /// IPv4 header (else IPv6; an IPv6 header may carry IPv4-mapped
    /// addresses).
    pub v4: bool,
    /// Source (16-byte form; IPv4 frames take the last 4 bytes).
    pub src: [u8; 16],
    /// Destination.
    pub dst: [u8; 16],
    /// The protocol number after the IP header (and extension headers).
    pub proto: u8,
    /// L4 bytes (header and payload).
    pub l4: Vec<u8>,
    /// IPv4 options (a multiple of 4 bytes, at most 40).
    pub options: Vec<u8>,
    /// IPv4 identification.
    pub id: u16,
    /// IPv4 flags and fragment offset field.
    pub frag_field: u16,
    /// IPv6 extension headers: (code, body without the next-header byte).
    pub exts: Vec<(u8, Vec<u8>)>,
    /// A VLAN tag before the IP ethertype (TPID).
    pub vlan: Option<u16>,
    /// Ethertype written (None: the family's).
    pub ethertype: Option<u16>,
    /// First byte of the IP header (None: the family's version and IHL).
    pub first_byte: Option<u8>,
    /// Added to the IPv4 total length or IPv6 payload length field.
    pub len_delta: i32,
    /// Bytes after the IP datagram (Ethernet padding).
    pub pad: usize,
    /// Cut the frame to this many bytes.
    pub cut: Option<usize>,
}

impl Frame {
    /// A plain frame of `proto` carrying `l4`.
    pub fn new(v4: bool, src: [u8; 16], dst: [u8; 16], proto: u8, l4: Vec<u8>) -> Frame {
        Frame {
            v4,
            src,
            dst,
            proto,
            l4,
            options: Vec::new(),
            id: 1,
            frag_field: 0,
            exts: Vec::new(),
            vlan: None,
            ethertype: None,
            first_byte: None,
            len_delta: 0,
            pad: 0,
            cut: None,
        }
    }

    /// The IP datagram (header, extension headers, L4 bytes), without
    /// Ethernet.
    pub fn ip(&self) -> Vec<u8> {
        let mut h;
        if self.v4 {
            let ihl = 20 + self.options.len();
            let tot = (ihl + self.l4.len()) as i32 + self.len_delta;
            h = vec![self.first_byte.unwrap_or(0x40 | (ihl / 4) as u8), 0];
            h.extend((tot.clamp(0, 65_535) as u16).to_be_bytes());
            h.extend(self.id.to_be_bytes());
            h.extend(self.frag_field.to_be_bytes());
            h.extend([64, self.proto, 0xde, 0xad]);
            h.extend(&self.src[12..]);
            h.extend(&self.dst[12..]);
            h.extend(&self.options);
        } else {
            let mut body = Vec::new();
            for (i, (_, b)) in self.exts.iter().enumerate() {
                let next = self.exts.get(i + 1).map(|e| e.0).unwrap_or(self.proto);
                body.push(next);
                body.extend(b);
            }
            let first = self.exts.first().map(|e| e.0).unwrap_or(self.proto);
            let payload = (body.len() + self.l4.len()) as i32 + self.len_delta;
            h = vec![self.first_byte.unwrap_or(0x60), 0, 0, 0];
            h.extend((payload.clamp(0, 65_535) as u16).to_be_bytes());
            h.extend([first, 64]);
            h.extend(self.src);
            h.extend(self.dst);
            h.extend(body);
        }
        h.extend(&self.l4);
        h
    }

    /// The Ethernet frame.
    pub fn bytes(&self) -> Vec<u8> {
        let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
        if let Some(tpid) = self.vlan {
            f.extend(tpid.to_be_bytes());
            f.extend([0, 7]);
        }
        let et = self.ethertype.unwrap_or(if self.v4 { 0x0800 } else { 0x86dd });
        f.extend(et.to_be_bytes());
        f.extend(self.ip());
        f.extend(std::iter::repeat_n(0u8, self.pad));
        if let Some(n) = self.cut {
            f.truncate(n);
        }
        f
    }
}

/// A TCP header (data offset `doff` words, options zero) and `payload`.
pub fn tcp(sport: u16, dport: u16, flags: u8, doff: u8, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(sport.to_be_bytes());
    b.extend(dport.to_be_bytes());
    b.extend([0, 0, 0, 1, 0, 0, 0, 0]);
    b.push(doff << 4);
    b.push(flags);
    b.extend([0xff, 0xff, 0x12, 0x34, 0, 0]);
    for _ in 5..doff.max(5) {
        b.extend([1, 1, 1, 1]);
    }
    b.extend(payload);
    b
}

/// A UDP header with length field `len` and `payload`.
pub fn udp(sport: u16, dport: u16, len: u16, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(sport.to_be_bytes());
    b.extend(dport.to_be_bytes());
    b.extend(len.to_be_bytes());
    b.extend([0xbe, 0xef]);
    b.extend(payload);
    b
}

/// An SCTP common header and `chunks` (type, flags, value) chunks.
pub fn sctp(sport: u16, dport: u16, chunks: &[(u8, u8, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(sport.to_be_bytes());
    b.extend(dport.to_be_bytes());
    b.extend([0, 0, 0, 1, 0xca, 0xfe, 0xba, 0xbe]);
    for (t, fl, v) in chunks {
        b.extend([*t, *fl]);
        b.extend(((4 + v.len()) as u16).to_be_bytes());
        b.extend(v);
        while b.len() % 4 != 0 {
            b.push(0);
        }
    }
    b
}

/// An ICMP or ICMPv6 header (type, code, the 4 rest-of-header bytes) and
/// `body` (an error's quoted packet, an echo's payload).
pub fn icmp(t: u8, code: u8, rest: [u8; 4], body: &[u8]) -> Vec<u8> {
    let mut b = vec![t, code, 0x55, 0xaa];
    b.extend(rest);
    b.extend(body);
    b
}

/// The 4 rest-of-header bytes of an echo with identifier `id`.
pub fn echo_rest(id: u16) -> [u8; 4] {
    let i = id.to_be_bytes();
    [i[0], i[1], 0, 1]
}

/// An IPv6 extension header body (after its next-header byte) of `code`
/// with `units` extra 8-byte units (AH: 4-byte units).
pub fn ext(code: u8, units: u8) -> (u8, Vec<u8>) {
    match code {
        51 => {
            // AH: length in 4-byte units minus 2; at least 12 bytes.
            let len = units.max(1);
            let mut b = vec![len, 0, 0];
            b.extend(std::iter::repeat_n(0u8, (len as usize + 2) * 4 - 4));
            (51, b)
        }
        _ => {
            let mut b = vec![units];
            // PadN over the rest (options headers); routing: type 0, 0 left.
            b.extend(std::iter::repeat_n(0u8, (units as usize + 1) * 8 - 2));
            if code == 0 || code == 60 {
                b[1] = 1;
                b[2] = (units as usize * 8 + 4) as u8;
            }
            (code, b)
        }
    }
}

/// An IPv6 fragment extension header (offset in 8-byte units, more flag,
/// identification).
pub fn frag6(off: u16, more: bool, id: u32) -> (u8, Vec<u8>) {
    let mut b = vec![0];
    b.extend(((off << 3) | u16::from(more)).to_be_bytes());
    b.extend(id.to_be_bytes());
    (44, b)
}

/// Random extension headers for an IPv6 packet: `n` of hop-by-hop (first
/// only), routing, destination options and AH.
pub fn random_exts(rng: &mut Rng, n: usize) -> Vec<(u8, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let code = match rng.below(4) {
                0 if i == 0 => 0,
                0 | 1 => 60,
                2 => 43,
                _ => 51,
            };
            ext(code, rng.below(3) as u8)
        })
        .collect()
}

/// Random IPv4 options of `words` 4-byte words (NOP, record route shaped,
/// end of list).
pub fn random_options(rng: &mut Rng, words: usize) -> Vec<u8> {
    let mut o = Vec::new();
    while o.len() < words * 4 {
        match rng.below(3) {
            0 => o.push(1),
            1 if words * 4 - o.len() >= 7 => o.extend([7, 7, 4, 0, 0, 0, 0]),
            _ => o.push(0),
        }
    }
    o.truncate(words * 4);
    o
}

/// Random TCP flags: SYN, SYN-ACK, ACK, FIN-ACK, RST, RST-ACK, PSH-ACK,
/// and arbitrary bytes (SYN with FIN, all flags, none).
pub fn random_tcp_flags(rng: &mut Rng) -> u8 {
    const COMMON: [u8; 8] = [0x02, 0x12, 0x10, 0x11, 0x04, 0x14, 0x18, 0x03];
    if rng.below(4) == 0 {
        rng.next() as u8
    } else {
        COMMON[rng.below(COMMON.len() as u64) as usize]
    }
}

/// Random SCTP chunks: INIT, DATA, ABORT, SHUTDOWN, COOKIE-ECHO, or none.
pub fn random_chunks(rng: &mut Rng) -> Vec<(u8, u8, Vec<u8>)> {
    (0..rng.below(3))
        .map(|_| {
            let t = [1u8, 0, 6, 7, 10, 0xc0][rng.below(6) as usize];
            (t, rng.next() as u8, vec![0x11; rng.below(20) as usize])
        })
        .collect()
}

/// The minimum L4 header length the datapath reads for `proto` (0: it
/// reads none).
pub fn l4_min(proto: u8) -> usize {
    match proto {
        TCP => 20,
        UDP | ICMP | ICMPV6 => 8,
        SCTP => 12,
        _ => 0,
    }
}

/// A malformation of `docs/packet-spec.md`: each makes a frame unreadable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Malform {
    /// An 802.1Q or 802.1ad tag before the IP ethertype.
    Vlan,
    /// The ethertype of one family over the header of the other (or a
    /// version that is neither 4 nor 6).
    Version,
    /// IPv4 header length below 5 words.
    IhlShort,
    /// IPv4 total length below the header length.
    TotBelowIhl,
    /// The frame cut before the end the IP length field gives.
    CutBelowLength,
    /// The IP length ends inside the L4 header (Ethernet padding after it).
    L4CutByLength,
    /// A TCP data offset below 5 words.
    TcpDoff,
    /// An IPv6 extension chain of more than 8 headers.
    LongChain,
    /// An IPv6 extension header whose length runs past the frame.
    ExtPastEnd,
    /// Two IPv6 fragment headers.
    TwoFragHeaders,
}

/// Every malformation.
pub const MALFORMS: [Malform; 10] = [
    Malform::Vlan,
    Malform::Version,
    Malform::IhlShort,
    Malform::TotBelowIhl,
    Malform::CutBelowLength,
    Malform::L4CutByLength,
    Malform::TcpDoff,
    Malform::LongChain,
    Malform::ExtPastEnd,
    Malform::TwoFragHeaders,
];

/// Applies `m` to `f` (a well-formed, unfragmented frame of a TCP, UDP,
/// SCTP or ICMP flow); None when `m` does not apply to its family or
/// protocol.
pub fn malform(rng: &mut Rng, f: &Frame, m: Malform) -> Option<Frame> {
    let mut f = f.clone();
    match m {
        Malform::Vlan => f.vlan = Some(if rng.below(2) == 0 { 0x8100 } else { 0x88a8 }),
        Malform::Version => {
            if rng.below(3) == 0 {
                f.first_byte = Some([0x55, 0x75, 0x05, 0xf5][rng.below(4) as usize]);
            } else {
                f.ethertype = Some(if f.v4 { 0x86dd } else { 0x0800 });
            }
        }
        Malform::IhlShort if f.v4 => f.first_byte = Some(0x40 | rng.below(5) as u8),
        Malform::TotBelowIhl if f.v4 => {
            let ihl = 20 + f.options.len() as i32;
            f.len_delta = -(f.l4.len() as i32) - 1 - rng.below(ihl as u64) as i32;
        }
        Malform::CutBelowLength => {
            f.pad = 0;
            let full = f.bytes().len();
            let floor = 14 + if f.v4 { 20 } else { 40 };
            if full <= floor {
                return None;
            }
            f.cut = Some(floor + rng.below((full - floor) as u64) as usize);
        }
        Malform::L4CutByLength => {
            let min = l4_min(f.proto);
            if min == 0 {
                return None;
            }
            let keep = rng.below(min as u64) as i32;
            f.len_delta = keep - f.l4.len() as i32;
            // What follows the datagram: the rest of the L4 bytes, as
            // Ethernet padding would be read.
            f.pad = if rng.below(4) == 0 { 0 } else { 60 };
        }
        Malform::TcpDoff if f.proto == TCP => {
            f.l4[12] = (rng.below(5) as u8) << 4;
        }
        Malform::LongChain if !f.v4 => {
            let n = 9 + rng.below(4) as usize;
            f.exts = random_exts(rng, n);
        }
        Malform::ExtPastEnd if !f.v4 => {
            let n = rng.below(3) as usize;
            let mut e = random_exts(rng, n);
            // The last header claims more units than the frame holds.
            let code = if rng.below(2) == 0 { 60 } else { 43 };
            let mut last = ext(code, 0);
            last.1[0] = 200 + rng.below(50) as u8;
            e.push(last);
            f.exts = e;
            f.l4.truncate(rng.below(f.l4.len() as u64 + 1) as usize);
        }
        Malform::TwoFragHeaders if !f.v4 => {
            let id = rng.next() as u32;
            f.exts = vec![frag6(0, true, id), frag6(0, true, id)];
        }
        _ => return None,
    }
    Some(f)
}

//! The judge of the packet fuzzer (`ebpf_fuzz`): `docs/packet-spec.md` as
//! code. A packet is described by what the generator made of it
//! ([`Shape`]); the judge reads the compiled state through the reference
//! evaluator (`npm_policy::lookup::lookup`) and its own model of the state
//! the datapath must hold ([`Model`]: conntrack entries and allowed first
//! fragments, fed with the verdicts it accepted) and says which verdicts
//! the specification permits ([`Want`]).
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use npm_common::Reason;
use npm_policy::compiled::{Compiled, Direction, Tier};
use npm_policy::lookup::lookup;

use crate::fuzz_packets::{unmapped, Malform, ICMP, ICMPV6, SCTP, TCP, UDP};

/// A flow as the datapath keys it: 16-byte addresses (IPv4-mapped for
/// IPv4), protocol and conntrack ports (L4 ports, an echo's identifier on
/// both sides, else 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Flow {
    /// Source.
    pub src: [u8; 16],
    /// Destination.
    pub dst: [u8; 16],
    /// Protocol number.
    pub proto: u8,
    /// Conntrack source port.
    pub sport: u16,
    /// Conntrack destination port.
    pub dport: u16,
}

impl Flow {
    /// The destination port policy decides on (TCP, UDP, SCTP; else 0).
    pub fn policy_port(&self) -> u16 {
        match self.proto {
            TCP | UDP | SCTP => self.dport,
            _ => 0,
        }
    }
}

/// What the generator built: the packet's shape under the specification.
#[derive(Clone, Debug)]
pub enum Shape {
    /// A readable packet that is not a non-first fragment.
    Readable {
        /// An IPv4 header (else IPv6, maybe with IPv4-mapped addresses).
        v4: bool,
        /// Its flow.
        flow: Flow,
        /// TCP flags (0 for other protocols).
        tcp_flags: u8,
        /// ICMP or ICMPv6 type (for those protocols).
        icmp_type: Option<u8>,
        /// A first fragment: its identification and the protocol its
        /// record is keyed with (IPv4: the header's; IPv6: the fragment
        /// header's next header).
        first_fragment: Option<(u32, u8)>,
        /// An ICMP error's quoted flow, when the quoted header is readable
        /// (`quoted_flow`).
        quoted: Option<Flow>,
    },
    /// A non-first fragment: (identification, protocol).
    Later {
        /// An IPv4 header.
        v4: bool,
        /// Source and destination (16-byte form).
        src: [u8; 16],
        /// Destination.
        dst: [u8; 16],
        /// Identification.
        id: u32,
        /// Protocol (IPv4 header, or the fragment header's next header).
        proto: u8,
    },
    /// An unreadable packet.
    Malformed(Malform),
}

/// The verdicts the specification permits for one packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Exactly this (allowed, reason).
    Exact(bool, Reason),
    /// Any of these (allowed, reason): an entry of the model that may have
    /// idled out answers (`Tracked`, `Related`) or the next rule does.
    AnyOf([Option<(bool, Reason)>; 3]),
    /// Allowed with this reason (a first fragment's record that may have
    /// been evicted), or dropped as `Fragment`.
    FragmentOr(Reason),
    /// Dropped, for any reason; or allowed when the endpoint is not
    /// isolated in this direction (the fail-closed rule of unreadable
    /// packets).
    Unreadable {
        /// The endpoint is not isolated in this direction.
        unisolated: bool,
    },
}

impl Want {
    /// Whether `got` (allowed, reason) is permitted.
    pub fn permits(&self, allowed: bool, reason: Option<Reason>) -> bool {
        match *self {
            Want::Exact(a, r) => allowed == a && reason == Some(r),
            Want::AnyOf(options) => options
                .iter()
                .flatten()
                .any(|(a, r)| allowed == *a && reason == Some(*r)),
            Want::FragmentOr(r) => (allowed && reason == Some(r)) || (!allowed && reason == Some(Reason::Fragment)),
            // Fail closed, and as the datapath states it: `Malformed`.
            // (The weakest form of the rule, allowed only where unisolated,
            // is `!allowed || unisolated`.)
            Want::Unreadable { .. } => !allowed && reason == Some(Reason::Malformed),
        }
    }
}

/// A canonical conntrack key: (endpoint, protocol, the two (address,
/// port) ends in order).
type CtKey = (u32, u8, ([u8; 16], u16), ([u8; 16], u16));

fn ct_key(ep: u32, f: &Flow) -> CtKey {
    let a = (f.src, f.sport);
    let b = (f.dst, f.dport);
    if a <= b {
        (ep, f.proto, a, b)
    } else {
        (ep, f.proto, b, a)
    }
}

/// A fragment record key: (endpoint, direction, identification, protocol,
/// source, destination).
type FragKey = (u32, Direction, u32, u8, [u8; 16], [u8; 16]);

/// An entry younger than this must still answer (the shortest conntrack
/// timeout is 10 s; the LRU maps evict only after thousands of newer
/// entries, more than the fuzzer makes in this time).
const SURE: Duration = Duration::from_secs(5);

/// The state the datapath must hold, as the accepted verdicts made it.
#[derive(Default)]
pub struct Model {
    ct: HashMap<CtKey, Instant>,
    frags: HashMap<FragKey, (Reason, Instant)>,
}

/// The reasons with which steps 7 to 9 allow (and create a conntrack
/// entry).
fn creates_entry(r: Reason) -> bool {
    matches!(
        r,
        Reason::Policy | Reason::NotIsolated | Reason::Host | Reason::AdminAccept | Reason::BaselineAccept
    )
}

/// Whether endpoint `ep` is unisolated in `dir`: no NetworkPolicy
/// isolates it and no tier has entries for it.
pub fn unisolated(c: &Compiled, ep: u32, dir: Direction) -> bool {
    let e = &c.endpoints[&ep];
    let iso = match dir {
        Direction::Ingress => e.isolated_ingress,
        Direction::Egress => e.isolated_egress,
    };
    !iso && !e.tiers.has(Tier::Admin, dir) && !e.tiers.has(Tier::Baseline, dir)
}

/// Whether an ICMP (`proto` 1) or ICMPv6 type is an error the datapath
/// relates to a flow.
pub fn is_error(proto: u8, t: u8) -> bool {
    if proto == ICMP {
        matches!(t, 3 | 11 | 12)
    } else {
        (1..=4).contains(&t)
    }
}

/// ICMPv6 neighbour discovery and MLD.
pub fn is_control(t: u8) -> bool {
    (130..=137).contains(&t) || t == 143
}

/// Whether an ICMP or ICMPv6 type is an echo.
pub fn is_echo(proto: u8, t: u8) -> bool {
    if proto == ICMP {
        t == 0 || t == 8
    } else {
        t == 128 || t == 129
    }
}

/// The flow an ICMP error quotes (`body`: the bytes after its 8-byte
/// header, to the end of the frame), by the specification's rule: a header
/// of the error's own family (IPv4: version 4, header length of at least 5
/// words, not a non-first fragment; IPv6: version 6, the next header as
/// protocol) and its first 8 L4 bytes; else None.
pub fn quoted_flow(v4: bool, body: &[u8]) -> Option<Flow> {
    let (src, dst, proto, l4) = if v4 {
        let h = body.get(..20)?;
        let ihl = usize::from(h[0] & 0x0f) * 4;
        if h[0] >> 4 != 4 || ihl < 20 || u16::from_be_bytes([h[6], h[7]]) & 0x1fff != 0 {
            return None;
        }
        let ip = |o: usize| std::net::Ipv4Addr::new(h[o], h[o + 1], h[o + 2], h[o + 3]).to_ipv6_mapped();
        (ip(12).octets(), ip(16).octets(), h[9], ihl)
    } else {
        let h = body.get(..40)?;
        if h[0] >> 4 != 6 {
            return None;
        }
        let mut s = [0u8; 16];
        let mut d = [0u8; 16];
        s.copy_from_slice(&h[8..24]);
        d.copy_from_slice(&h[24..40]);
        (s, d, h[6], 40)
    };
    let (mut sport, mut dport) = (0, 0);
    match proto {
        TCP | UDP | SCTP => {
            let b = body.get(l4..l4 + 8)?;
            sport = u16::from_be_bytes([b[0], b[1]]);
            dport = u16::from_be_bytes([b[2], b[3]]);
        }
        ICMP | ICMPV6 => {
            let b = body.get(l4..l4 + 8)?;
            if is_echo(proto, b[0]) {
                sport = u16::from_be_bytes([b[4], b[5]]);
                dport = sport;
            }
        }
        _ => {}
    }
    Some(Flow {
        src,
        dst,
        proto,
        sport,
        dport,
    })
}

impl Model {
    /// The entry of `flow` at `ep`: Some(sure) when the model holds one
    /// (sure: young enough that it cannot have idled out).
    fn entry(&self, ep: u32, flow: &Flow) -> Option<bool> {
        self.ct.get(&ct_key(ep, flow)).map(|t| t.elapsed() < SURE)
    }

    /// How many conntrack entries and fragment records the model holds.
    pub fn sizes(&self) -> (usize, usize) {
        (self.ct.len(), self.frags.len())
    }

    /// The specification's verdicts for a packet of `shape` at endpoint
    /// `ep` (addresses `own4`, `own6` in 16-byte form) in `dir`.
    pub fn judge(&self, c: &Compiled, ep: u32, own: ([u8; 16], [u8; 16]), dir: Direction, shape: &Shape) -> Want {
        match shape {
            Shape::Malformed(_) => Want::Unreadable {
                unisolated: unisolated(c, ep, dir),
            },
            Shape::Later {
                v4,
                src,
                dst,
                id,
                proto,
            } => {
                if dir == Direction::Egress && *src != if *v4 { own.0 } else { own.1 } {
                    return Want::Exact(false, Reason::Spoofed);
                }
                match self.frags.get(&(ep, dir, *id, *proto, *src, *dst)) {
                    Some((r, t)) if t.elapsed() < SURE => Want::Exact(true, *r),
                    Some((r, _)) => Want::FragmentOr(*r),
                    None => Want::Exact(false, Reason::Fragment),
                }
            }
            Shape::Readable {
                v4,
                flow,
                tcp_flags,
                icmp_type,
                quoted,
                first_fragment,
            } => {
                if !*v4 && flow.proto == ICMPV6 && icmp_type.is_some_and(is_control) {
                    return Want::Exact(true, Reason::Icmpv6Control);
                }
                if dir == Direction::Egress && flow.src != if *v4 { own.0 } else { own.1 } {
                    return Want::Exact(false, Reason::Spoofed);
                }
                let peer = unmapped(if dir == Direction::Ingress { flow.src } else { flow.dst });
                let r = lookup(c, ep, dir, peer, flow.proto, flow.policy_port());
                let reference = (r.allowed, r.reason);
                // Step 6: a related error, then the packet's own entry. An
                // entry that may have idled out adds its answer to what the
                // next rule says.
                let mut maybe_related = None;
                if let (Some(q), Some(t)) = (quoted, icmp_type) {
                    if first_fragment.is_none() && is_error(flow.proto, *t) && flow.dst == q.src {
                        match self.entry(ep, q) {
                            Some(true) => return Want::Exact(true, Reason::Related),
                            Some(false) => maybe_related = Some((true, Reason::Related)),
                            None => {}
                        }
                    }
                }
                let opening = flow.proto == TCP && tcp_flags & 0x12 == 0x02;
                let tracked = if opening { None } else { self.entry(ep, flow) };
                match tracked {
                    Some(true) => Want::AnyOf([maybe_related, Some((true, Reason::Tracked)), None]),
                    Some(false) => Want::AnyOf([maybe_related, Some((true, Reason::Tracked)), Some(reference)]),
                    None if maybe_related.is_some() => Want::AnyOf([maybe_related, Some(reference), None]),
                    None => Want::Exact(reference.0, reference.1),
                }
            }
        }
    }

    /// Feeds the verdict the judge accepted into the model, `at` being an
    /// instant no later than the kernel's run of the packet (the model's
    /// entries are then never younger than the kernel's).
    pub fn record(
        &mut self,
        at: Instant,
        ep: u32,
        dir: Direction,
        shape: &Shape,
        allowed: bool,
        reason: Option<Reason>,
    ) {
        let (Some(reason), true) = (reason, allowed) else {
            return;
        };
        if let Shape::Readable {
            flow, first_fragment, ..
        } = shape
        {
            if creates_entry(reason) || reason == Reason::Tracked {
                // A new entry, or a refreshed one.
                self.ct.insert(ct_key(ep, flow), at);
            }
            if let (Some((id, proto)), true) = (first_fragment, reason != Reason::Icmpv6Control) {
                self.frags
                    .insert((ep, dir, *id, *proto, flow.src, flow.dst), (reason, at));
            }
        }
    }
}

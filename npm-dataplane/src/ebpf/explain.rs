//! The kernel's own verdict for `npm-agent explain`: the classifier that is
//! really attached to an endpoint's host veth (found through the pinned
//! tcx links or npm's tc filters of a pin directory, never loaded again)
//! runs once with `BPF_PROG_TEST_RUN` over a crafted packet (Ethernet,
//! IPv4 or IPv6, a TCP SYN, a UDP datagram or an SCTP INIT) against the
//! live maps it uses.
//!
//! The run is a *dry run*: its `__sk_buff.ingress_ifindex` is
//! [`DRY_RUN_IIF`], a value no real packet carries (see
//! `npm_common::DRY_RUN_IIF` for why). The classifier then creates no
//! conntrack entry, fills neither per-CPU cache, counts nothing and sends
//! no deny event; it returns its reason in the skb mark, which
//! `BPF_PROG_TEST_RUN` copies back (`ctx_out`). A packet of an existing
//! tracked flow writes nothing to its entry either (no flag, no idle time:
//! a crafted "reply" never confirms a pending Service entry). What
//! remains: the per-CPU clock cache may be refreshed (scratch). A program
//! without dry-run support
//! (an agent from before it) does not set the mark: that is reported as
//! [`ExplainError::NoDryRun`], and such a run did count and track.

use std::net::IpAddr;
use std::path::Path;

use aya::programs::{loaded_programs, ProgramError, SchedClassifier, TestRun, TestRunOptions};
use npm_common::{Reason, DIR_EGRESS, DIR_INGRESS};
use npm_policy::compiled::Direction;

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use npm_common::{maps, EndpointInfo};

use super::dump::pinned_link_programs;
use super::endpoints::read_entries;
use super::pins::open_pinned;
use super::{translate, EbpfError};

/// The dry-run signal (`__sk_buff.ingress_ifindex` of an explain run) and
/// the mark a dry run returns its reason in: one definition, shared with
/// the classifier (`npm_common`).
pub use npm_common::{DRY_RUN_IIF, DRY_RUN_MARK};

/// The source port of crafted packets.
const CRAFTED_SPORT: u16 = 49152;

/// Errors of an explain run.
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    /// The pinned links, filters or endpoint maps could not be read.
    #[error("explain: reading the pins under {pin_dir}: {source}")]
    Links {
        /// The pin directory.
        pin_dir: String,
        /// The error.
        #[source]
        source: EbpfError,
    },
    /// No npm program is attached on that hook.
    #[error("explain: no npm program attached to the {direction} hook of ifindex {ifindex}")]
    NotAttached {
        /// Host-side ifindex.
        ifindex: u32,
        /// Pod direction.
        direction: &'static str,
    },
    /// The attached program could not be opened or run.
    #[error("explain: program {id} on ifindex {ifindex}: {op}: {source}")]
    Program {
        /// Program id.
        id: u32,
        /// Host-side ifindex.
        ifindex: u32,
        /// What failed.
        op: &'static str,
        /// The error.
        #[source]
        source: ProgramError,
    },
    /// The attached program id is not loaded (it was replaced meanwhile).
    #[error("explain: program {id} attached on ifindex {ifindex} is no longer loaded")]
    Gone {
        /// Program id.
        id: u32,
        /// Host-side ifindex.
        ifindex: u32,
    },
    /// The program did not answer as a dry run (an older classifier).
    #[error(
        "explain: program {id} on ifindex {ifindex} has no dry-run support (mark {mark:#x}); \
         its run may have counted and tracked the packet"
    )]
    NoDryRun {
        /// Program id.
        id: u32,
        /// Host-side ifindex.
        ifindex: u32,
        /// The mark it returned.
        mark: u32,
    },
    /// The addresses are of different families.
    #[error("explain: {src} and {dst} are of different address families")]
    Family {
        /// Source.
        src: IpAddr,
        /// Destination.
        dst: IpAddr,
    },
    /// A protocol without a crafted packet.
    #[error("explain: no crafted packet for IP protocol {0} (TCP, UDP or SCTP)")]
    Protocol(u8),
}

/// What the kernel decided for a crafted packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelVerdict {
    /// The program's return was not `TC_ACT_SHOT`.
    pub allowed: bool,
    /// The reason it returned in the mark (`None`: a number this build
    /// does not know).
    pub reason: Option<Reason>,
    /// The raw reason byte.
    pub reason_code: u8,
    /// The id of the program that ran (the attached one).
    pub program_id: u32,
}

/// An Ethernet frame from `src` to `dst:dport` of IP protocol `proto`
/// (6 TCP: a SYN; 17 UDP; 132 SCTP: an INIT chunk), as a new connection's
/// first packet. Checksums are left zero: the classifier never reads them.
pub fn crafted_packet(src: IpAddr, dst: IpAddr, proto: u8, dport: u16) -> Result<Vec<u8>, ExplainError> {
    let mut l4: Vec<u8> = Vec::with_capacity(32);
    l4.extend(CRAFTED_SPORT.to_be_bytes());
    l4.extend(dport.to_be_bytes());
    match proto {
        // seq 1, ack 0, data offset 5, SYN, window 65535.
        6 => l4.extend([0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]),
        // length 8, checksum 0.
        17 => l4.extend([0, 8, 0, 0]),
        // verification tag 0, checksum; INIT (type 1, length 20): initiate
        // tag, a_rwnd, 1 outbound and 1 inbound stream, initial TSN.
        132 => {
            l4.extend([0, 0, 0, 0, 0, 0, 0, 0]);
            l4.extend([1, 0, 0, 20, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1]);
        }
        p => return Err(ExplainError::Protocol(p)),
    }
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            f.extend([0x08, 0x00]);
            let total = (20 + l4.len()) as u16;
            f.extend([0x45, 0]);
            f.extend(total.to_be_bytes());
            f.extend([0, 1, 0x40, 0, 64, proto, 0, 0]);
            f.extend(s.octets());
            f.extend(d.octets());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            f.extend([0x86, 0xdd]);
            f.extend([0x60, 0, 0, 0]);
            f.extend((l4.len() as u16).to_be_bytes());
            f.extend([proto, 64]);
            f.extend(s.octets());
            f.extend(d.octets());
        }
        (src, dst) => return Err(ExplainError::Family { src, dst }),
    }
    f.extend(l4);
    Ok(f)
}

/// The host-side ifindex and endpoint id of the endpoint record that
/// holds `addr` in the maps pinned under `pin_dir` (what the kernel
/// believes, not what the agent compiled); `None` when no record holds it.
pub fn endpoint_interface(pin_dir: &Path, addr: IpAddr) -> Result<Option<(u32, u32)>, ExplainError> {
    let links = |source| ExplainError::Links {
        pin_dir: pin_dir.display().to_string(),
        source,
    };
    let slots: Array<MapData, EndpointInfo> = open_pinned(pin_dir, maps::EP_SLOTS).map_err(links)?;
    let overflow: BpfHashMap<MapData, u32, EndpointInfo> = open_pinned(pin_dir, maps::ENDPOINTS).map_err(links)?;
    let entries = read_entries(&slots, &overflow).map_err(links)?;
    Ok(entries
        .into_iter()
        .find(|(_, info)| match addr {
            IpAddr::V4(a) => translate::endpoint_ipv4(info) == Some(a),
            IpAddr::V6(a) => translate::endpoint_ipv6(info) == Some(a),
        })
        .map(|(ifindex, info)| (ifindex, info.id)))
}

/// Runs the program attached (by the agent of `pin_dir`) to the
/// `direction` hook of host-side interface `ifindex` once on `packet`, as
/// a dry run (see the module documentation: no conntrack entry, no cache
/// fill, no counter, no event). Read-only towards the agent: no program is
/// loaded, no map or link is written.
pub fn explain_run(
    pin_dir: &Path,
    ifindex: u32,
    direction: Direction,
    packet: &[u8],
) -> Result<KernelVerdict, ExplainError> {
    let dir = match direction {
        Direction::Ingress => DIR_INGRESS,
        Direction::Egress => DIR_EGRESS,
    };
    let dir_name = direction.name();
    let attached = pinned_link_programs(pin_dir).map_err(|source| ExplainError::Links {
        pin_dir: pin_dir.display().to_string(),
        source,
    })?;
    let name = if dir == DIR_INGRESS { "ingress" } else { "egress" };
    let id = *attached.get(&(ifindex, name)).ok_or(ExplainError::NotAttached {
        ifindex,
        direction: dir_name,
    })?;
    let perr = |op: &'static str| {
        move |source| ExplainError::Program {
            id,
            ifindex,
            op,
            source,
        }
    };
    let info = loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == id)
        .ok_or(ExplainError::Gone { id, ifindex })?;
    let prog =
        SchedClassifier::from_program_info(info, std::borrow::Cow::Borrowed("npm-explain")).map_err(perr("open"))?;
    // `struct __sk_buff` up to `ifindex` (offset 40): `ingress_ifindex`
    // (offset 36) carries the dry-run signal, `ifindex` binds the test skb
    // to the endpoint's device; everything else zero.
    let mut ctx = [0u8; 44];
    ctx[36..40].copy_from_slice(&DRY_RUN_IIF.to_ne_bytes());
    ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    // The whole `__sk_buff` comes back (192 bytes on 6.x; room to spare).
    let mut out = [0u8; 256];
    let res = prog
        .test_run(TestRunOptions {
            data_in: Some(packet),
            ctx_in: Some(&ctx),
            ctx_out: Some(&mut out),
            repeat: 1,
            ..TestRunOptions::default()
        })
        .map_err(perr("BPF_PROG_TEST_RUN"))?;
    let mark = u32::from_ne_bytes([out[8], out[9], out[10], out[11]]);
    if mark & !0xff != DRY_RUN_MARK {
        return Err(ExplainError::NoDryRun { id, ifindex, mark });
    }
    let code = (mark & 0xff) as u8;
    Ok(KernelVerdict {
        allowed: res.return_value as i32 != 2,
        reason: Reason::from_u8(code),
        reason_code: code,
        program_id: id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crafted_packets_have_the_right_lengths_and_fields() {
        let v4 = |s: &str| s.parse::<IpAddr>().unwrap();
        let p = crafted_packet(v4("10.0.0.1"), v4("10.0.0.2"), 6, 80).unwrap();
        assert_eq!(p.len(), 14 + 20 + 20);
        assert_eq!(&p[12..14], &[0x08, 0x00]);
        assert_eq!(p[14 + 9], 6);
        assert_eq!(u16::from_be_bytes([p[16], p[17]]) as usize, p.len() - 14);
        assert_eq!(u16::from_be_bytes([p[36], p[37]]), 80);
        assert_eq!(p[14 + 20 + 13], 0x02, "SYN");
        let p = crafted_packet(v4("fd00::1"), v4("fd00::2"), 132, 5000).unwrap();
        assert_eq!(p.len(), 14 + 40 + 12 + 20);
        assert_eq!(u16::from_be_bytes([p[18], p[19]]) as usize, 32);
        assert_eq!(p[14 + 6], 132);
        assert_eq!(p[14 + 40 + 12], 1, "INIT");
        let p = crafted_packet(v4("fd00::1"), v4("fd00::2"), 17, 53).unwrap();
        assert_eq!(p.len(), 14 + 40 + 8);
        assert!(matches!(
            crafted_packet(v4("10.0.0.1"), v4("fd00::2"), 6, 80),
            Err(ExplainError::Family { .. })
        ));
        assert!(matches!(
            crafted_packet(v4("10.0.0.1"), v4("10.0.0.2"), 1, 0),
            Err(ExplainError::Protocol(1))
        ));
    }
}

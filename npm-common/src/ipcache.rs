//! `NPM_IPCACHE` (exact address -> [`IpInfo`], keyed by [`IpKey`]) and its
//! direct-mapped IPv4 front `NPM_IPCACHE4` ([`ipcache4_slot`],
//! [`ipcache4_word`]); addresses are IPv4-mapped ([`V4_MAPPED_PREFIX`]).

use core::mem::{align_of, offset_of, size_of};

use crate::maps::sizes;
use crate::packet::{cidr_code, cidr_of_code, IDENTITY_ANY, IDENTITY_FIRST_CIDR};

/// Bytes 0..12 of an IPv4-mapped address (`::ffff:0:0/96`).
pub const V4_MAPPED_PREFIX: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

/// An address: IPv6, or IPv4-mapped IPv6 (`::ffff:a.b.c.d`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct IpKey {
    /// Address bytes in network order.
    pub addr: [u8; 16],
}
// The datapath reads any 16 address bytes as an `IpKey`.
const _: () = assert!(size_of::<IpKey>() == 16);
const _: () = assert!(align_of::<IpKey>() == 1);
const _: () = assert!(offset_of!(IpKey, addr) == 0);

impl IpKey {
    /// The IPv4-mapped form of an IPv4 address given in network byte order.
    pub const fn v4(octets: [u8; 4]) -> Self {
        let mut addr = [0u8; 16];
        addr[10] = 0xff;
        addr[11] = 0xff;
        addr[12] = octets[0];
        addr[13] = octets[1];
        addr[14] = octets[2];
        addr[15] = octets[3];
        IpKey { addr }
    }
    /// An IPv6 address.
    pub const fn v6(octets: [u8; 16]) -> Self {
        IpKey { addr: octets }
    }
}

/// What the ipcache knows of one exact address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct IpInfo {
    /// Pod identity, [`crate::IDENTITY_HOST`] for node addresses.
    pub identity: u32,
    /// Identity of the longest ipBlock prefix containing the address, or
    /// [`IDENTITY_ANY`] (0) when none does; saves the LPM lookup for pods.
    pub cidr_identity: u32,
}
const _: () = assert!(size_of::<IpInfo>() == 8);
const _: () = assert!(offset_of!(IpInfo, identity) == 0);
const _: () = assert!(offset_of!(IpInfo, cidr_identity) == 4);

/// The `NPM_IPCACHE4` slot of an IPv4 address (`addr`: its 4 bytes in
/// network order read as a little-endian `u32`, as the datapath loads them).
pub const fn ipcache4_slot(addr: u32) -> u32 {
    addr.wrapping_mul(0x9e37_79b1) >> (32 - sizes::IPCACHE4_BITS)
}

/// The `NPM_IPCACHE4` word of an IPv4 address and its [`IpInfo`]: bits
/// 0..32 the address (as in [`ipcache4_slot`]), 32..56 the pod identity
/// (never 0, so an all-zero word is an empty slot), 56..64 the CIDR
/// identity's [`cidr_code`], 0 for none.
/// `None` when the entry does not fit: identity 0 or `>= 2^24`, or a CIDR
/// identity beyond the first 255 (such addresses live in `NPM_IPCACHE`
/// only).
pub const fn ipcache4_word(addr: u32, info: IpInfo) -> Option<u64> {
    if info.identity == 0 || info.identity >= IDENTITY_FIRST_CIDR {
        return None;
    }
    let Some(cidr) = cidr_code(info.cidr_identity) else {
        return None;
    };
    Some(addr as u64 | (info.identity as u64) << 32 | cidr << 56)
}

/// The address and [`IpInfo`] of a non-zero `NPM_IPCACHE4` word.
pub const fn ipcache4_unpack(word: u64) -> (u32, IpInfo) {
    (
        word as u32,
        IpInfo {
            identity: ((word >> 32) & 0xff_ffff) as u32,
            cidr_identity: cidr_of_code(word >> 56),
        },
    )
}

// The datapath reads a slot as one `u64` and takes it for the address when
// its low 32 bits are the address and its high 32 bits are not 0.
const _: () = assert!(matches!(
    ipcache4_word(0xdead_beef, IpInfo { identity: 1, cidr_identity: IDENTITY_ANY }),
    Some(w) if w as u32 == 0xdead_beef && w >> 32 != 0
));

#[cfg(feature = "user")]
mod pod_impls {
    use super::*;
    // SAFETY: repr(C), only integers and byte arrays, no padding (asserted
    // above), any bit pattern is valid.
    unsafe impl aya::Pod for IpKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for IpInfo {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::IDENTITY_HOST;

    #[test]
    fn ipcache4_words_round_trip_or_refuse() {
        let addr = u32::from_le_bytes([10, 1, 2, 3]);
        for (identity, cidr) in [
            (IDENTITY_HOST, IDENTITY_ANY),
            (256, IDENTITY_ANY),
            ((1 << 24) - 1, IDENTITY_FIRST_CIDR),
            (300, IDENTITY_FIRST_CIDR + 254),
        ] {
            let info = IpInfo {
                identity,
                cidr_identity: cidr,
            };
            let w = ipcache4_word(addr, info).expect("fits");
            assert_ne!(w, 0);
            assert_eq!(ipcache4_unpack(w), (addr, info));
        }
        for (identity, cidr) in [(0, 0), (1 << 24, 0), (300, IDENTITY_FIRST_CIDR + 255), (300, 5)] {
            let info = IpInfo {
                identity,
                cidr_identity: cidr,
            };
            assert_eq!(ipcache4_word(addr, info), None, "{info:?}");
        }
        assert!(ipcache4_slot(u32::MAX) < sizes::IPCACHE4_SLOTS);
        assert_ne!(ipcache4_slot(addr), ipcache4_slot(u32::from_le_bytes([10, 1, 2, 4])));
    }
}

//! Word access to 4-byte aligned scratch and map memory: the datapath moves
//! addresses and keys as 32-bit words (byte-wise copies and the
//! `memset`/`memcpy` calls LLVM would emit are slow byte loops in BPF).

/// Bytes 8..12 of an IPv4-mapped address (`0, 0, 0xff, 0xff`) as a
/// little-endian word.
pub(crate) const V4_MAPPED_WORD: u32 = 0xffff_0000;

// Volatile stores keep LLVM from merging them into memset/memcpy calls
// (loads need not be).

/// Loads the 32-bit word at `p` (4-aligned).
#[inline(always)]
pub(crate) unsafe fn rd32(p: *const u8) -> u32 {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe { core::ptr::read(p as *const u32) }
}

/// Stores the 32-bit word `v` at `p` (4-aligned; volatile).
#[inline(always)]
pub(crate) unsafe fn wr32(p: *mut u8, v: u32) {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe { core::ptr::write_volatile(p as *mut u32, v) }
}

/// Stores the 64-bit word `v` at `p` (8-aligned; volatile).
#[inline(always)]
pub(crate) unsafe fn wr64(p: *mut u8, v: u64) {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe { core::ptr::write_volatile(p as *mut u64, v) }
}

/// Copies the 16 bytes at `s` to `d` as four words.
#[inline(always)]
pub(crate) unsafe fn copy16(d: *mut u8, s: *const u8) {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        wr32(d, rd32(s));
        wr32(d.add(4), rd32(s.add(4)));
        wr32(d.add(8), rd32(s.add(8)));
        wr32(d.add(12), rd32(s.add(12)));
    }
}

/// Zeroes the 16 bytes at `d` as four words.
#[inline(always)]
pub(crate) unsafe fn zero16(d: *mut u8) {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        wr32(d, 0);
        wr32(d.add(4), 0);
        wr32(d.add(8), 0);
        wr32(d.add(12), 0);
    }
}

/// Whether the 16 bytes at `a` and `b` are equal.
#[inline(always)]
pub(crate) unsafe fn eq16(a: *const u8, b: *const u8) -> bool {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        ((rd32(a) ^ rd32(b))
            | (rd32(a.add(4)) ^ rd32(b.add(4)))
            | (rd32(a.add(8)) ^ rd32(b.add(8)))
            | (rd32(a.add(12)) ^ rd32(b.add(12))))
            == 0
    }
}

/// Whether the 16-byte, 4-aligned address at `a` is IPv4-mapped.
#[inline(always)]
pub(crate) unsafe fn is_v4_mapped(a: *const u8) -> bool {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe { (rd32(a) | rd32(a.add(4)) | (rd32(a.add(8)) ^ V4_MAPPED_WORD)) == 0 }
}

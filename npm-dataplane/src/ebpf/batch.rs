//! `BPF_MAP_LOOKUP_BATCH` and `BPF_MAP_DELETE_BATCH` (aya 0.14 has no
//! batch operations): a map read or purged a chunk of entries a syscall
//! instead of one syscall an entry. Used by the conntrack worker (hash
//! maps) and the endpoint records' sweep (an array).

use std::io;
use std::mem::size_of;

/// Entries a batch syscall reads or deletes at most.
const CHUNK: usize = 4096;

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// `union bpf_attr`'s `batch` member.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

fn bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: a valid attribute of the size given; the buffers it
    // points at outlive the call and hold `count` elements.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut BatchAttr, size_of::<BatchAttr>()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `n` all-zero `T`s: the buffers the kernel fills.
fn zeroed<T: Copy>(n: usize) -> Vec<T> {
    // SAFETY: only called with map keys and values, plain-old-data
    // `repr(C)` types for which all-zero bytes are a valid value.
    vec![unsafe { std::mem::zeroed::<T>() }; n]
}

/// Calls `f` with every (keys, values) chunk of the map `fd` (a hash map
/// or an array; an array's keys are its indexes).
/// Entries added or deleted meanwhile may or may not be seen; every
/// other entry is seen once (the kernel walks bucket by bucket).
pub(crate) fn for_each<K: Copy, V: Copy>(fd: i32, mut f: impl FnMut(&[K], &[V])) -> io::Result<()> {
    let mut chunk = CHUNK;
    let mut keys: Vec<K> = zeroed(chunk);
    let mut values: Vec<V> = zeroed(chunk);
    let mut token: u32 = 0;
    let mut first = true;
    loop {
        let mut out: u32 = 0;
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { &token as *const u32 as u64 },
            out_batch: &mut out as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        match bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
            Ok(()) => {
                let n = attr.count as usize;
                f(&keys[..n], &values[..n]);
                token = out;
                first = false;
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                let n = attr.count as usize;
                f(&keys[..n], &values[..n]);
                return Ok(());
            }
            // A bucket larger than the buffer: a larger buffer.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && chunk < 1 << 20 => {
                chunk *= 4;
                keys = zeroed(chunk);
                values = zeroed(chunk);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Deletes `keys` from the hash map `fd`, [`CHUNK`] a syscall; a key
/// already gone (evicted meanwhile) is skipped. Returns how many were
/// deleted.
pub(crate) fn delete<K: Copy>(fd: i32, keys: &[K]) -> io::Result<u64> {
    let mut deleted = 0u64;
    let mut i = 0;
    while i < keys.len() {
        let n = (keys.len() - i).min(CHUNK);
        let mut attr = BatchAttr {
            keys: keys[i..].as_ptr() as u64,
            count: n as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        match bpf(BPF_MAP_DELETE_BATCH, &mut attr) {
            Ok(()) => {
                deleted += n as u64;
                i += n;
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                deleted += attr.count as u64;
                i += attr.count as usize + 1;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(deleted)
}

//! A shared read-write mapping of a `BPF_F_MMAPABLE` array as 64-bit words,
//! which user space stores with single atomic writes while the datapath
//! reads them (`ipcache4.rs`, `policy_front.rs`).

use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use super::errors::EbpfError;

/// `len` 64-bit words of a mapped BPF array, unmapped on drop.
pub(crate) struct SharedWords {
    ptr: NonNull<AtomicU64>,
    len: usize,
}

// SAFETY: the mapping is shared memory owned by this value; every access
// goes through atomics.
unsafe impl Send for SharedWords {}
// SAFETY: as above.
unsafe impl Sync for SharedWords {}

impl SharedWords {
    /// Maps the first `len` words of the array behind `fd` (the map
    /// `name`, for errors).
    pub(crate) fn map(fd: RawFd, len: usize, name: &'static str) -> Result<Self, EbpfError> {
        // SAFETY: a shared read-write mapping of the map's memory; the
        // kernel checks the size and the map's mmapable flag.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len * 8,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(EbpfError::Mmap {
                map: name,
                source: std::io::Error::last_os_error(),
            });
        }
        let ptr = NonNull::new(p as *mut AtomicU64).ok_or_else(|| EbpfError::Mmap {
            map: name,
            source: std::io::Error::other("null mapping"),
        })?;
        Ok(SharedWords { ptr, len })
    }

    /// The words.
    pub(crate) fn words(&self) -> &[AtomicU64] {
        // SAFETY: `len` 8-byte words mapped for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for SharedWords {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what map() mapped.
        unsafe {
            libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len * 8);
        }
    }
}

//! A shared read-write mapping of a `BPF_F_MMAPABLE` array as 64-bit words
//! ([`SharedWords`]), which user space stores with single atomic writes
//! while the datapath reads them (`ipcache4.rs`, `fold.rs`).

use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use super::errors::EbpfError;

/// An atomic integer a mapped array is made of (the datapath reads whole
/// words of this width).
pub(crate) trait SharedWord: Sized {}
impl SharedWord for AtomicU64 {}

/// `len` words of type `A` of a mapped BPF array, unmapped on drop.
pub(crate) struct Shared<A: SharedWord> {
    ptr: NonNull<A>,
    len: usize,
    _words: PhantomData<A>,
}

/// 64-bit words of a mapped array.
pub(crate) type SharedWords = Shared<AtomicU64>;

// SAFETY: the mapping is shared memory owned by this value; every access
// goes through atomics.
unsafe impl<A: SharedWord> Send for Shared<A> {}
// SAFETY: as above.
unsafe impl<A: SharedWord> Sync for Shared<A> {}

impl<A: SharedWord> Shared<A> {
    /// Maps the first `len` words of the array behind `fd` (the map
    /// `name`, for errors).
    pub(crate) fn map(fd: RawFd, len: usize, name: &'static str) -> Result<Self, EbpfError> {
        // SAFETY: a shared read-write mapping of the map's memory; the
        // kernel checks the size and the map's mmapable flag.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len * std::mem::size_of::<A>(),
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
        let ptr = NonNull::new(p as *mut A).ok_or_else(|| EbpfError::Mmap {
            map: name,
            source: std::io::Error::other("null mapping"),
        })?;
        Ok(Shared {
            ptr,
            len,
            _words: PhantomData,
        })
    }

    /// Maps the whole array `data` (the map `name`): `per_entry` words of
    /// each of its entries, as many entries as the kernel says it has (a
    /// pinned map keeps the size it was created with). Returns the mapping
    /// and the number of entries.
    pub(crate) fn map_array(
        data: &aya::maps::MapData,
        per_entry: usize,
        name: &'static str,
    ) -> Result<(Self, u32), EbpfError> {
        use std::os::fd::{AsFd, AsRawFd};
        let entries = data
            .info()
            .map_err(super::errors::map_err(name, "read map info"))?
            .max_entries();
        let fd = data.fd().as_fd().as_raw_fd();
        Ok((Self::map(fd, entries as usize * per_entry, name)?, entries))
    }

    /// The words.
    pub(crate) fn words(&self) -> &[A] {
        // SAFETY: `len` words mapped for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<A: SharedWord> Drop for Shared<A> {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what map() mapped.
        unsafe {
            libc::munmap(
                self.ptr.as_ptr() as *mut libc::c_void,
                self.len * std::mem::size_of::<A>(),
            );
        }
    }
}

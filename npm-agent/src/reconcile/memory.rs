//! Giving freed memory back to the kernel after a full list.
//!
//! A (re)list holds the new objects beside the last complete state until
//! its `InitDone`, and the first sync after it diffs the two; both are
//! freed once that sync is done. glibc's allocator keeps freed memory in
//! its heaps (it returns only the top of a heap by itself), so without
//! this the agent's resident set after a relist stays at the relist's
//! peak: `cargo xtask bench agent` measured 715 MB after a forced relist
//! at 100,000 pods against 529 MB before it. After each sync that follows
//! a completed list, [`release_free`] asks glibc to return the free pages
//! of every heap (`malloc_trim(0)`; a few milliseconds, only after lists).
//!
//! The allocator stays glibc's. Measured at 100,000 pods / 10,000
//! policies (`cargo xtask bench agent`, 2026-12-07, load average 6-10;
//! steady RSS / relist peak): glibc 331 / 370 MB, glibc with
//! `MALLOC_ARENA_MAX=2` 332 / 366 MB (the arenas are not where the memory
//! goes: it is the per-allocation overhead of many small objects),
//! jemalloc 296 / 334 MB and mimalloc 311 / 340 MB (both preloaded, on the
//! tree before the snapshot's pod map was bulk-built). A different
//! allocator would save about 10 % more; the state itself was made
//! smaller instead (interned keys and strings: 299 / 333 MB with glibc).

/// Return the allocator's free pages to the kernel (glibc's
/// `malloc_trim(0)`; nothing on other C libraries).
pub fn release_free() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists and
    // madvises free pages away; it takes no pointer and is thread-safe
    // (each arena is locked while it is trimmed).
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Whether the sync that just ended follows a list completed since the
/// last trim (`lists`: the cache's count of completed lists); updates
/// `trimmed` when it does.
pub fn after_new_lists(trimmed: &mut u64, lists: u64) -> bool {
    if lists == *trimmed {
        return false;
    }
    *trimmed = lists;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_once_per_new_list() {
        let mut trimmed = 0;
        assert!(after_new_lists(&mut trimmed, 5), "the first lists");
        assert!(!after_new_lists(&mut trimmed, 5), "no list since");
        assert!(after_new_lists(&mut trimmed, 6), "a relist completed");
        assert_eq!(trimmed, 6);
        release_free();
    }
}

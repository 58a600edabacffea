//! Memory, measured: the process's heap through a counting global allocator, and a
//! device's own pool statistics.
//!
//! A runner binary installs it with
//! `#[global_allocator] static ALLOC: CountingAllocator = CountingAllocator;`.
//! Without it, [`peak_bytes`] reads 0 and reports say "not measured".

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering};

use mimalloc::MiMalloc;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// mimalloc, counting live bytes and their peak for the whole process.
///
/// mimalloc rather than the system allocator because glibc's malloc hands large tensor
/// buffers back to the OS and page-faults them in again on every training step: that cost
/// 18% of a gpt-mini step on Flex.
pub struct CountingAllocator;

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged to mimalloc.
        let ptr = unsafe { MiMalloc.alloc(layout) };
        if !ptr.is_null() {
            grow(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged to mimalloc.
        let ptr = unsafe { MiMalloc.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grow(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to mimalloc.
        unsafe { MiMalloc.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged to mimalloc.
        let new = unsafe { MiMalloc.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grow(new_size);
        }
        new
    }
}

fn grow(size: usize) {
    let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

/// Bytes allocated and not yet freed, process-wide.
pub fn live_bytes() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// Highest [`live_bytes`] since start or the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak window at the current live size.
pub fn reset_peak() {
    PEAK.store(live_bytes(), Ordering::Relaxed);
}

/// Runs `f` and returns its result with the most bytes live during it above those live when
/// it began. The peak window before it is kept: its own reading does not lower the peak.
pub fn peak_added_by<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let (before, live) = (peak_bytes(), live_bytes());
    reset_peak();
    let result = f();
    let added = peak_bytes().saturating_sub(live);
    PEAK.fetch_max(before, Ordering::Relaxed);
    (result, added)
}

/// Whether a binary installed [`CountingAllocator`].
pub fn is_counting() -> bool {
    peak_bytes() > 0
}

/// The most bytes `device`'s memory pools have reserved so far (the sum of each pool's peak
/// pages, cubecl's own statistics: what PyTorch calls `max_memory_reserved`); on a CPU, whose
/// device memory is the host's, the process peak of [`peak_bytes`].
pub fn device_peak_bytes(device: &burn::prelude::Device) -> usize {
    match device.memory_pool_report() {
        Some(pools) => pools
            .iter()
            .map(|pool| (pool.pages_peak * pool.page_size) as usize)
            .sum(),
        None => peak_bytes(),
    }
}

/// `1.23 GiB`-style formatting.
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn formats_bytes() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
    }
}

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

/// [`peak_bytes`], or `None` in a program without [`CountingAllocator`] (nothing counted).
pub fn measured_peak() -> Option<usize> {
    is_counting().then(peak_bytes)
}

/// The most bytes a device held reserved when it was read ([`DevicePeak::read`]): every pool
/// of every stream, cubecl's `bytes_reserved`, what PyTorch calls memory reserved. cubecl's
/// pools mostly keep their pages until an explicit cleanup, so read at each step's end this is
/// about the steps' peak; what a step gives back before it ends (the dedicated buffers of very
/// large allocations, drained pages of an outgrown arena) it can miss. Ranks that share one
/// device (threads on `cubecl-cpu`) each read the whole device's.
pub struct DevicePeak {
    device: burn::prelude::Device,
    reserved: Option<usize>,
}

impl DevicePeak {
    pub fn new(device: &burn::prelude::Device) -> Self {
        let mut peak = Self {
            device: device.clone(),
            reserved: None,
        };
        peak.read();
        peak
    }

    /// Takes the device's reservation now into the peak.
    pub fn read(&mut self) {
        if let Some(usage) = self.device.memory_pool_usage() {
            let now = usage.bytes_reserved as usize;
            self.reserved = Some(self.reserved.map_or(now, |peak| peak.max(now)));
        }
    }

    /// The peak read, `None` on a device without pools (the CPU, whose device memory is the
    /// host's).
    pub fn bytes(&self) -> Option<usize> {
        self.reserved
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

/// A size as `--memory-budget` takes it: bytes, or a number with a unit: KiB, MiB, GiB,
/// TiB (and K, M, G, T, as `free -g` counts: powers of 1024), or KB, MB, GB, TB (powers of
/// 1000); `1.5GiB`, `800 MB`, `16G`.
pub fn parse_bytes(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = (&text[..split], text[split..].trim());
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB or KB, MB, GB, TB)"
            ));
        }
    };
    // At least a byte: "0.4" is not a budget.
    match number.parse::<f64>() {
        Ok(value) if scale == 1.0 && value.fract() != 0.0 => Err(format!(
            "{text:?}: a number of bytes is whole (with a unit a fraction is fine: 1.5GiB)"
        )),
        Ok(value) if value * scale >= usize::MAX as f64 => Err(format!(
            "{text:?}: more bytes than this machine can address"
        )),
        Ok(value) if value * scale >= 1.0 && (value * scale).is_finite() => {
            Ok((value * scale) as usize)
        }
        _ => Err(format!(
            "{text:?}: expected a positive size such as 1.5GiB, 800MB or 16G"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::{human_bytes, parse_bytes};

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("16G"), Ok(16 << 30));
        assert_eq!(parse_bytes("800 MB"), Ok(800_000_000));
        assert_eq!(parse_bytes("512mib"), Ok(512 << 20));
        for bad in [
            "",
            "0",
            "0.4",
            "1.5",
            "-1G",
            "12 parsecs",
            "G",
            "1.2.3G",
            "99999999999999999999GiB",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn formats_bytes() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
    }
}

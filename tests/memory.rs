//! The counting allocator measures what the process really holds.

use burn::prelude::*;
use burnscale::train::memory::{self, CountingAllocator};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[test]
fn peak_sees_a_tensor_and_reset_forgets_it() {
    let device = Device::default();
    memory::reset_peak();
    let before = memory::live_bytes();
    let t = Tensor::<2>::ones([1024, 1024], &device) * 2.0; // 4 MiB
    let sum = t.clone().sum().into_scalar::<f32>();
    assert_eq!(sum, 2.0 * 1024.0 * 1024.0);
    let peak = memory::peak_bytes();
    assert!(
        peak >= before + (4 << 20),
        "peak {peak} live-before {before}"
    );
    drop(t);
    memory::reset_peak();
    assert!(memory::peak_bytes() < peak);
    assert!(memory::is_counting());
}

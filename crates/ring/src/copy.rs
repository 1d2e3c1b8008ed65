//! Copy helpers: ordinary copies and non-temporal (cache-bypassing) stores, selectable at run time.
//!
//! Layer: rings. The vhost-user cache-efficiency study, factor (b): a producer that copies packets
//! into buffers it will not read again pollutes its own cache and pays a read-for-ownership of
//! each destination line; x86-64 non-temporal stores (`movntdq`, `_mm_stream_si128`) write around
//! the cache. They are weakly ordered, so a `sfence` must follow before the data is published:
//! every safe function here that issues them ends with one ([`copy_into`], [`NtBatch`] on
//! finish/drop), and [`copy_bytes`]'s contract says so. On other architectures
//! [`CopyMode::NonTemporal`] falls back to an ordinary copy.

/// How to copy bytes into a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyMode {
    /// `memcpy`: goes through the cache.
    #[default]
    Ordinary,
    /// Non-temporal stores for the 16-byte aligned middle (x86-64 SSE2), ordinary at the edges.
    NonTemporal,
}

impl CopyMode {
    /// Bytes each store instruction of a copy writes, as this build compiles it: ordinary copies
    /// of a known size are inlined with the widest vector registers the build targets (16 B on
    /// the x86-64 baseline, whatever the CPU it runs on has), non-temporal copies use 16 B
    /// `movntdq`.
    pub fn store_bytes(self) -> usize {
        match self {
            CopyMode::NonTemporal if cfg!(target_arch = "x86_64") => 16,
            _ if cfg!(target_feature = "avx512f") => 64,
            _ if cfg!(target_feature = "avx") => 32,
            _ if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) => 16,
            _ => 8,
        }
    }
}

/// Copies `src` to the start of `dst` (which must be at least as long) and, for non-temporal
/// copies, fences so the data is ordered before any later store.
///
/// # Panics
/// If `dst` is shorter than `src` (a local bug, never peer input).
pub fn copy_into(mode: CopyMode, dst: &mut [u8], src: &[u8]) {
    assert!(dst.len() >= src.len(), "copy_into: destination shorter than source");
    // SAFETY: both ranges are valid for `src.len()` bytes and cannot overlap (`&mut` vs `&`).
    unsafe { copy_bytes(mode, dst.as_mut_ptr(), src.as_ptr(), src.len()) };
    store_fence(mode);
}

/// Orders earlier non-temporal stores before later stores (`sfence`); nothing for ordinary copies.
#[inline(always)]
pub fn store_fence(mode: CopyMode) {
    #[cfg(target_arch = "x86_64")]
    if mode == CopyMode::NonTemporal {
        // SAFETY: sfence is part of SSE, baseline on x86-64.
        unsafe { core::arch::x86_64::_mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = mode;
}

/// Copies `len` bytes; in non-temporal mode the caller must call [`store_fence`] before publishing
/// the data or touching it again (or use [`copy_into`] / [`NtBatch`], which do).
///
/// # Safety
/// `src` is valid for reading and `dst` for writing `len` bytes, the ranges do not overlap, and in
/// `NonTemporal` mode this thread issues [`store_fence`] before any other access to `dst` or any
/// store that publishes it (the Rust rules for `_mm_stream_*`).
#[inline(always)]
pub unsafe fn copy_bytes(mode: CopyMode, dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if mode == CopyMode::NonTemporal {
        // SAFETY: forwarded contract.
        unsafe { copy_nt(dst, src, len) };
        return;
    }
    let _ = mode;
    // SAFETY: forwarded contract.
    unsafe { core::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn copy_nt(dst: *mut u8, src: *const u8, len: usize) {
    use core::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = dst.align_offset(16).min(len);
    // SAFETY: (the whole block) all offsets stay below `len`, inside both ranges; the middle loop writes
    // 16-byte aligned addresses (`dst + head` is aligned) as _mm_stream_si128 requires; SSE2 is
    // baseline on x86-64; the caller fences before publishing.
    unsafe {
        core::ptr::copy_nonoverlapping(src, dst, head);
        let mut off = head;
        while off + 16 <= len {
            let v = _mm_loadu_si128(src.add(off).cast::<__m128i>());
            _mm_stream_si128(dst.add(off).cast::<__m128i>(), v);
            off += 16;
        }
        core::ptr::copy_nonoverlapping(src.add(off), dst.add(off), len - off);
    }
}

/// A batch of copies with one fence at the end: `NtBatch::run(mode, |b| { b.copy(..); .. })`.
/// The fence is issued when the closure returns (or unwinds), and each destination stays borrowed
/// for the whole batch (lifetime `'a`), so safe code can neither skip the fence nor touch a
/// destination before it.
#[derive(Debug)]
pub struct NtBatch<'a> {
    mode: CopyMode,
    _dst: core::marker::PhantomData<&'a mut [u8]>,
}

impl<'a> NtBatch<'a> {
    /// Runs `f` with a batch, then fences.
    pub fn run<R>(mode: CopyMode, f: impl FnOnce(&mut NtBatch<'a>) -> R) -> R {
        struct Fence(CopyMode);
        impl Drop for Fence {
            fn drop(&mut self) {
                store_fence(self.0);
            }
        }
        let _fence = Fence(mode);
        f(&mut NtBatch { mode, _dst: core::marker::PhantomData })
    }

    /// Copies `src` to the start of `dst` (fenced when the batch ends).
    ///
    /// # Panics
    /// If `dst` is shorter than `src`.
    pub fn copy(&mut self, dst: &'a mut [u8], src: &[u8]) {
        assert!(dst.len() >= src.len(), "NtBatch::copy: destination shorter than source");
        // SAFETY: valid, non-overlapping ranges (`&mut` vs `&`); `dst` is borrowed for `'a`, which
        // outlives the `run` call, so nothing touches it before the fence `run` issues on return.
        unsafe { copy_bytes(self.mode, dst.as_mut_ptr(), src.as_ptr(), src.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_modes_copy_every_length_and_alignment() {
        let src: Vec<u8> = (0..200u8).collect();
        for mode in [CopyMode::Ordinary, CopyMode::NonTemporal] {
            for dst_off in 0..16 {
                for len in [0, 1, 15, 16, 17, 63, 64, 65, 150] {
                    let mut dst = [0xAAu8; 200];
                    copy_into(mode, &mut dst[dst_off..], &src[3..3 + len]);
                    assert_eq!(&dst[dst_off..dst_off + len], &src[3..3 + len]);
                    assert!(dst[..dst_off].iter().all(|&b| b == 0xAA));
                    assert!(dst[dst_off + len..].iter().all(|&b| b == 0xAA));
                }
            }
            let mut dst = [0u8; 64];
            let (lo, hi) = dst.split_at_mut(32);
            NtBatch::run(mode, |b| {
                b.copy(lo, &src[..32]);
                b.copy(hi, &src[32..64]);
            });
            assert_eq!(&dst[..], &src[..64]);
        }
    }
}

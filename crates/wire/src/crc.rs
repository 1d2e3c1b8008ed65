//! CRC-32C (Castagnoli polynomial 0x1EDC6F41, reflected, initial value and final XOR 0xFFFFFFFF)
//! of frames, with one 4-byte field read as zeros (the field that will hold the sum).
//!
//! Runs long enough are folded here with carry-less multiplies where the CPU has them: 512-bit
//! ones (AVX-512 VPCLMULQDQ) from [`FOLD_MIN_LEN`] bytes on (frames of 70 bytes and more: the sum
//! starts at the source MAC), 256-bit ones (AVX2 VPCLMULQDQ) from [`FOLD_256_MIN_LEN`] bytes on.
//! Shorter runs and other CPUs go to the `crc_fast` crate. The reason is latency, not
//! throughput: a frame is summed right before it is sent and right
//! after it arrives, so the time of one sum is on every round trip. `crc_fast` folds 384-byte
//! blocks and finishes what is left one 8-byte `crc32` instruction at a time, three cycles each,
//! one after another; the 1068 summed bytes of a 1 KiB message's frame leave 300 over. Here four
//! accumulators (of 64 bytes, or of 32) take 256 or 128 bytes per step, one accumulator then
//! takes 64- or 32-byte steps and a 128-bit one 16-byte steps, and only the last 0-15 bytes go
//! through `crc32`, so the chain of dependent instructions stays short. With 512-bit registers,
//! runs of 64 to 255 bytes (a 64 B message's frame, small NVMe commands) start with the one
//! 64-byte accumulator, which beats `crc_fast` for them too; with 256-bit ones `crc_fast` is as
//! fast up to about 250 bytes (`docs/wire.md` has the timings). This is the one place outside the
//! rings, ports and DMA memory with `unsafe` code: SIMD intrinsics, in the `fold` module, behind a
//! run-time check of the CPU's features.
//!
//! How folding works (the method of Intel's "Fast CRC Computation for Generic Polynomials Using
//! PCLMULQDQ"): read the message as a polynomial over GF(2), first bit highest. The CRC is that
//! polynomial times x^32 modulo P, so any block B followed by d more bits can be replaced by
//! B * x^d mod P placed at the start of those bits without changing it. A 128-bit lane holds
//! B = H * x^64 + L (H: its first 8 bytes); H * x^(d+64) is H times the constant x^(d+63) mod P
//! times x, and a carry-less multiply of bit-reflected operands produces exactly that extra
//! factor x (its 127-bit product is read one position off). So folding a lane d bits ahead is
//! two 64x64 multiplies by two constants and an XOR into the lane d bits later. What is left at
//! the end, one 128-bit lane and fewer than 16 bytes, goes through the `crc32` instruction, which
//! computes the same CRC.

use crc_fast::CrcAlgorithm;

/// The shortest run folded here with 512-bit registers: one 64-byte accumulator (from 256 bytes
/// on, four).
pub(crate) const FOLD_MIN_LEN: usize = 64;

/// The shortest run folded here with 256-bit registers: shorter ones are as fast through
/// `crc_fast`.
pub(crate) const FOLD_256_MIN_LEN: usize = 256;

/// CRC-32C of `data` with the four bytes at `field` (`field + 4 <= 64`) read as zeros.
pub(crate) fn crc32c_zero_field(data: &[u8], field: usize) -> u32 {
    assert!(
        field + 4 <= 64 && field + 4 <= data.len(),
        "the field at {field} must lie in the first 64 bytes of the {} summed",
        data.len()
    );
    // The bytes of the first 64 to keep: all but the field.
    #[cfg(target_arch = "x86_64")]
    if let Some(crc) = fold::crc32c_if_available(data, !(0xF_u64 << field), INITIAL) {
        return crc;
    }
    portable_zero_field(data, field)
}

/// [`crc32c_zero_field`] through `crc_fast`.
fn portable_zero_field(data: &[u8], field: usize) -> u32 {
    // The bytes before the field and four zeros go through a copy on the stack, so that `data`
    // is still read once.
    let mut head = [0u8; 64];
    head[..field].copy_from_slice(&data[..field]);
    let mut digest = crc_fast::Digest::new(CrcAlgorithm::Crc32Iscsi);
    digest.update(&head[..field + 4]);
    digest.update(&data[field + 4..]);
    digest.finalize() as u32
}

/// CRC-32C of `data`.
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(crc) = fold::crc32c_if_available(data, u64::MAX, INITIAL) {
        return crc;
    }
    crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, data) as u32
}

/// The CRC register's value before the first byte.
const INITIAL: u32 = 0xFFFF_FFFF;

/// CRC-32C of `a` followed by `b`, read where each lies: the register `a` leaves is where the
/// folding of `b` starts (a sender's headers, then a body it lends).
pub(crate) fn crc32c_two(a: &[u8], b: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(crc) = fold::crc32c_if_available(b, u64::MAX, !crc32c(a)) {
        return crc;
    }
    let mut digest = crc_fast::Digest::new(CrcAlgorithm::Crc32Iscsi);
    digest.update(a);
    digest.update(b);
    digest.finalize() as u32
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod fold {
    use core::arch::x86_64::*;
    use std::sync::OnceLock;

    /// The widest folding this CPU can run.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Width {
        /// 512-bit registers: AVX-512 (F, BW, VL) with VPCLMULQDQ.
        Zmm,
        /// 256-bit registers: AVX2 with VPCLMULQDQ.
        Ymm,
    }

    /// The widest folding this CPU has what it needs for (looked up once), if any.
    pub(super) fn width() -> Option<Width> {
        static WIDTH: OnceLock<Option<Width>> = OnceLock::new();
        *WIDTH.get_or_init(|| {
            let base = is_x86_feature_detected!("vpclmulqdq")
                && is_x86_feature_detected!("pclmulqdq")
                && is_x86_feature_detected!("sse4.2");
            if base
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                Some(Width::Zmm)
            } else if base && is_x86_feature_detected!("avx2") {
                Some(Width::Ymm)
            } else {
                None
            }
        })
    }

    /// [`crc32c`] where the CPU has what it needs and `data` is long enough, else `None`.
    /// `init` is the register's value before `data` (`super::INITIAL` to start a sum).
    pub(super) fn crc32c_if_available(data: &[u8], keep: u64, init: u32) -> Option<u32> {
        folded(width()?, data, keep, init)
    }

    /// The CRC folded with registers of `with`, if `data` is long enough for it; `with` must
    /// be this CPU's [`width`] or narrower.
    fn folded(with: Width, data: &[u8], keep: u64, init: u32) -> Option<u32> {
        match with {
            // SAFETY: `width` found every CPU feature each function is compiled for.
            Width::Zmm => (data.len() >= super::FOLD_MIN_LEN).then(|| unsafe { crc32c(data, keep, init) }),
            Width::Ymm => {
                // SAFETY: as above: `width` found the features `crc32c_256` is compiled for.
                (data.len() >= super::FOLD_256_MIN_LEN).then(|| unsafe { crc32c_256(data, keep, init) })
            }
        }
    }

    /// [`folded`] for the tests, which try every width this CPU can run.
    #[cfg(test)]
    pub(super) fn crc32c_with(with: Width, data: &[u8], keep: u64, init: u32) -> Option<u32> {
        let cpu = width();
        assert!(cpu == Some(Width::Zmm) || cpu == Some(with), "this CPU cannot fold with {with:?}");
        folded(with, data, keep, init)
    }

    /// P(x) in normal bit order (bit i: the coefficient of x^i), with its x^32 term.
    const P: u64 = 0x1_1EDC_6F41;

    /// x^n mod P, normal bit order.
    const fn x_pow_mod_p(n: u32) -> u32 {
        let mut r: u64 = 1;
        let mut i = 0;
        while i < n {
            r <<= 1;
            if r & (1 << 32) != 0 {
                r ^= P;
            }
            i += 1;
        }
        r as u32
    }

    /// `k` (degree < 32) as a reflected 64-bit operand: bit j holds the coefficient of x^(63-j).
    const fn reflected(k: u32) -> u64 {
        (k.reverse_bits() as u64) << 32
    }

    /// The constants folding a 128-bit lane `d` bits ahead: for its first 8 bytes, for its last 8.
    const fn fold_keys(d: u32) -> (u64, u64) {
        (reflected(x_pow_mod_p(d + 63)), reflected(x_pow_mod_p(d - 1)))
    }

    const BY_2048: (u64, u64) = fold_keys(2048);
    const BY_1536: (u64, u64) = fold_keys(1536);
    const BY_1024: (u64, u64) = fold_keys(1024);
    const BY_768: (u64, u64) = fold_keys(768);
    const BY_512: (u64, u64) = fold_keys(512);
    const BY_384: (u64, u64) = fold_keys(384);
    const BY_256: (u64, u64) = fold_keys(256);
    const BY_128: (u64, u64) = fold_keys(128);

    /// The same keys in the four lanes of a 512-bit register.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,vpclmulqdq,pclmulqdq,sse4.2")]
    fn keys4(k: (u64, u64)) -> __m512i {
        let (a, b) = (k.0 as i64, k.1 as i64);
        _mm512_set_epi64(b, a, b, a, b, a, b, a)
    }

    /// Every lane of `acc` folded ahead by the keys' distance, XORed into `next`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,vpclmulqdq,pclmulqdq,sse4.2")]
    fn fold512(acc: __m512i, keys: __m512i, next: __m512i) -> __m512i {
        let first = _mm512_clmulepi64_epi128::<0x00>(acc, keys);
        let last = _mm512_clmulepi64_epi128::<0x11>(acc, keys);
        _mm512_ternarylogic_epi64::<0x96>(first, last, next)
    }

    /// `acc` folded 16 bytes ahead (or as far as `k` says), XORed into `next`.
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse4.2")]
    fn fold128(acc: __m128i, k: (u64, u64), next: __m128i) -> __m128i {
        let keys = _mm_set_epi64x(k.1 as i64, k.0 as i64);
        let first = _mm_clmulepi64_si128::<0x00>(acc, keys);
        let last = _mm_clmulepi64_si128::<0x11>(acc, keys);
        _mm_xor_si128(_mm_xor_si128(first, last), next)
    }

    /// 64 bytes from `data` at `at` (`at + 64 <= data.len()`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,vpclmulqdq,pclmulqdq,sse4.2")]
    fn load64(data: &[u8], at: usize) -> __m512i {
        let bytes: &[u8; 64] = data[at..at + 64].try_into().expect("64 bytes");
        // SAFETY: reads 64 bytes from a reference to 64 bytes; no alignment needed.
        unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
    }

    /// CRC-32C of `data` (at least 64 bytes), with the bytes of the first 64 whose bits in
    /// `keep` are clear read as zeros, the register starting at `init`.
    ///
    /// # Safety
    /// The CPU must have the features [`width`] checks for [`Width::Zmm`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn crc32c(data: &[u8], keep: u64, init: u32) -> u32 {
        assert!(data.len() >= super::FOLD_MIN_LEN);
        let len = data.len();
        let first: &[u8; 64] = data[..64].try_into().expect("64 bytes");
        // SAFETY: reads the 64 bytes `first` refers to (masked-off bytes are not read at all).
        let first = unsafe { _mm512_maskz_loadu_epi8(keep, first.as_ptr().cast()) };
        // The register's initial value goes into the first four bytes.
        let first = _mm512_xor_si512(first, _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, i64::from(init)));
        let (mut acc, mut at) = if len >= 256 {
            let mut a0 = first;
            let mut a1 = load64(data, 64);
            let mut a2 = load64(data, 128);
            let mut a3 = load64(data, 192);
            let mut at = 256;
            let k = keys4(BY_2048);
            while at + 256 <= len {
                a0 = fold512(a0, k, load64(data, at));
                a1 = fold512(a1, k, load64(data, at + 64));
                a2 = fold512(a2, k, load64(data, at + 128));
                a3 = fold512(a3, k, load64(data, at + 192));
                at += 256;
            }
            // Four accumulators into one, side by side: a0 192 bytes ahead, a1 128, a2 64, onto a3.
            let zero = _mm512_setzero_si512();
            let x = fold512(a0, keys4(BY_1536), a3);
            let y = fold512(a1, keys4(BY_1024), zero);
            let z = fold512(a2, keys4(BY_512), zero);
            (_mm512_ternarylogic_epi64::<0x96>(x, y, z), at)
        } else {
            // Too short for four: the first 64 bytes are the one accumulator.
            (first, 64)
        };
        let k = keys4(BY_512);
        while at + 64 <= len {
            acc = fold512(acc, k, load64(data, at));
            at += 64;
        }
        // Four lanes into one: lane 0 48 bytes ahead, lane 1 32, lane 2 16, onto lane 3.
        let keys = _mm512_set_epi64(
            0,
            0,
            BY_128.1 as i64,
            BY_128.0 as i64,
            BY_256.1 as i64,
            BY_256.0 as i64,
            BY_384.1 as i64,
            BY_384.0 as i64,
        );
        let f = _mm512_xor_si512(
            _mm512_clmulepi64_epi128::<0x00>(acc, keys),
            _mm512_clmulepi64_epi128::<0x11>(acc, keys),
        );
        let f01 = _mm_xor_si128(_mm512_extracti32x4_epi32::<0>(f), _mm512_extracti32x4_epi32::<1>(f));
        let f23 = _mm_xor_si128(_mm512_extracti32x4_epi32::<2>(f), _mm512_extracti32x4_epi32::<3>(acc));
        let lane = _mm_xor_si128(f01, f23);
        finish(data, at, lane)
    }

    /// The CRC from `lane`, the data folded so far, and the bytes of `data` from `at` on.
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse4.2")]
    fn finish(data: &[u8], mut at: usize, mut lane: __m128i) -> u32 {
        while at + 16 <= data.len() {
            let bytes: &[u8; 16] = data[at..at + 16].try_into().expect("16 bytes");
            // SAFETY: reads the 16 bytes `bytes` refers to; no alignment needed.
            let next = unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) };
            lane = fold128(lane, BY_128, next);
            at += 16;
        }
        // The lane and the last bytes through the crc32 instruction (register, no inversions).
        let mut c = _mm_crc32_u64(0, _mm_cvtsi128_si64(lane) as u64);
        c = _mm_crc32_u64(c, _mm_extract_epi64::<1>(lane) as u64);
        let mut c = c as u32;
        let mut rest = &data[at..];
        if let Some((word, tail)) = rest.split_first_chunk::<8>() {
            c = _mm_crc32_u64(u64::from(c), u64::from_le_bytes(*word)) as u32;
            rest = tail;
        }
        if let Some((word, tail)) = rest.split_first_chunk::<4>() {
            c = _mm_crc32_u32(c, u32::from_le_bytes(*word));
            rest = tail;
        }
        for &b in rest {
            c = _mm_crc32_u8(c, b);
        }
        !c
    }

    /// The same keys in the two lanes of a 256-bit register.
    #[inline]
    #[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
    fn keys2(k: (u64, u64)) -> __m256i {
        let (a, b) = (k.0 as i64, k.1 as i64);
        _mm256_set_epi64x(b, a, b, a)
    }

    /// Both lanes of `acc` folded ahead by the keys' distance, XORed into `next`.
    #[inline]
    #[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
    fn fold256(acc: __m256i, keys: __m256i, next: __m256i) -> __m256i {
        let first = _mm256_clmulepi64_epi128::<0x00>(acc, keys);
        let last = _mm256_clmulepi64_epi128::<0x11>(acc, keys);
        _mm256_xor_si256(_mm256_xor_si256(first, last), next)
    }

    /// 32 bytes from `data` at `at` (`at + 32 <= data.len()`).
    #[inline]
    #[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
    fn load32(data: &[u8], at: usize) -> __m256i {
        let bytes: &[u8; 32] = data[at..at + 32].try_into().expect("32 bytes");
        // SAFETY: reads 32 bytes from a reference to 32 bytes; no alignment needed.
        unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
    }

    /// [`crc32c`] with 256-bit registers, for `data` of at least [`super::FOLD_256_MIN_LEN`] bytes.
    ///
    /// # Safety
    /// The CPU must have AVX2, VPCLMULQDQ, PCLMULQDQ and SSE4.2.
    #[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn crc32c_256(data: &[u8], keep: u64, init: u32) -> u32 {
        assert!(data.len() >= super::FOLD_256_MIN_LEN);
        let len = data.len();
        // The first 64 bytes with the masked-off ones zeroed (AVX2 has no masked byte load) and
        // the register's initial value in the first four.
        let mut head: [u8; 64] = data[..64].try_into().expect("64 bytes");
        let mut clear = !keep;
        while clear != 0 {
            head[clear.trailing_zeros() as usize] = 0;
            clear &= clear - 1;
        }
        for (b, i) in head[..4].iter_mut().zip(init.to_le_bytes()) {
            *b ^= i;
        }
        let mut a0 = load32(&head, 0);
        let mut a1 = load32(&head, 32);
        let mut a2 = load32(data, 64);
        let mut a3 = load32(data, 96);
        let mut at = 128;
        let k = keys2(BY_1024);
        while at + 128 <= len {
            a0 = fold256(a0, k, load32(data, at));
            a1 = fold256(a1, k, load32(data, at + 32));
            a2 = fold256(a2, k, load32(data, at + 64));
            a3 = fold256(a3, k, load32(data, at + 96));
            at += 128;
        }
        // Four accumulators into one, side by side: a0 96 bytes ahead, a1 64, a2 32, onto a3.
        let zero = _mm256_setzero_si256();
        let x = fold256(a0, keys2(BY_768), a3);
        let y = fold256(a1, keys2(BY_512), zero);
        let x = fold256(a2, keys2(BY_256), x);
        let mut acc = _mm256_xor_si256(x, y);
        let k = keys2(BY_256);
        while at + 32 <= len {
            acc = fold256(acc, k, load32(data, at));
            at += 32;
        }
        // Two lanes into one: the first 16 bytes ahead onto the second.
        let lane = fold128(_mm256_castsi256_si128(acc), BY_128, _mm256_extracti128_si256::<1>(acc));
        finish(data, at, lane)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The reflected CRC-32C one bit at a time, with the field at `field` (if any) zeroed.
    fn bitwise(bytes: &[u8], field: Option<usize>) -> u32 {
        let mut crc = !0u32;
        for (i, &b) in bytes.iter().enumerate() {
            let b = if field.is_some_and(|f| (f..f + 4).contains(&i)) { 0 } else { b };
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
            }
        }
        !crc
    }

    /// Every folding this CPU can run (512-bit ones can also run 256-bit).
    #[cfg(target_arch = "x86_64")]
    fn fold_widths() -> Vec<fold::Width> {
        let widths = match fold::width() {
            Some(fold::Width::Zmm) => vec![fold::Width::Zmm, fold::Width::Ymm],
            Some(fold::Width::Ymm) => vec![fold::Width::Ymm],
            None => vec![],
        };
        if widths.is_empty() {
            eprintln!("folding skipped: this CPU lacks VPCLMULQDQ with AVX2 or AVX-512");
        }
        widths
    }

    /// The CRC of `d` (with the field at `field` zeroed) through every folding this CPU can run
    /// that takes runs as long, each checked against `expect`.
    fn check_every_width(d: &[u8], field: Option<usize>, expect: u32) {
        #[cfg(target_arch = "x86_64")]
        for width in fold_widths() {
            let keep = field.map_or(u64::MAX, |f| !(0xF_u64 << f));
            if let Some(crc) = fold::crc32c_with(width, d, keep, INITIAL) {
                assert_eq!(crc, expect, "folded with {width:?}, {} bytes, field {field:?}", d.len());
            }
        }
    }

    /// `len` bytes that look random: the top byte of a Fibonacci hash of each index.
    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        (0..len as u64).map(|i| ((i ^ seed << 20).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8).collect()
    }

    #[test]
    fn a_sum_run_from_one_piece_into_another_is_the_sum_of_both() {
        let d = bytes(70_000, 5);
        for (split, end) in [(0, 10), (30, 94), (30, 300), (44, 9044), (1, 65_000), (500, 70_000), (64, 64)] {
            let (a, b) = d[..end].split_at(split);
            assert_eq!(crc32c_two(a, b), crc32c(&d[..end]), "{split} + {}", end - split);
            #[cfg(target_arch = "x86_64")]
            for width in fold_widths() {
                if let Some(crc) = fold::crc32c_with(width, b, u64::MAX, !crc32c(a)) {
                    assert_eq!(crc, crc32c(&d[..end]), "folded with {width:?}, {split} + {}", end - split);
                }
            }
        }
    }

    #[test]
    fn every_length_and_alignment_agrees_with_a_bitwise_crc() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        // Around every step of the folding: one accumulator (64) or four (256), their 64-byte
        // and 16-byte steps, the 8-, 4- and 1-byte tails; shorter runs (crc_fast); and frame
        // sizes up to a jumbo frame.
        let lens = (0..=1100).chain([1514, 2047, 2048, 2049, 4096 + 13, 9014]);
        for len in lens {
            let data = bytes(len + 64, len as u64);
            for shift in [0, 1, 7, 33] {
                let d = &data[shift..shift + len];
                let expect = bitwise(d, None);
                assert_eq!(crc32c(d), expect, "len {len}, shift {shift}");
                check_every_width(d, None, expect);
                let field = 34;
                if len >= field + 4 {
                    let expect = bitwise(d, Some(field));
                    assert_eq!(crc32c_zero_field(d, field), expect, "len {len}, shift {shift}");
                    check_every_width(d, Some(field), expect);
                }
            }
        }
    }

    #[test]
    fn both_paths_agree_with_a_bitwise_crc_on_their_own() {
        for len in
            [64, 65, 78, 79, 80, 127, 128, 200, 255, 256, 257, 300, 319, 320, 511, 512, 1068, 4099, 70_000]
        {
            let d = bytes(len, 3 * len as u64);
            assert_eq!(portable_zero_field(&d, 34), bitwise(&d, Some(34)), "portable, len {len}");
            check_every_width(&d, Some(34), bitwise(&d, Some(34)));
        }
    }

    #[test]
    fn the_field_can_sit_anywhere_in_the_first_64_bytes() {
        for len in [60, 64, 78, 255, 256, 300, 1068] {
            let d = bytes(len, 7);
            for field in 0..=(60.min(len - 4)) {
                let expect = bitwise(&d, Some(field));
                assert_eq!(crc32c_zero_field(&d, field), expect, "len {len} field {field}");
                check_every_width(&d, Some(field), expect);
            }
        }
    }

    proptest! {
        #[test]
        fn folding_agrees_with_crc_fast(data in proptest::collection::vec(any::<u8>(), 0..3000), field in 0usize..=60) {
            let expect = crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, &data) as u32;
            prop_assert_eq!(crc32c(&data), expect);
            check_every_width(&data, None, expect);
            if data.len() >= field + 4 {
                let mut zeroed = data.clone();
                zeroed[field..field + 4].fill(0);
                let expect = crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, &zeroed) as u32;
                prop_assert_eq!(crc32c_zero_field(&data, field), expect);
                check_every_width(&data, Some(field), expect);
            }
        }
    }
}

//! CRC-32C (Castagnoli polynomial 0x1EDC6F41, reflected, initial value and final XOR 0xFFFFFFFF)
//! of frames, with one 4-byte field read as zeros (the field that will hold the sum).
//!
//! Runs of [`FOLD_MIN_LEN`] bytes and more (frames of 70 bytes and more: the sum starts at the
//! source MAC) are folded here with 512-bit carry-less multiplies (VPCLMULQDQ) where the CPU has
//! them; shorter runs and other CPUs go to the `crc_fast` crate. The reason is latency, not
//! throughput: a frame is summed right before it is sent and right
//! after it arrives, so the time of one sum is on every round trip. `crc_fast` folds 384-byte
//! blocks and finishes what is left one 8-byte `crc32` instruction at a time, three cycles each,
//! one after another; the 1068 summed bytes of a 1 KiB message's frame leave 300 over. Here four
//! 64-byte accumulators take 256 bytes per step, one accumulator then takes 64-byte steps and
//! a 128-bit one 16-byte steps, and only the last 0-15 bytes go through `crc32`, so the chain of
//! dependent instructions stays short. Runs of 64 to 255 bytes (a 64 B message's frame, small
//! NVMe commands) start with the one 64-byte accumulator, which beats `crc_fast` for them too
//! (`docs/wire.md` has the timings). This is the one place outside the rings, ports and DMA
//! memory with `unsafe` code: SIMD intrinsics, in the `fold` module, behind a run-time check of
//! the CPU's features.
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

/// The shortest run folded here: one 64-byte accumulator (from 256 bytes on, four).
pub(crate) const FOLD_MIN_LEN: usize = 64;

/// CRC-32C of `data` with the four bytes at `field` (`field + 4 <= 64`) read as zeros.
pub(crate) fn crc32c_zero_field(data: &[u8], field: usize) -> u32 {
    assert!(
        field + 4 <= 64 && field + 4 <= data.len(),
        "the field at {field} must lie in the first 64 bytes of the {} summed",
        data.len()
    );
    // The bytes of the first 64 to keep: all but the field.
    #[cfg(target_arch = "x86_64")]
    if let Some(crc) = fold::crc32c_if_available(data, !(0xF_u64 << field)) {
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
    if let Some(crc) = fold::crc32c_if_available(data, u64::MAX) {
        return crc;
    }
    crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, data) as u32
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod fold {
    use core::arch::x86_64::*;
    use std::sync::OnceLock;

    /// Whether this CPU has what [`crc32c`] is compiled for (looked up once).
    pub(super) fn available() -> bool {
        static HAVE: OnceLock<bool> = OnceLock::new();
        *HAVE.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("vpclmulqdq")
                && is_x86_feature_detected!("pclmulqdq")
                && is_x86_feature_detected!("sse4.2")
        })
    }

    /// [`crc32c`] where the CPU has what it needs and `data` is long enough, else `None`.
    pub(super) fn crc32c_if_available(data: &[u8], keep: u64) -> Option<u32> {
        // SAFETY: `available` checked every CPU feature `crc32c` is compiled for.
        (data.len() >= super::FOLD_MIN_LEN && available()).then(|| unsafe { crc32c(data, keep) })
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

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,vpclmulqdq,pclmulqdq,sse4.2")]
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
    /// `keep` are clear read as zeros.
    ///
    /// # Safety
    /// The CPU must have the features [`available`] checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn crc32c(data: &[u8], keep: u64) -> u32 {
        assert!(data.len() >= super::FOLD_MIN_LEN);
        let len = data.len();
        let first: &[u8; 64] = data[..64].try_into().expect("64 bytes");
        // SAFETY: reads the 64 bytes `first` refers to (masked-off bytes are not read at all).
        let first = unsafe { _mm512_maskz_loadu_epi8(keep, first.as_ptr().cast()) };
        // The initial value 0xFFFFFFFF goes into the first four bytes.
        let first = _mm512_xor_si512(first, _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, 0xFFFF_FFFF));
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
        let mut lane = _mm_xor_si128(f01, f23);
        while at + 16 <= len {
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

    /// `len` bytes that look random: the top byte of a Fibonacci hash of each index.
    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        (0..len as u64).map(|i| ((i ^ seed << 20).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8).collect()
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
                assert_eq!(crc32c(d), bitwise(d, None), "len {len}, shift {shift}");
                let field = 34;
                if len >= field + 4 {
                    assert_eq!(
                        crc32c_zero_field(d, field),
                        bitwise(d, Some(field)),
                        "len {len}, shift {shift}"
                    );
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
            #[cfg(target_arch = "x86_64")]
            match fold::crc32c_if_available(&d, !(0xF_u64 << 34)) {
                Some(crc) => assert_eq!(crc, bitwise(&d, Some(34)), "folded, len {len}"),
                None => eprintln!("folding skipped: this CPU lacks AVX-512 VPCLMULQDQ"),
            }
        }
    }

    #[test]
    fn the_field_can_sit_anywhere_in_the_first_64_bytes() {
        for len in [60, 64, 78, 255, 256, 300, 1068] {
            let d = bytes(len, 7);
            for field in 0..=(60.min(len - 4)) {
                assert_eq!(crc32c_zero_field(&d, field), bitwise(&d, Some(field)), "len {len} field {field}");
            }
        }
    }

    proptest! {
        #[test]
        fn folding_agrees_with_crc_fast(data in proptest::collection::vec(any::<u8>(), 0..3000), field in 0usize..=60) {
            let expect = crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, &data) as u32;
            prop_assert_eq!(crc32c(&data), expect);
            if data.len() >= field + 4 {
                let mut zeroed = data.clone();
                zeroed[field..field + 4].fill(0);
                let expect = crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, &zeroed) as u32;
                prop_assert_eq!(crc32c_zero_field(&data, field), expect);
            }
        }
    }
}

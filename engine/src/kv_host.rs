//! Host memory for cached keys and values, in the cache dtype's own format.
//!
//! A pool created for one `kv_dtype` stores each value in as many bytes as that type takes: 4 for
//! f32, 2 for bf16, 1 for FP8 E4M3 plus one f32 scale per token and head. Reading a head back
//! gives exactly the f32 values the toggle's rounding produces ([`round_bf16`],
//! [`fake_quant_fp8_e4m3`]), so packing changes how many sequences fit, never a number. An f32
//! pool holds every dtype (as f32 holding the rounded values): that is what a scheduler shared by
//! requests with different toggles needs, and what the reference tests compare packing against.
//!
//! [`fake_quant_fp8_e4m3`]: crate::numerics::fake_quant_fp8_e4m3

use crate::numerics::{
    fake_quant_fp8_e4m3, fp8_e4m3_bits, fp8_e4m3_scale, fp8_e4m3_value, round_bf16,
};
use crate::toggles::KvDtype;

/// One layer's keys or values for every slot of a pool: (slots, kv_heads, head_dim) values.
#[derive(Debug)]
pub(crate) enum HostRows {
    /// f32, holding whatever rounding the request's `kv_dtype` asked for.
    F32(Vec<f32>),
    /// bfloat16 bit patterns.
    Bf16(Vec<u16>),
    /// FP8 E4M3 codes and one scale per head vector (`amax / 448`). A NaN scale marks a head that
    /// held an infinity or NaN, which FP8 cannot store: it reads back as NaN.
    Fp8 { codes: Vec<u8>, scales: Vec<f32> },
}

impl HostRows {
    /// Storage for `values` values in heads of `hd`, all zero.
    pub(crate) fn new(storage: KvDtype, values: usize, hd: usize) -> Self {
        match storage {
            KvDtype::F32 => HostRows::F32(vec![0.0; values]),
            KvDtype::Bf16 => HostRows::Bf16(vec![0; values]),
            KvDtype::Fp8E4m3 => HostRows::Fp8 {
                codes: vec![0; values],
                scales: vec![0.0; values / hd],
            },
        }
    }

    /// Bytes one head vector of `hd` values takes in `storage`.
    pub(crate) fn head_bytes(storage: KvDtype, hd: usize) -> usize {
        match storage {
            KvDtype::F32 => 4 * hd,
            KvDtype::Bf16 => 2 * hd,
            KvDtype::Fp8E4m3 => hd + 4,
        }
    }

    /// Grows (or shrinks) to `values` values; new ones are zero.
    pub(crate) fn resize(&mut self, values: usize, hd: usize) {
        match self {
            HostRows::F32(x) => x.resize(values, 0.0),
            HostRows::Bf16(x) => x.resize(values, 0),
            HostRows::Fp8 { codes, scales } => {
                codes.resize(values, 0);
                scales.resize(values / hd, 0.0);
            }
        }
    }

    /// Stores one head vector at value offset `at` (a multiple of its length) as `kv_dtype`
    /// rounds it. Packed storage always rounds to its own type; the caller makes sure the
    /// request's `kv_dtype` is that type ([`KvDtype::holds`]).
    pub(crate) fn store(&mut self, at: usize, head: &[f32], kv_dtype: KvDtype) {
        let hd = head.len();
        match self {
            HostRows::F32(x) => {
                let dst = &mut x[at..at + hd];
                match kv_dtype {
                    KvDtype::F32 => dst.copy_from_slice(head),
                    KvDtype::Bf16 => {
                        for (d, &v) in dst.iter_mut().zip(head) {
                            *d = round_bf16(v);
                        }
                    }
                    KvDtype::Fp8E4m3 => {
                        dst.copy_from_slice(head);
                        fake_quant_fp8_e4m3(dst);
                    }
                }
            }
            HostRows::Bf16(x) => {
                for (d, &v) in x[at..at + hd].iter_mut().zip(head) {
                    *d = bf16_bits(v);
                }
            }
            HostRows::Fp8 { codes, scales } => {
                let dst = &mut codes[at..at + hd];
                match fp8_e4m3_scale(head) {
                    Some(scale) => {
                        for (d, &v) in dst.iter_mut().zip(head) {
                            *d = fp8_e4m3_bits(v / scale);
                        }
                        scales[at / hd] = scale;
                    }
                    // All zero: codes keep the signs and the scale makes them zero.
                    None if head.iter().all(|v| *v == 0.0) => {
                        for (d, &v) in dst.iter_mut().zip(head) {
                            *d = if v.is_sign_negative() { 0x80 } else { 0 };
                        }
                        scales[at / hd] = 0.0;
                    }
                    None => scales[at / hd] = f32::NAN,
                }
            }
        }
    }

    /// Whether values are stored as f32 (attention can read them in place).
    pub(crate) fn is_f32(&self) -> bool {
        matches!(self, HostRows::F32(_))
    }

    /// Decodes positions `0..ctx` of one sequence (`blocks` of `block_size` positions, rows of
    /// `kv_dim` values in heads of `hd`) into f32 in position order, reusing `reuse`'s memory:
    /// a dense copy in `out` (made f32 if it is not) that attention reads without decoding,
    /// through the identity block table.
    pub(crate) fn gather(
        &self,
        blocks: &[u32],
        ctx: usize,
        block_size: usize,
        kv_dim: usize,
        hd: usize,
        out: &mut HostRows,
    ) {
        use rayon::prelude::*;
        if !out.is_f32() {
            *out = HostRows::F32(Vec::new());
        }
        let HostRows::F32(out) = out else {
            return;
        };
        out.resize(ctx.div_ceil(block_size) * block_size * kv_dim, 0.0);
        out.par_chunks_mut(kv_dim)
            .take(ctx)
            .enumerate()
            .for_each(|(pos, row)| {
                let slot = blocks[pos / block_size] as usize * block_size + pos % block_size;
                for (h, dst) in row.chunks_exact_mut(hd).enumerate() {
                    self.decode_into(slot * kv_dim + h * hd, dst);
                }
            });
    }

    /// The head vector of `hd` values at value offset `at` as f32, rounded to bf16 on the way if
    /// `bf16` (the reduced-precision attention toggles), either in place or decoded into `buf`.
    #[inline]
    pub(crate) fn head<'a>(
        &'a self,
        at: usize,
        hd: usize,
        bf16: bool,
        buf: &'a mut [f32],
    ) -> &'a [f32] {
        let buf = &mut buf[..hd];
        match self {
            HostRows::F32(x) if !bf16 => return &x[at..at + hd],
            HostRows::F32(x) => {
                for (d, &v) in buf.iter_mut().zip(&x[at..at + hd]) {
                    *d = round_bf16(v);
                }
            }
            // bf16 values round to themselves.
            HostRows::Bf16(_) => self.decode_into(at, buf),
            _ => {
                self.decode_into(at, buf);
                if bf16 {
                    buf.iter_mut().for_each(|d| *d = round_bf16(*d));
                }
            }
        }
        buf
    }

    /// Writes the head vector at value offset `at` (of `out.len()` values) to `out` as f32.
    #[inline]
    fn decode_into(&self, at: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            HostRows::F32(x) => out.copy_from_slice(&x[at..at + n]),
            HostRows::Bf16(x) => {
                for (d, &b) in out.iter_mut().zip(&x[at..at + n]) {
                    *d = f32::from_bits(u32::from(b) << 16);
                }
            }
            HostRows::Fp8 { codes, scales } => {
                let scale = scales[at / n];
                for (d, &c) in out.iter_mut().zip(&codes[at..at + n]) {
                    *d = fp8_e4m3_value(c) * scale;
                }
            }
        }
    }
}

/// The bfloat16 bit pattern of `x` rounded to nearest even (a NaN stays a NaN).
#[inline]
fn bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    (round_bf16(x).to_bits() >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn heads(seed: u64, n: usize, hd: usize) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n * hd)
            .map(|_| r.random_range(-4.0f32..4.0) * 2f32.powi(r.random_range(-8..4)))
            .collect()
    }

    /// Packed storage reads back, bit for bit, what f32 storage of the same rounding holds.
    #[test]
    fn packed_heads_read_back_as_the_f32_reference_rounds_them() {
        let hd = 64;
        let seed = rand::random();
        let mut xs = heads(seed, 40, hd);
        // Edge heads: all zero with signed zeros, and one holding an infinity.
        for (i, v) in xs[5 * hd..6 * hd].iter_mut().enumerate() {
            *v = if i % 2 == 0 { 0.0 } else { -0.0 };
        }
        xs[7 * hd + 3] = f32::INFINITY;
        for dtype in [KvDtype::Bf16, KvDtype::Fp8E4m3] {
            let mut reference = HostRows::new(KvDtype::F32, xs.len(), hd);
            let mut packed = HostRows::new(dtype, xs.len(), hd);
            for (h, head) in xs.chunks_exact(hd).enumerate() {
                reference.store(h * hd, head, dtype);
                packed.store(h * hd, head, dtype);
            }
            let (mut a, mut b) = (vec![0.0; hd], vec![0.0; hd]);
            for h in 0..xs.len() / hd {
                for bf16 in [false, true] {
                    let want = reference.head(h * hd, hd, bf16, &mut a);
                    let got = packed.head(h * hd, hd, bf16, &mut b);
                    if dtype == KvDtype::Fp8E4m3 && h == 7 {
                        // FP8 cannot hold an infinity: the whole head reads NaN.
                        assert!(got.iter().all(|v| v.is_nan()), "seed {seed}");
                        continue;
                    }
                    for (i, (w, g)) in want.iter().zip(got).enumerate() {
                        assert_eq!(
                            w.to_bits(),
                            g.to_bits(),
                            "{dtype:?} head {h}[{i}] seed {seed}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn packed_storage_takes_its_type_size() {
        assert_eq!(HostRows::head_bytes(KvDtype::F32, 64), 256);
        assert_eq!(HostRows::head_bytes(KvDtype::Bf16, 64), 128);
        assert_eq!(HostRows::head_bytes(KvDtype::Fp8E4m3, 64), 68);
        let mut rows = HostRows::new(KvDtype::Fp8E4m3, 4 * 32, 32);
        rows.resize(8 * 32, 32);
        let HostRows::Fp8 { codes, scales } = &rows else {
            unreachable!()
        };
        assert_eq!((codes.len(), scales.len()), (256, 8));
    }
}

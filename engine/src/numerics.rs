//! The CPU reference's arithmetic: matrix products, dot products, and the reduced-precision
//! roundings that toggles emulate.
//!
//! Every output element of a matrix product is one dot product computed in a fixed order (eight
//! f32 lanes, summed pairwise at the end) whatever the batch size, the row's position in the batch
//! or the thread count. That makes the reference *batch-invariant*: a sequence's logits do not
//! depend on what it was batched with, which is what lets the scheduler's invariance tests demand
//! near-equality instead of a loose tolerance.
//!
//! Reduced precisions are emulated bit-exactly the way GPU kernels round: bf16 is
//! round-to-nearest-even of the f32 value, products accumulate in f32; FP8 E4M3 ("e4m3fn") rounds
//! to nearest even with saturation at ±448.

use rayon::prelude::*;

/// Rounds to the nearest bfloat16 (ties to even), returned as f32.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Rounds every element to bfloat16 in place.
pub fn round_bf16_slice(xs: &mut [f32]) {
    for x in xs {
        *x = round_bf16(*x);
    }
}

/// Largest finite FP8 E4M3 (e4m3fn) value.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// Rounds to the nearest FP8 E4M3 (e4m3fn) value, ties to even, saturating at ±448 (as CUDA's
/// `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)` does). NaN stays NaN.
pub fn round_fp8_e4m3(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    if a >= FP8_E4M3_MAX {
        return FP8_E4M3_MAX.copysign(x);
    }
    // Spacing of representable values: 2^(e-3) for normal numbers (3 mantissa bits), 2^-9 below
    // the smallest normal 2^-6.
    let e = if a < f32::MIN_POSITIVE {
        -126
    } else {
        ((a.to_bits() >> 23) as i32) - 127
    };
    let quantum_exp = (e.max(-6)) - 3;
    let quantum = f32::from_bits(((quantum_exp + 127) as u32) << 23);
    let r = (a / quantum).round_ties_even() * quantum;
    r.min(FP8_E4M3_MAX).copysign(x)
}

/// Quantizes a vector to FP8 E4M3 with one scale (`amax / 448`), returning the dequantized values
/// the kernel would read back (`fp8(x / scale) * scale`).
pub fn fake_quant_fp8_e4m3(xs: &mut [f32]) {
    let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        return;
    }
    let scale = amax / FP8_E4M3_MAX;
    for x in xs {
        *x = round_fp8_e4m3(*x / scale) * scale;
    }
}

/// The dot product in the engine's fixed order: eight lanes, then a pairwise sum of the lanes,
/// then the tail.
#[inline(always)]
fn dot_body<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] = if FMA {
                x[l].mul_add(y[l], acc[l])
            } else {
                acc[l] + x[l] * y[l]
            };
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s = if FMA { x.mul_add(*y, s) } else { s + x * y };
    }
    s
}

/// Four dot products of four rows of `x` with one row `w`, each in exactly the order of
/// [`dot_body`] (so a row's result does not depend on being computed in a group of four).
#[inline(always)]
fn dot4_body<const FMA: bool>(x: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    let n = w.len();
    let mut acc = [[0.0f32; 8]; 4];
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        let wv = &w[i..i + 8];
        for r in 0..4 {
            let xv = &x[r][i..i + 8];
            for l in 0..8 {
                acc[r][l] = if FMA {
                    xv[l].mul_add(wv[l], acc[r][l])
                } else {
                    acc[r][l] + xv[l] * wv[l]
                };
            }
        }
        i += 8;
    }
    let mut out = [0.0f32; 4];
    for r in 0..4 {
        let a = &acc[r];
        let mut s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
        for j in full..n {
            s = if FMA {
                x[r][j].mul_add(w[j], s)
            } else {
                s + x[r][j] * w[j]
            };
        }
        out[r] = s;
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body::<true>(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_avx2(x: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    dot4_body::<true>(x, w)
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Dot product of two equal-length slices, in the engine's fixed order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA, checked at run time above.
        return unsafe { dot_avx2(a, b) };
    }
    dot_body::<false>(a, b)
}

#[inline]
fn dot4(x: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA, checked at run time above.
        return unsafe { dot4_avx2(x, w) };
    }
    dot4_body::<false>(x, w)
}

/// `out (n, m) = x (n, k) · wᵀ + bias`, with `w` stored `(m, k)` row-major as in checkpoints.
///
/// Work is split over output columns (rows of `w`), so each weight row is read once per call and
/// every output element is one [`dot`]: results are identical for any `n`, any row order and any
/// thread count.
pub fn matmul_t(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    k: usize,
    m: usize,
    out: &mut [f32],
) {
    debug_assert_eq!(x.len(), n * k);
    debug_assert_eq!(w.len(), m * k);
    debug_assert_eq!(out.len(), n * m);
    // Columns per task: big enough to amortize scheduling, small enough to balance two cores.
    let cols = (m / (rayon::current_num_threads() * 8)).clamp(8, 256);
    let rows: Vec<&[f32]> = x.chunks_exact(k).collect();
    let results: Vec<(usize, Vec<f32>)> = (0..m.div_ceil(cols))
        .into_par_iter()
        .map(|t| {
            let c0 = t * cols;
            let c1 = (c0 + cols).min(m);
            // (c1 - c0, n), column-major block of the output
            let mut block = vec![0.0f32; (c1 - c0) * n];
            for c in c0..c1 {
                let wr = &w[c * k..(c + 1) * k];
                let b = bias.map_or(0.0, |b| b[c]);
                let dst = &mut block[(c - c0) * n..(c - c0 + 1) * n];
                let mut r = 0;
                while r + 4 <= n {
                    let d = dot4([rows[r], rows[r + 1], rows[r + 2], rows[r + 3]], wr);
                    for j in 0..4 {
                        dst[r + j] = d[j] + b;
                    }
                    r += 4;
                }
                while r < n {
                    dst[r] = dot(rows[r], wr) + b;
                    r += 1;
                }
            }
            (c0, block)
        })
        .collect();
    for (c0, block) in results {
        let w = block.len() / n.max(1);
        for j in 0..w {
            for r in 0..n {
                out[r * m + c0 + j] = block[j * n + r];
            }
        }
    }
}

/// RMSNorm of each row of `x (n, d)` into `out`, as Llama defines it:
/// `x / sqrt(mean(x²) + eps) * weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

/// SiLU(gate) · up, element-wise into `gate`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        let s = *g / (1.0 + (-*g).exp());
        *g = s * u;
    }
}

/// Log-softmax of `logits` computed in f64 (the reference for every comparison downstream).
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| ((v as f64) - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&v| v as f64 - lse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rng() -> rand_chacha::ChaCha8Rng {
        rand_chacha::ChaCha8Rng::seed_from_u64(rand::random())
    }

    #[test]
    fn matmul_matches_f64_reference_and_is_batch_invariant() {
        let mut r = rng();
        for &(n, k, m) in &[(1, 37, 5), (7, 128, 33), (13, 300, 70)] {
            let x: Vec<f32> = (0..n * k).map(|_| r.random_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..m * k).map(|_| r.random_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..m).map(|_| r.random_range(-1.0..1.0)).collect();
            let mut out = vec![f32::NAN; n * m];
            matmul_t(&x, &w, Some(&b), n, k, m, &mut out);
            for i in 0..n {
                for j in 0..m {
                    let refv: f64 = (0..k)
                        .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                        .sum::<f64>()
                        + b[j] as f64;
                    let scale: f64 = (0..k)
                        .map(|t| (x[i * k + t] as f64 * w[j * k + t] as f64).abs())
                        .sum::<f64>();
                    let err = (out[i * m + j] as f64 - refv).abs();
                    assert!(err <= 1e-6 * scale.max(1.0), "({i},{j}) err {err}");
                }
                // Row i alone gives bit-identical results.
                let mut single = vec![f32::NAN; m];
                matmul_t(&x[i * k..(i + 1) * k], &w, Some(&b), 1, k, m, &mut single);
                assert_eq!(&single[..], &out[i * m..(i + 1) * m]);
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(round_bf16(1.0 + 2f32.powi(-8)), 1.0);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
        assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        let mut r = rng();
        for _ in 0..1000 {
            let x: f32 = r.random_range(-100.0..100.0);
            let rel = ((round_bf16(x) - x) / x).abs();
            assert!(rel <= 2f32.powi(-8), "{x}");
        }
    }

    #[test]
    fn fp8_e4m3_grid_and_saturation() {
        assert_eq!(round_fp8_e4m3(448.0), 448.0);
        assert_eq!(round_fp8_e4m3(1000.0), 448.0);
        assert_eq!(round_fp8_e4m3(-1000.0), -448.0);
        // Normal spacing at [1,2) is 1/8: 1.0625 ties to even -> 1.0; 1.1875 -> 1.25.
        assert_eq!(round_fp8_e4m3(1.0625), 1.0);
        assert_eq!(round_fp8_e4m3(1.1875), 1.25);
        // Smallest subnormal 2^-9; below half of it rounds to zero.
        assert_eq!(round_fp8_e4m3(2f32.powi(-9)), 2f32.powi(-9));
        assert_eq!(round_fp8_e4m3(2f32.powi(-11)), 0.0);
        // Between 256 and 448 spacing is 32: 300 -> 288, 304 -> 320 (tie to even mantissa).
        assert_eq!(round_fp8_e4m3(300.0), 288.0);
        assert_eq!(round_fp8_e4m3(304.0), 320.0);
        let mut r = rng();
        let mut xs: Vec<f32> = (0..256).map(|_| r.random_range(-3.0..3.0)).collect();
        let orig = xs.clone();
        fake_quant_fp8_e4m3(&mut xs);
        for (a, b) in xs.iter().zip(&orig) {
            // 3 mantissa bits: relative error at most 2^-4 for normal values.
            assert!((a - b).abs() <= b.abs() * 0.0625 + 3.0 / 448.0 * 2f32.powi(-9) * 2.0);
        }
    }

    #[test]
    fn log_softmax_normalizes() {
        let mut r = rng();
        let l: Vec<f32> = (0..1000).map(|_| r.random_range(-20.0..20.0)).collect();
        let lp = log_softmax(&l);
        let total: f64 = lp.iter().map(|v| v.exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
    }
}

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

/// Rounds to the nearest bfloat16 (ties to even), returned as f32. NaN stays NaN; values past
/// bf16's range round to infinity, as the hardware conversion does.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let b = x.to_bits();
    // Add half an ulp of bf16 (minus one when the kept lsb is 0: ties go to even), then truncate.
    let r = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000;
    f32::from_bits(r)
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

/// The FP8 E4M3 (e4m3fn) code of `x` rounded as [`round_fp8_e4m3`] rounds it: sign bit, four
/// exponent bits (bias 7), three mantissa bits; NaN is `0x7F`. With [`fp8_e4m3_value`] it lets a
/// cache store one byte per value and read back exactly the rounded f32.
pub fn fp8_e4m3_bits(x: f32) -> u8 {
    let r = round_fp8_e4m3(x);
    if r.is_nan() {
        return 0x7F;
    }
    let sign = if r.is_sign_negative() { 0x80u8 } else { 0 };
    let a = r.abs();
    if a == 0.0 {
        return sign;
    }
    if a < 2f32.powi(-6) {
        // Subnormal: a multiple of 2^-9, the multiple is the mantissa.
        return sign | (a * 512.0) as u8;
    }
    let bits = a.to_bits();
    let exp = ((bits >> 23) as i32 - 127 + 7) as u8;
    let mantissa = ((bits >> 20) & 7) as u8;
    sign | (exp << 3) | mantissa
}

/// The value of an FP8 E4M3 (e4m3fn) code (`0x7F` and `0xFF` are NaN; there are no infinities),
/// from a table: a cache reading FP8 decodes every value it attends to.
#[inline]
pub fn fp8_e4m3_value(code: u8) -> f32 {
    FP8_E4M3_VALUES[code as usize]
}

/// Every FP8 E4M3 code's value.
static FP8_E4M3_VALUES: [f32; 256] = {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        table[code] = fp8_e4m3_decode(code as u8);
        code += 1;
    }
    table
};

const fn fp8_e4m3_decode(code: u8) -> f32 {
    let exp = ((code >> 3) & 0xF) as u32;
    let mantissa = (code & 7) as u32;
    let a = if exp == 0xF && mantissa == 7 {
        f32::NAN
    } else if exp == 0 {
        // Subnormal: mantissa × 2^-9.
        mantissa as f32 * f32::from_bits((127 - 9) << 23)
    } else {
        // Rebias the exponent (7 → 127) and move the mantissa to f32's top bits.
        f32::from_bits(((exp + 120) << 23) | (mantissa << 20))
    };
    if code & 0x80 != 0 {
        -a
    } else {
        a
    }
}

/// The scale of one head vector's FP8 storage (`amax / 448`), or `None` where the vector is left
/// as it is: all zero, or holding an infinity or NaN (what [`fake_quant_fp8_e4m3`] and the CUDA
/// kernels do).
pub fn fp8_e4m3_scale(xs: &[f32]) -> Option<f32> {
    let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    (amax != 0.0 && amax.is_finite()).then_some(amax / FP8_E4M3_MAX)
}

/// Quantizes a vector to FP8 E4M3 with one scale (`amax / 448`), returning the dequantized values
/// the kernel would read back (`fp8(x / scale) * scale`).
pub fn fake_quant_fp8_e4m3(xs: &mut [f32]) {
    let Some(scale) = fp8_e4m3_scale(xs) else {
        return;
    };
    for x in xs {
        *x = round_fp8_e4m3(*x / scale) * scale;
    }
}

/// The dot product in the engine's fixed order: sixteen lanes (two groups of eight) over 16-wide
/// chunks, one more 8-wide chunk into the first group if 8 or more elements remain, the two
/// groups added lane by lane, the eight lanes summed pairwise, then the tail one by one. The
/// AVX2 kernels below compute exactly this order; so does this portable version.
#[inline(always)]
fn dot_body<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let fma = |x: f32, y: f32, acc: f32| if FMA { x.mul_add(y, acc) } else { acc + x * y };
    let mut acc0 = [0.0f32; 8];
    let mut acc1 = [0.0f32; 8];
    let mut i = 0;
    while i + 16 <= n {
        for l in 0..8 {
            acc0[l] = fma(a[i + l], b[i + l], acc0[l]);
            acc1[l] = fma(a[i + 8 + l], b[i + 8 + l], acc1[l]);
        }
        i += 16;
    }
    if i + 8 <= n {
        for l in 0..8 {
            acc0[l] = fma(a[i + l], b[i + l], acc0[l]);
        }
        i += 8;
    }
    let mut acc = [0.0f32; 8];
    for l in 0..8 {
        acc[l] = acc0[l] + acc1[l];
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    while i < n {
        s = fma(a[i], b[i], s);
        i += 1;
    }
    s
}

/// Four dot products of four rows of `x` with one row `w`, each in exactly [`dot_body`]'s order.
#[inline(always)]
fn dot4_body<const FMA: bool>(x: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    [
        dot_body::<FMA>(x[0], w),
        dot_body::<FMA>(x[1], w),
        dot_body::<FMA>(x[2], w),
        dot_body::<FMA>(x[3], w),
    ]
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Pairwise sum of the eight lanes: ((0+4)+(1+5)) + ((2+6)+(3+7)).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi); // (0+4, 1+5, 2+6, 3+7)
        let mut l = [0.0f32; 4];
        // SAFETY: `l` holds four f32.
        unsafe { _mm_storeu_ps(l.as_mut_ptr(), s) };
        (l[0] + l[1]) + (l[2] + l[3])
    }

    /// [`super::dot_body`]'s order with AVX2 FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, so both 8-wide loads are in bounds.
            unsafe {
                acc0 =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
                acc1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i + 8)),
                    _mm256_loadu_ps(pb.add(i + 8)),
                    acc1,
                );
            }
            i += 16;
        }
        if i + 8 <= n {
            // SAFETY: i + 8 <= n.
            unsafe {
                acc0 =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            }
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            s = a[i].mul_add(b[i], s);
            i += 1;
        }
        s
    }

    /// Four rows against one weight row, each in [`dot`]'s order; the weight row is loaded once.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4(x: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
        let n = w.len();
        debug_assert!(x.iter().all(|r| r.len() >= n));
        let pw = w.as_ptr();
        let px = [x[0].as_ptr(), x[1].as_ptr(), x[2].as_ptr(), x[3].as_ptr()];
        let mut a0 = [_mm256_setzero_ps(); 4];
        let mut a1 = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n <= every row's length.
            unsafe {
                let w0 = _mm256_loadu_ps(pw.add(i));
                let w1 = _mm256_loadu_ps(pw.add(i + 8));
                for r in 0..4 {
                    a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(px[r].add(i)), w0, a0[r]);
                    a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(px[r].add(i + 8)), w1, a1[r]);
                }
            }
            i += 16;
        }
        if i + 8 <= n {
            // SAFETY: i + 8 <= n.
            unsafe {
                let w0 = _mm256_loadu_ps(pw.add(i));
                for r in 0..4 {
                    a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(px[r].add(i)), w0, a0[r]);
                }
            }
            i += 8;
        }
        let mut out = [0.0f32; 4];
        for r in 0..4 {
            let mut s = hsum(_mm256_add_ps(a0[r], a1[r]));
            for j in i..n {
                s = x[r][j].mul_add(w[j], s);
            }
            out[r] = s;
        }
        out
    }

    /// One 8-lane chain of [`dot`]'s order for `R` rows of x against `C` weight rows: starting at
    /// element `first`, every 16th 8-wide chunk below `end`, plus the chunk at `extra` when
    /// given. `acc[r][c]` is x row r against weight row c.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn chain<const R: usize, const C: usize>(
        px: &[*const f32; R],
        pw: &[*const f32; C],
        first: usize,
        end: usize,
        extra: Option<usize>,
        acc: &mut [[__m256; C]; R],
    ) {
        let mut step = |i: usize| {
            let mut wv = [_mm256_setzero_ps(); C];
            for c in 0..C {
                // SAFETY: the caller keeps `i + 8` within every row.
                wv[c] = unsafe { _mm256_loadu_ps(pw[c].add(i)) };
            }
            for r in 0..R {
                // SAFETY: as above.
                let xv = unsafe { _mm256_loadu_ps(px[r].add(i)) };
                for c in 0..C {
                    acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
                }
            }
        };
        let mut i = first;
        while i + 8 <= end {
            step(i);
            i += 16;
        }
        if let Some(i) = extra {
            step(i);
        }
    }

    /// `out[r][c]` = [`dot`]`(x[r], w[c])` for `R` input rows and `C` weight rows, bit for bit.
    ///
    /// [`dot`]'s sixteen lanes are two independent chains (lanes 0–7 and 8–15 of each 16-wide
    /// chunk), so they are run one after the other, each with all `R·C` accumulators in
    /// registers: at `R = 4, C = 3`, 12 accumulators, 3 weight vectors and one input vector fill
    /// the 16 AVX registers, and each step does 12 FMAs for 7 loads (one-row [`dot4`] does 8 for
    /// 10). Every row must hold at least `w[0].len()` elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block<const R: usize, const C: usize>(
        x: [&[f32]; R],
        w: [&[f32]; C],
    ) -> [[f32; C]; R] {
        let n = w[0].len();
        debug_assert!(x.iter().all(|r| r.len() >= n) && w.iter().all(|r| r.len() >= n));
        let px = x.map(|r| r.as_ptr());
        let pw = w.map(|r| r.as_ptr());
        let full = n / 16 * 16;
        let extra = (full + 8 <= n).then_some(full);
        let mut lo = [[_mm256_setzero_ps(); C]; R];
        let mut hi = [[_mm256_setzero_ps(); C]; R];
        chain(&px, &pw, 0, full, extra, &mut lo);
        chain(&px, &pw, 8, full, None, &mut hi);
        let tail = if extra.is_some() { full + 8 } else { full };
        let mut out = [[0.0f32; C]; R];
        for r in 0..R {
            for c in 0..C {
                let mut s = hsum(_mm256_add_ps(lo[r][c], hi[r][c]));
                for j in tail..n {
                    s = x[r][j].mul_add(w[c][j], s);
                }
                out[r][c] = s;
            }
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: the caller checked AVX2 and FMA support.
    unsafe { avx2::dot(a, b) }
}

#[cfg(target_arch = "x86_64")]
unsafe fn dot4_avx2(x: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    // SAFETY: the caller checked AVX2 and FMA support.
    unsafe { avx2::dot4(x, w) }
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

/// How [`matmul_t_with`] computes its dot products. Both give the same bits (each output is one
/// [`dot`]); they differ only in speed, which is why both stay reachable for benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernel {
    /// One weight row against four input rows at a time ([`dot4`]): the portable path, and the
    /// only one without AVX2 and FMA.
    RowDots,
    /// Register-blocked tiles of up to four input rows by three weight rows (AVX2 + FMA;
    /// elsewhere the same as `RowDots`), over panels of weight rows sized to stay in L2.
    Blocked,
}

/// `out (n, m) = x (n, k) · wᵀ + bias`, with `w` stored `(m, k)` row-major as in checkpoints.
///
/// Work is split over output columns (rows of `w`), so each weight row is read once per call and
/// every output element is one [`dot`]: results are identical for any `n`, any row order and any
/// thread count. It takes [`MatmulKernel::Blocked`], the faster at every batch size measured
/// (`examples/matmul_speed.rs`; docs/benchmarks.md).
pub fn matmul_t(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    k: usize,
    m: usize,
    out: &mut [f32],
) {
    matmul_t_with(MatmulKernel::Blocked, x, w, bias, n, k, m, out);
}

/// [`matmul_t`] with the kernel chosen by the caller (benchmarks and tests).
#[allow(clippy::too_many_arguments)]
pub fn matmul_t_with(
    kernel: MatmulKernel,
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
    // Columns per task: big enough to amortize scheduling, small enough to balance two cores;
    // blocked, also small enough that the task's weight rows stay in L2 while every tile of input
    // rows passes over them.
    let mut cols = (m / (rayon::current_num_threads() * 8)).clamp(8, 256);
    if kernel == MatmulKernel::Blocked {
        cols = cols.min((L2_PANEL_BYTES / (4 * k.max(1))).max(3) / 3 * 3);
    }
    let rows: Vec<&[f32]> = x.chunks_exact(k).collect();
    let results: Vec<(usize, Vec<f32>)> = (0..m.div_ceil(cols))
        .into_par_iter()
        .map(|t| {
            let c0 = t * cols;
            let c1 = (c0 + cols).min(m);
            // (c1 - c0, n), column-major block of the output
            let mut block = vec![0.0f32; (c1 - c0) * n];
            if kernel == MatmulKernel::Blocked && has_avx2_fma() {
                #[cfg(target_arch = "x86_64")]
                blocked_columns(&rows, w, k, c0, c1, &mut block);
            } else {
                for c in c0..c1 {
                    let wr = &w[c * k..(c + 1) * k];
                    row_dots(&rows, wr, &mut block[(c - c0) * n..(c - c0 + 1) * n]);
                }
            }
            if let Some(b) = bias {
                for (c, col) in (c0..c1).zip(block.chunks_exact_mut(n.max(1))) {
                    col.iter_mut().for_each(|v| *v += b[c]);
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

/// `dst[r] = dot(rows[r], wr)` for every row, four rows per weight load where possible.
fn row_dots(rows: &[&[f32]], wr: &[f32], dst: &mut [f32]) {
    let n = rows.len();
    let mut r = 0;
    while r + 4 <= n {
        let d = dot4([rows[r], rows[r + 1], rows[r + 2], rows[r + 3]], wr);
        dst[r..r + 4].copy_from_slice(&d);
        r += 4;
    }
    while r < n {
        dst[r] = dot(rows[r], wr);
        r += 1;
    }
}

/// Bytes of weight rows per task of the blocked kernel, and of input rows per tile: together they
/// stay in a 512 KiB L2 (the smallest seen on our machines), so each input tile is read from
/// memory once per task and each weight row from L2 once per four input rows, not from L3.
const L2_PANEL_BYTES: usize = 160 * 1024;

/// Columns `c0..c1` of the product (column-major into `block`, `rows.len()` values a column) by
/// [`avx2::block`]: 4 × 3 tiles, the edges with smaller ones of the same order.
#[cfg(target_arch = "x86_64")]
fn blocked_columns(rows: &[&[f32]], w: &[f32], k: usize, c0: usize, c1: usize, block: &mut [f32]) {
    let n = rows.len();
    let tile = (L2_PANEL_BYTES / (4 * k.max(1))).max(4) / 4 * 4;
    for t0 in (0..n).step_by(tile) {
        let t1 = (t0 + tile).min(n);
        let mut r = t0;
        while r < t1 {
            let rr = (t1 - r).min(4);
            for c in (c0..c1).step_by(3) {
                let cc = (c1 - c).min(3);
                let wr = |j: usize| &w[(c + j) * k..(c + j + 1) * k];
                let x = |j: usize| rows[r + j];
                let mut put = |j: usize, vals: &[f32]| {
                    for (i, &v) in vals.iter().enumerate() {
                        block[(c - c0 + i) * n + r + j] = v;
                    }
                };
                // SAFETY (every arm): this path runs only where AVX2 and FMA were detected, and
                // every row given holds k elements.
                macro_rules! tile {
                    ($R:literal, $C:literal) => {{
                        let xs: [&[f32]; $R] = std::array::from_fn(x);
                        let ws: [&[f32]; $C] = std::array::from_fn(wr);
                        let out = unsafe { avx2::block::<$R, $C>(xs, ws) };
                        for (j, o) in out.iter().enumerate() {
                            put(j, o);
                        }
                    }};
                }
                match (rr, cc) {
                    (4, 3) => tile!(4, 3),
                    (4, 2) => tile!(4, 2),
                    (4, 1) => tile!(4, 1),
                    (3, 3) => tile!(3, 3),
                    (3, 2) => tile!(3, 2),
                    (3, 1) => tile!(3, 1),
                    (2, 3) => tile!(2, 3),
                    (2, 2) => tile!(2, 2),
                    (2, 1) => tile!(2, 1),
                    (_, 3) => tile!(1, 3),
                    (_, 2) => tile!(1, 2),
                    _ => tile!(1, 1),
                }
            }
            r += rr;
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
    fn simd_kernels_compute_the_portable_order_exactly() {
        let mut r = rng();
        for n in [1, 7, 8, 15, 16, 17, 24, 31, 64, 100, 768] {
            let a: Vec<f32> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
            let rows: Vec<Vec<f32>> = (0..4)
                .map(|_| (0..n).map(|_| r.random_range(-1.0..1.0)).collect())
                .collect();
            let want_fma = dot_body::<true>(&a, &rows[0]);
            let want_plain = dot_body::<false>(&a, &rows[0]);
            let got = dot(&a, &rows[0]);
            assert!(got == want_fma || got == want_plain, "n={n}");
            let four = dot4([&rows[0], &rows[1], &rows[2], &rows[3]], &a);
            for (i, row) in rows.iter().enumerate() {
                assert_eq!(four[i], dot(row, &a), "n={n} row {i}");
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn register_blocked_kernel_computes_dot_order_exactly() {
        if !has_avx2_fma() {
            println!("SKIPPED: this CPU has no AVX2/FMA, so the blocked kernel never runs");
            return;
        }
        let mut r = rng();
        // Lengths around the 16-wide chunks, the extra 8-wide chunk and the scalar tail.
        for k in [
            1, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 32, 40, 100, 300, 768,
        ] {
            let rows: Vec<Vec<f32>> = (0..7)
                .map(|_| (0..k).map(|_| r.random_range(-1.0..1.0)).collect())
                .collect();
            let want = |a: usize, b: usize| dot(&rows[a], &rows[b]);
            // SAFETY: AVX2 and FMA are present (checked above); every row holds k elements.
            let got = unsafe {
                avx2::block::<4, 3>(
                    [&rows[0], &rows[1], &rows[2], &rows[3]],
                    [&rows[4], &rows[5], &rows[6]],
                )
            };
            for (i, row) in got.iter().enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    assert_eq!(v.to_bits(), want(i, 4 + j).to_bits(), "k={k} ({i},{j})");
                }
            }
            // SAFETY: as above.
            let one = unsafe { avx2::block::<1, 1>([&rows[2]], [&rows[5]]) };
            assert_eq!(one[0][0].to_bits(), want(2, 5).to_bits(), "k={k} 1x1");
        }
    }

    #[test]
    fn blocked_matmul_equals_one_dot_per_element_at_every_edge() {
        // Row counts past the 4-row tiles, column counts past the 3-column groups, and at k = 4000
        // row tiles of 8 rows and tasks of 9 columns (the L2 panel rule): each element is exactly
        // `dot(x_r, w_c) + b_c`.
        let mut r = rng();
        let shapes = [
            (1, 33, 7),
            (3, 17, 5),
            (4, 33, 3),
            (5, 40, 4),
            (67, 130, 29),
            (130, 24, 11),
            (13, 4000, 20),
        ];
        for &(n, k, m) in &shapes {
            let x: Vec<f32> = (0..n * k).map(|_| r.random_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..m * k).map(|_| r.random_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..m).map(|_| r.random_range(-1.0..1.0)).collect();
            let mut out = vec![f32::NAN; n * m];
            matmul_t(&x, &w, Some(&b), n, k, m, &mut out);
            for i in 0..n {
                for j in 0..m {
                    let want = dot(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]) + b[j];
                    assert_eq!(
                        out[i * m + j].to_bits(),
                        want.to_bits(),
                        "n={n} k={k} m={m} ({i},{j})"
                    );
                }
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
        for _ in 0..10000 {
            let x: f32 = r.random_range(-100.0..100.0);
            let rel = ((round_bf16(x) - x) / x).abs();
            assert!(rel <= 2f32.powi(-8), "{x}");
            // The bit trick agrees with the `half` crate's conversion.
            assert_eq!(round_bf16(x), half::bf16::from_f32(x).to_f32(), "{x}");
        }
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert!(round_bf16(f32::NAN).is_nan());
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
    fn fp8_e4m3_codes_round_trip() {
        // Every code but the two NaNs decodes to a value that encodes back to the same code.
        for code in 0..=255u8 {
            let v = fp8_e4m3_value(code);
            if code & 0x7F == 0x7F {
                assert!(v.is_nan(), "{code:#x}");
                continue;
            }
            assert_eq!(fp8_e4m3_bits(v), code, "{code:#x} = {v}");
        }
        assert_eq!(fp8_e4m3_value(0x7E), 448.0);
        assert_eq!(fp8_e4m3_value(0x01), 2f32.powi(-9));
        assert_eq!(fp8_e4m3_value(0x38), 1.0);
        // Any value: the code's value is the rounding, bit for bit (signed zeros included).
        let mut r = rng();
        for _ in 0..20000 {
            let x: f32 = r.random_range(-600.0..600.0) * 2f32.powi(r.random_range(-14..0));
            let want = round_fp8_e4m3(x);
            assert_eq!(
                fp8_e4m3_value(fp8_e4m3_bits(x)).to_bits(),
                want.to_bits(),
                "{x}"
            );
        }
        assert!(fp8_e4m3_value(fp8_e4m3_bits(f32::NAN)).is_nan());
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

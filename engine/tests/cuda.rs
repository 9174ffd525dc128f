//! The CUDA backend against the CPU reference, on the GPU when there is one.
//!
//! Without a GPU (or without the CUDA libraries) each test prints why it is skipped and passes:
//! CI runs on CPU-only machines. On the device machine they run for real
//! (`bench/cuda/run_engine_tests.sh`).
//!
//! Tolerances, and why: the CUDA kernels compute the CPU reference's formulas with the same
//! roundings, but in a different summation order (cuBLAS picks its own, and may pick another for
//! another batch size), so f32 results differ by accumulated rounding only: ≤ 1e-4 relative L2 on
//! the logits of a whole model (measured far below). With bf16 operands (matmul, attention) the
//! two backends round the same inputs but accumulate differently, and one bf16 rounding flip
//! cascades through the layers: ≤ 2e-2 relative, i.e. the bf16 class of error (≤ 1e-2 per op).
//! Quantized KV storage (bf16, FP8) is in the same class even with f32 arithmetic: a key that
//! differs by 1e-7 between the backends can round to the neighbouring storage value, one bf16 ulp
//! (2^-8 relative) or FP8 step (2^-3) away, so those toggles get the reduced-precision bound too
//! (measured on the H200: 1e-3 for kv_dtype=bf16).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use tapedeck_engine::backend::Device;
use tapedeck_engine::cuda::{kernels, probe};
use tapedeck_engine::engine::EngineOptions;
use tapedeck_engine::model::{BlockTable, KvCache, Logits, Pick, Segment, WantLogits};
use tapedeck_engine::scheduler::{EngineHandle, Event, SchedulerConfig};
use tapedeck_engine::toggles::KvDtype;
use tapedeck_engine::{
    Engine, GenerateOutput, GenerateRequest, SamplingParams, StopCriteria, Toggles,
};

/// A fixture model directory; `TAPEDECK_FIXTURES` overrides the build-time path, so a test
/// executable carried to a GPU machine finds the fixtures of the checkout it runs in.
fn fixture(name: &str) -> PathBuf {
    std::env::var_os("TAPEDECK_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models"))
        .join(name)
}

/// The CPU and CUDA engines for a fixture, or `None` (with the reason printed) without a GPU.
fn engines(name: &str) -> Option<(Arc<Engine>, Arc<Engine>)> {
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return None;
    }
    let load = |device| {
        Arc::new(
            Engine::load_with(
                &fixture(name),
                &EngineOptions {
                    threads: None,
                    device,
                },
            )
            .expect("fixture loads"),
        )
    };
    Some((load(Device::Cpu), load(Device::Cuda(0))))
}

/// Builds the fixture model `spec` under `dir` and loads it on GPU 0.
fn build_on_gpu(dir: &Path, spec: &tapedeck_engine::fixture::FixtureSpec) -> Engine {
    let path = dir.join(&spec.name);
    tapedeck_engine::fixture::build(spec, &path).unwrap();
    Engine::load_with(
        &path,
        &EngineOptions {
            threads: None,
            device: Device::Cuda(0),
        },
    )
    .unwrap()
}

fn rng() -> rand_chacha::ChaCha8Rng {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    rand_chacha::ChaCha8Rng::seed_from_u64(seed)
}

fn tokens(e: &Engine, n: usize, r: &mut impl Rng) -> Vec<u32> {
    let v = e.tokenizer().vocab_size() as u32;
    (0..n).map(|_| r.random_range(0..v)).collect()
}

/// Logits of every position: a prefill of `prompt` (in chunks of `chunk`), then one decode step
/// per token of `decode`. Rows: the prefill's last row, then one per decode step.
fn run(
    e: &Engine,
    prompt: &[u32],
    decode: &[u32],
    chunk: usize,
    toggles: &Toggles,
) -> Vec<Vec<f32>> {
    let mut cache = KvCache::in_pool(e.backend().new_pool(16, 0, toggles.kv_dtype).unwrap());
    let mut rows = Vec::new();
    for (i, piece) in prompt.chunks(chunk).enumerate() {
        let last = (i + 1) * chunk >= prompt.len();
        let want = if last {
            WantLogits::Last
        } else {
            WantLogits::None
        };
        let (pool, seg) = cache.segment(piece, false, want).unwrap();
        let mut out = e.backend().forward(pool, &mut [seg], toggles).unwrap();
        if last {
            rows.push(out.pop().unwrap().into_rows().unwrap());
        }
    }
    for t in decode {
        let (pool, seg) = cache
            .segment(std::slice::from_ref(t), true, WantLogits::Last)
            .unwrap();
        rows.push(
            e.backend()
                .forward(pool, &mut [seg], toggles)
                .unwrap()
                .pop()
                .unwrap()
                .into_rows()
                .unwrap(),
        );
    }
    rows
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Worst relative L2 over rows, checking every value is finite.
fn worst(got: &[Vec<f32>], want: &[Vec<f32>]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            assert!(g.iter().all(|v| v.is_finite()), "non-finite GPU logits");
            rel_l2(g, w)
        })
        .fold(0.0, f64::max)
}

#[test]
fn nvrtc_compiles_every_kernel_for_sm90_and_sm120() {
    // No GPU is needed, only libnvrtc: CI runs this for real (ci/kernels_check.sh fetches NVRTC
    // and ptxas from PyPI and sets TAPEDECK_REQUIRE_NVRTC=1, so a missing library fails instead of
    // skipping). With TAPEDECK_PTXAS pointing at a ptxas binary the PTX is also assembled for the
    // real architectures: NVRTC passes inline PTX (griddepcontrol, cp.async, mma.sync, ldmatrix)
    // through unchecked, so only ptxas (or the driver's JIT on a GPU) finds a bad instruction.
    if !kernels::nvrtc_present() {
        assert!(
            std::env::var_os("TAPEDECK_REQUIRE_NVRTC").is_none(),
            "TAPEDECK_REQUIRE_NVRTC is set but NVRTC (libnvrtc.so.13) was not found"
        );
        println!("SKIPPED: NVRTC (libnvrtc.so) is not on this machine");
        return;
    }
    let ptxas = std::env::var_os("TAPEDECK_PTXAS");
    let dir = tempfile::tempdir().unwrap();
    let has_entry_points = |src: &kernels::KernelSource, arch: &str, ptx: &str| {
        for e in src.entry_points {
            assert!(
                ptx.contains(&format!(".entry {e}(")),
                "{}: {e} missing from {arch} PTX",
                src.name
            );
        }
    };
    for src in kernels::ALL {
        for arch in ["compute_80", "compute_90", "compute_120"] {
            let ptx = kernels::compile_uncached(src, arch)
                .unwrap_or_else(|e| panic!("{} for {arch}: {e}", src.name));
            has_entry_points(src, arch, &ptx);
            println!(
                "{} compiles for {arch} ({} bytes of PTX)",
                src.name,
                ptx.len()
            );
            let Some(ptxas) = &ptxas else { continue };
            let sm = arch.replace("compute_", "sm_");
            let file = dir.path().join(format!("{}-{arch}.ptx", src.name));
            std::fs::write(&file, &ptx).unwrap();
            let out = std::process::Command::new(ptxas)
                .arg(format!("-arch={sm}"))
                .arg(&file)
                .arg("-o")
                .arg(dir.path().join("out.cubin"))
                .output()
                .unwrap_or_else(|e| panic!("running {ptxas:?}: {e}"));
            assert!(
                out.status.success(),
                "ptxas rejects {} for {sm}:\n{}",
                src.name,
                String::from_utf8_lossy(&out.stderr)
            );
            println!("{} assembles for {sm}", src.name);
        }
    }
    // The engine compiles its files on several threads at once (cuda/launch.rs `load_modules`,
    // through the PTX cache): each thread gets its own file's PTX, every entry point in it.
    let srcs = [&kernels::ENGINE, &kernels::DECODE_MMA, &kernels::PREFILL];
    let ptxs = std::thread::scope(|s| {
        let jobs = srcs.map(|src| s.spawn(move || kernels::ptx(src, "compute_90")));
        jobs.map(|j| j.join().expect("compile thread").expect("PTX"))
    });
    for (src, ptx) in srcs.iter().zip(&ptxs) {
        has_entry_points(src, "compute_90", ptx);
    }
}

/// `n` rows of `inp` values drawn from N(0, 1)-ish (a sum of uniforms), never all zero.
fn randn(r: &mut impl Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| (0..4).map(|_| r.random_range(-1.0f32..1.0)).sum::<f32>() * 0.87)
        .collect()
}

/// `(Σ_j w_j·x_j, Σ_j |w_j·x_j|)` over bf16-rounded operands, in float64.
fn dot64(w: &[f32], x: &[f32]) -> (f64, f64) {
    use tapedeck_engine::numerics::round_bf16;
    w.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| {
        let p = round_bf16(w) as f64 * round_bf16(x) as f64;
        (s + p, a + p.abs())
    })
}

#[test]
fn cuda_gemv_kernel_matches_a_float64_reference() {
    // The few-token bf16 GEMV (small_gemm=gemv) against float64 sums of the same bf16-rounded
    // operands, on fresh random shapes: every row count 1..=4, widths that leave a partial last
    // block and partial 16-byte rounds per lane, bias, an f32 input rounded by the kernel, and the
    // residual add. Bound: f32 accumulation of exact bf16 products, so each output is within 1e-5
    // of Σ|w·x| (plus |b| and |residual|) of the exact value; outputs start as NaN unless added to.
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return;
    }
    use tapedeck_engine::cuda::check::{gemv, GemvCase};
    let mut r = rng();
    let mut streamed = 0;
    // (out, in, row counts): Llama-3.2-1B's shapes, a tiny one, random ones (short and long).
    let all: Vec<usize> = (1..=4).collect();
    let mut cases = vec![
        (2048usize, 2048usize, vec![1, 2, 4]),
        (512, 2048, all.clone()),
        (2048, 8192, vec![1, 4]),
        (1000, 24, all.clone()),
    ];
    for _ in 0..3 {
        cases.push((
            r.random_range(1..1500),
            8 * r.random_range(1..256),
            all.clone(),
        ));
    }
    // Rows longer than one warp's prefetch: 2, 4 or 8 warps share an output feature.
    for _ in 0..2 {
        cases.push((
            r.random_range(1..1500),
            16 * r.random_range(129..1200),
            all.clone(),
        ));
    }
    for (i, (out, inp, ns)) in cases.iter().enumerate() {
        let (out, inp) = (*out, *inp);
        let w = randn(&mut r, out * inp);
        for &n in ns {
            let x = randn(&mut r, n * inp);
            let b = (i % 2 == 1).then(|| randn(&mut r, out));
            let res = (n % 2 == 0).then(|| randn(&mut r, n * out));
            let x_f32 = (i + n) % 3 == 0;
            // The fused RMSNorm (q/k/v's input) where its shared memory holds the rows.
            let nw = ((i + n) % 4 == 1 && n * inp * 2 <= 48 << 10).then(|| randn(&mut r, inp));
            let eps = 1e-5f32;
            let case = GemvCase {
                w: &w,
                out,
                inp,
                bias: b.as_deref(),
                x: &x,
                n,
                x_f32,
                norm: nw.as_deref().map(|w| (w, eps)),
                residual: res.as_deref(),
            };
            let run = gemv(0, &case, 0).unwrap();
            streamed += same_bits_as_streamed(&run, &format!("gemv {out}x{inp} n {n}"));
            // What the products see: x, or x normalized (in float64, then rounded to bf16 by
            // dot64; a rounding that lands the other way than the kernel's f32 norm is a rare
            // one-ulp flip of one input, hence the looser bound against float64 below).
            let xin: Vec<f32> = match &nw {
                None => x.clone(),
                Some(nw) => x
                    .chunks(inp)
                    .flat_map(|row| {
                        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / inp as f64;
                        let inv = 1.0 / (ms + eps as f64).sqrt();
                        row.iter()
                            .zip(nw)
                            .map(move |(&v, &g)| (g as f64 * v as f64 * inv) as f32)
                    })
                    .collect(),
            };
            let (mut worst_ours, mut worst_cublas, mut worst_pair) = (0.0f64, 0.0f64, 0.0f64);
            for row in 0..n {
                for o in 0..out {
                    let (dot, mag) =
                        dot64(&w[o * inp..(o + 1) * inp], &xin[row * inp..(row + 1) * inp]);
                    let extra = [
                        b.as_ref().map(|b| b[o]),
                        res.as_ref().map(|v| v[row * out + o]),
                    ];
                    let want = dot + extra.iter().flatten().map(|&v| v as f64).sum::<f64>();
                    let scale = mag + extra.iter().flatten().map(|v| v.abs() as f64).sum::<f64>();
                    let at = row * out + o;
                    let got = run.ours[at];
                    assert!(
                        got.is_finite(),
                        "out {out} in {inp} n {n}: y[{row},{o}] = {got}"
                    );
                    worst_ours = worst_ours.max((got as f64 - want).abs() / scale.max(1e-30));
                    worst_cublas =
                        worst_cublas.max((run.cublas[at] as f64 - want).abs() / scale.max(1e-30));
                    worst_pair = worst_pair
                        .max((got as f64 - run.cublas[at] as f64).abs() / scale.max(1e-30));
                }
            }
            let what = format!(
                "out {out} in {inp} n {n} (bias {}, f32 input {x_f32}, norm {}, add {})",
                b.is_some(),
                nw.is_some(),
                res.is_some()
            );
            let bound = if nw.is_some() { 1e-4 } else { 1e-5 };
            assert!(worst_ours <= bound, "{what}: error {worst_ours:e}");
            // Against the cuBLAS path on the same bf16 inputs (the fused norm computes what the
            // RMSNorm kernel computes, bit for bit): only the two f32 summation orders differ.
            assert!(worst_pair <= 2e-5, "{what}: ours vs cuBLAS {worst_pair:e}");
            if n == 4 || n == 1 || nw.is_some() {
                println!(
                    "gemv {what}: worst error/Σ|terms| ours {worst_ours:.1e}, cuBLAS \
                     {worst_cublas:.1e}, ours vs cuBLAS {worst_pair:.1e}"
                );
            }
        }
    }
    // The streaming kernels take one row with warp slices of at most 2048 inputs: at least
    // Llama's shapes 2048x2048, 512x2048 and 2048x8192 (four slices of 2048) and the tiny one.
    assert!(
        streamed >= 4 * tapedeck_engine::cuda::check::STREAM_GRIDS.len(),
        "the streaming kernels ran on {streamed} cases"
    );
}

/// Asserts that the streaming GEMV kernels (`TAPEDECK_GEMV_STREAM`, every grid `check` ran them
/// on) wrote exactly the bits of the default kernel, and returns how many grids ran.
fn same_bits_as_streamed(run: &tapedeck_engine::cuda::check::KernelRun, what: &str) -> usize {
    for (per_sm, y, _) in &run.stream {
        let differ = y
            .iter()
            .zip(&run.ours)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{what}: the streaming kernel at {per_sm} blocks per SM differs in {differ} of {} \
             outputs",
            y.len()
        );
    }
    run.stream.len()
}

#[test]
fn cuda_fused_gate_up_kernel_matches_a_float64_reference() {
    // gemv_bf16_swiglu: bf16(silu(x·Wgᵀ) · (x·Wuᵀ)) against float64 gate and up sums of the same
    // bf16 operands. Bound per element: one bf16 rounding of the result (2^-8 relative, a tie may
    // round either way after f32 accumulation) plus the f32 accumulation error carried through
    // silu(g)·u (1e-5 of Σ|terms| of each sum, times the other factor).
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return;
    }
    use tapedeck_engine::cuda::check::{swiglu, SwigluCase};
    let mut r = rng();
    let shapes = [
        (8192usize, 2048usize, vec![1, 3, 4]),
        (
            r.random_range(1..2000),
            8 * r.random_range(1..200),
            vec![1, 2, 4],
        ),
    ];
    for (inter, inp, ns) in shapes {
        let wg = randn(&mut r, inter * inp);
        let wu = randn(&mut r, inter * inp);
        for n in ns {
            let x = randn(&mut r, n * inp);
            let case = SwigluCase {
                wg: &wg,
                wu: &wu,
                inter,
                inp,
                x: &x,
                n,
            };
            let run = swiglu(0, &case, 0).unwrap();
            let grids = same_bits_as_streamed(&run, &format!("swiglu {inter}x{inp} n {n}"));
            assert!(
                n > 1 || inp > 2048 || grids > 0,
                "one row: the streaming kernel runs"
            );
            let mut worst = 0.0f64;
            for row in 0..n {
                let xr = &x[row * inp..(row + 1) * inp];
                for o in 0..inter {
                    let (g, gm) = dot64(&wg[o * inp..(o + 1) * inp], xr);
                    let (u, um) = dot64(&wu[o * inp..(o + 1) * inp], xr);
                    let silu = g / (1.0 + (-g).exp());
                    let want = silu * u;
                    let bound = want.abs() / 256.0 + 1e-5 * (gm * u.abs() * 1.1 + um * silu.abs());
                    let got = run.ours[row * inter + o] as f64;
                    assert!(
                        got.is_finite(),
                        "{inter}x{inp} n {n}: out[{row},{o}] = {got}"
                    );
                    let err = (got - want).abs();
                    assert!(
                        err <= bound,
                        "{inter}x{inp} n {n}: out[{row},{o}] = {got}, want {want} (bound {bound:e})"
                    );
                    worst = worst.max(err / bound);
                }
            }
            let same = run
                .ours
                .iter()
                .zip(&run.cublas)
                .filter(|(a, b)| a == b)
                .count();
            println!(
                "swiglu {inter}x{inp}, {n} rows: worst error {worst:.2} of the bound; {:.2}% of \
                 outputs equal to the cuBLAS path's",
                100.0 * same as f64 / run.ours.len() as f64
            );
        }
    }
}

#[test]
fn cuda_matches_cpu_on_both_fixtures_under_every_numeric_toggle() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let Some((cpu, gpu)) = engines(name) else {
            return;
        };
        println!("{name}: {}", gpu.backend().describe());
        let mut r = rng();
        let cases: &[(&str, f64)] = &[
            ("", 1e-4),
            ("kv_dtype=bf16", 2e-2),
            ("kv_dtype=fp8-e4m3", 5e-2),
            ("decode_topk=40", 1e-4),
            ("fault.chunk=boundary,prefill_chunk=50", 1e-4),
            ("matmul=bf16", 2e-2),
            ("attn_scores=bf16", 2e-2),
            ("attn_decode=mma-bf16", 2e-2),
            ("attn_prefill=mma-bf16", 2e-2),
            ("matmul=bf16,small_gemm=gemv", 2e-2),
            ("matmul=bf16,small_gemm=gemv,pdl=on", 2e-2),
            ("matmul=bf16,small_gemm=gemv,pdl=all", 2e-2),
        ];
        for &(toggles, tol) in cases {
            let t: Toggles = toggles.parse().unwrap();
            let n = r.random_range(90..300);
            let p = tokens(&cpu, n, &mut r);
            let d = tokens(&cpu, 12, &mut r);
            let chunk = t.prefill_chunk.map_or(n, |c| c.get());
            let want = run(&cpu, &p, &d, chunk, &t);
            let got = run(&gpu, &p, &d, chunk, &t);
            let err = worst(&got, &want);
            // A quantized KV cache turns a 1e-7 difference between the backends into a whole
            // storage step wherever a value sits at a rounding boundary (a 12% step in fp8), so
            // the two may disagree by as much as the quantization moves the CPU's own result,
            // and no more.
            let tol = if t.kv_dtype != KvDtype::F32 {
                let exact = run(&cpu, &p, &d, chunk, &Toggles::default());
                let effect = worst(&want, &exact);
                println!("{name} [{toggles}] the quantization itself moves the CPU's logits by {effect:.2e}");
                tol.max(effect)
            } else {
                tol
            };
            // The top-k selection is discrete: where the k-th and (k+1)-th scores of a decode
            // step tie to within the backends' 1e-7, the two may keep different positions, and
            // that step's logits (only that step's: the cache is unchanged) move by about the
            // weight of one position near rank k. One such step of the 12 may exceed the bound,
            // by no more than 5e-2; every other row must meet it.
            if t.decode_topk.is_some() && err > tol {
                let over: Vec<f64> = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| rel_l2(g, w))
                    .filter(|&e| e > tol)
                    .collect();
                println!("{name} [{toggles}] rows past {tol:e} (selection flips): {over:?}");
                assert!(
                    over.len() <= 1 && err <= 5e-2,
                    "{name} [{toggles}]: {} rows past {tol:e}, worst {err:e}",
                    over.len()
                );
                continue;
            }
            println!("{name} [{toggles}] {n}+12 tokens: max rel L2 {err:.2e} (bound {tol:e})");
            assert!(err <= tol, "{name} [{toggles}]: rel L2 {err:e} > {tol:e}");
        }
    }
}

#[test]
fn cuda_toggles_move_the_logits_like_the_cpu_does() {
    // A toggle that changes the numbers on the CPU must change them on the GPU by a similar amount
    // (a kernel that ignored its toggle would show zero change).
    let Some((cpu, gpu)) = engines("tiny-qwen2") else {
        return;
    };
    let mut r = rng();
    let p = tokens(&cpu, 400, &mut r);
    let d = tokens(&cpu, 8, &mut r);
    let base = Toggles::default();
    let cpu_ref = run(&cpu, &p, &d, p.len(), &base);
    let gpu_ref = run(&gpu, &p, &d, p.len(), &base);
    for toggles in [
        "kv_dtype=fp8-e4m3",
        "decode_topk=16",
        "matmul=bf16",
        "attn_decode=mma-bf16",
    ] {
        let t: Toggles = toggles.parse().unwrap();
        let c = worst(&run(&cpu, &p, &d, p.len(), &t), &cpu_ref);
        let g = worst(&run(&gpu, &p, &d, p.len(), &t), &gpu_ref);
        println!("[{toggles}] change: cpu {c:.3e}, cuda {g:.3e}");
        assert!(c > 0.0 && g > 0.0, "[{toggles}] changed nothing");
        assert!(
            g > c / 4.0 && g < c * 4.0,
            "[{toggles}] GPU change {g:e} is not like the CPU's {c:e}"
        );
    }
}

#[test]
fn cuda_batched_segments_match_each_alone() {
    // One shared pool with interleaved blocks: exercises block tables, slots and the per-token
    // segment indices of the kernels.
    let Some((cpu, gpu)) = engines("tiny-llama") else {
        return;
    };
    let mut r = rng();
    let seqs: Vec<Vec<u32>> = (0..5).map(|i| tokens(&cpu, 9 + 23 * i, &mut r)).collect();
    let t = Toggles::default();
    let alone: Vec<Vec<f32>> = seqs
        .iter()
        .map(|s| run(&cpu, s, &[], s.len(), &t).pop().unwrap())
        .collect();
    let bs = 16;
    let need: Vec<usize> = seqs.iter().map(|s| s.len().div_ceil(bs)).collect();
    let total: usize = need.iter().sum();
    let mut pool = gpu.backend().new_pool(bs, total, t.kv_dtype).unwrap();
    let mut tables: Vec<BlockTable> = seqs.iter().map(|_| BlockTable::default()).collect();
    // Blocks handed out in reverse and interleaved.
    let mut next = total as u32;
    for round in 0..*need.iter().max().unwrap() {
        for (i, table) in tables.iter_mut().enumerate() {
            if round < need[i] {
                next -= 1;
                table.blocks.push(next);
            }
        }
    }
    let mut segs: Vec<Segment> = seqs
        .iter()
        .zip(tables.iter_mut())
        .map(|(s, table)| Segment {
            tokens: s,
            table,
            decode: false,
            want: WantLogits::Last,
            fault_chunk_boundary: false,
        })
        .collect();
    let batched: Vec<Vec<f32>> = gpu
        .backend()
        .forward(&mut pool, &mut segs, &t)
        .unwrap()
        .into_iter()
        .map(|l| l.into_rows().unwrap())
        .collect();
    let err = worst(&batched, &alone);
    println!("batched on cuda vs each alone on cpu: max rel L2 {err:.2e}");
    assert!(err <= 1e-4, "{err:e}");
}

fn collect(mut s: tapedeck_engine::scheduler::RequestStream) -> GenerateOutput {
    loop {
        match s.blocking_next() {
            Some(Event::Token(_)) => {}
            Some(Event::Done(o)) => return o,
            Some(Event::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without output"),
        }
    }
}

#[test]
fn cuda_scheduler_invariance_chunks_prefix_cache_and_batching() {
    // The Engine II scheduler drives the CUDA backend unchanged. Teacher forcing pins the tokens, so
    // the comparison is of logprobs only: ≤ 1e-4 absolute (cuBLAS may choose another algorithm for
    // another batch size, so results are close, not bit-identical as on the CPU).
    let Some((cpu, gpu)) = engines("tiny-qwen2") else {
        return;
    };
    let h = EngineHandle::start(
        gpu.clone(),
        SchedulerConfig {
            kv_budget_bytes: 64 << 20,
            max_batch_tokens: 256,
            ..Default::default()
        },
    )
    .unwrap();
    let mut r = rng();
    let p = tokens(&cpu, r.random_range(100..200), &mut r);
    let forced = tokens(&cpu, 10, &mut r);
    let reference = cpu
        .score_with(
            &[p.clone(), forced.clone()].concat(),
            p.len(),
            4,
            &Toggles::default(),
            tapedeck_engine::engine::ScoreMode::Decode,
        )
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let check = |what: &str| {
        let t: Toggles = what.parse().unwrap();
        let got = rt
            .block_on(h.score(p.clone(), forced.clone(), 4, t))
            .unwrap();
        assert_eq!(got.len(), reference.len(), "{what}");
        for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
            let d = (a.logprob - b.logprob).abs();
            assert!(
                d <= 1e-4,
                "{what}: logprob {i} {} vs {} (|Δ| {d:e})",
                a.logprob,
                b.logprob
            );
        }
    };
    // Background traffic so the forced request is batched with others.
    let noise: Vec<_> = (0..6)
        .map(|_| {
            let q = tokens(&cpu, r.random_range(10..120), &mut r);
            h.submit(GenerateRequest {
                prompt: q,
                sampling: SamplingParams::default(),
                stop: StopCriteria {
                    max_tokens: 20,
                    ignore_eos: true,
                    ..Default::default()
                },
                top_k_summary: 0,
                toggles: Toggles::default(),
            })
            .unwrap()
        })
        .collect();
    for toggles in [
        "prefix_cache=off",
        "prefill_chunk=7,prefix_cache=off",
        "prefill_chunk=64",
        "prefix_cache=on",
        "prefix_cache=on",
        // Decode steps as CUDA graphs, padded to batch buckets among the background traffic.
        "cuda_graphs=on,prefix_cache=off",
        "cuda_graphs=on,prefill_chunk=7",
    ] {
        check(toggles);
    }
    for s in noise {
        collect(s);
    }
    assert!(
        h.stats()
            .prefix_hit_tokens
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0,
        "the prefix cache was never hit"
    );
}

#[test]
fn cuda_mma_bf16_decode_kernel_on_head_dim_64_and_128() {
    // The fixtures have head_dim 32, which the tensor-core kernel does not take (it falls back to
    // the SIMT kernel with bf16 roundings). Build two small models whose heads the mma kernel does
    // take, GQA 8/2 and 4/1, and check its decode steps against the CPU's emulation of the same
    // roundings, and that it moves the logits like the emulation does.
    let dir = tempfile::tempdir().unwrap();
    let Some(models) = mma_models(dir.path()) else {
        return;
    };
    for (hd, cpu, gpu) in models {
        let mut r = rng();
        // Long enough for several splits; decode steps cross block boundaries.
        let p = tokens(&cpu, r.random_range(600..1500), &mut r);
        let d = tokens(&cpu, 20, &mut r);
        let t: Toggles = "attn_decode=mma-bf16".parse().unwrap();
        let f32_cpu = run(&cpu, &p, &d, p.len(), &Toggles::default());
        let want = run(&cpu, &p, &d, p.len(), &t);
        let got = run(&gpu, &p, &d, p.len(), &t);
        let err = worst(&got, &want);
        let moved_cpu = worst(&want, &f32_cpu);
        let moved_gpu = worst(&got, &f32_cpu);
        println!(
            "head_dim {hd}, {} tokens: mma vs CPU emulation {err:.2e}; \
             change from f32: cpu {moved_cpu:.2e}, cuda {moved_gpu:.2e}",
            p.len()
        );
        assert!(err <= 2e-2, "head_dim {hd}: {err:e}");
        assert!(moved_gpu > 0.0, "the mma kernel changed nothing");
    }
}

/// Two small models whose heads the tensor-core kernels take (the fixtures have head_dim 32,
/// for which they fall back to the SIMT kernels with bf16 roundings): GQA 8/2 at head_dim 64 and
/// 4/1 at 128, two layers, built in `dir`, each loaded on the CPU and the GPU (`None`, after
/// saying so, where no GPU can run them).
fn mma_models(dir: &Path) -> Option<Vec<(usize, Engine, Engine)>> {
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return None;
    }
    let models = [(64usize, 8usize, 2usize), (128, 4, 1)]
        .into_iter()
        .map(|(hd, heads, kv)| {
            let mut spec = tapedeck_engine::fixture::FixtureSpec::tiny_llama();
            spec.name = format!("mma-hd{hd}");
            spec.hidden_size = 256;
            spec.num_heads = heads;
            spec.num_kv_heads = kv;
            spec.head_dim = Some(hd);
            spec.num_layers = 2;
            let path = dir.join(&spec.name);
            tapedeck_engine::fixture::build(&spec, &path).unwrap();
            let load = |device| {
                Engine::load_with(
                    &path,
                    &EngineOptions {
                        threads: None,
                        device,
                    },
                )
                .unwrap()
            };
            (hd, load(Device::Cpu), load(Device::Cuda(0)))
        })
        .collect();
    Some(models)
}

#[test]
fn cuda_mma_bf16_prefill_kernel_on_head_dim_64_and_128() {
    // The tensor-core prefill kernel (attn_prefill=mma-bf16) against the CPU's emulation of its
    // roundings, over f32, bf16 and FP8 pools, whole prompts and prompts in chunks of 61 (ragged
    // tiles, K/V tiles that straddle a chunk start, one-token chunks when the length says so),
    // then decode steps on the KV it wrote. And it must move the logits: a kernel that silently
    // fell back to f32 would pass the bound alone.
    let dir = tempfile::tempdir().unwrap();
    let Some(models) = mma_models(dir.path()) else {
        return;
    };
    for (hd, cpu, gpu) in models {
        let mut r = rng();
        for kv in ["f32", "bf16", "fp8-e4m3"] {
            let p = tokens(&cpu, r.random_range(600..1500), &mut r);
            let d = tokens(&cpu, 8, &mut r);
            let base: Toggles = format!("kv_dtype={kv}").parse().unwrap();
            let t: Toggles = format!("kv_dtype={kv},attn_prefill=mma-bf16")
                .parse()
                .unwrap();
            let plain = run(&gpu, &p, &d, p.len(), &base);
            for chunk in [p.len(), 61] {
                let want = run(&cpu, &p, &d, chunk, &t);
                let got = run(&gpu, &p, &d, chunk, &t);
                let err = worst(&got, &want);
                let moved = worst(&got, &plain);
                println!(
                    "head_dim {hd}, kv_dtype={kv}, {} tokens in chunks of {chunk}: mma prefill vs \
                     CPU emulation {err:.2e}; change from the SIMT kernel {moved:.2e}",
                    p.len()
                );
                // FP8 K/V amplify every rounding difference (its bound vs the CPU is 5e-2 in
                // cuda_matches_cpu_on_both_fixtures_under_every_numeric_toggle too).
                let bound = if kv == "fp8-e4m3" { 5e-2 } else { 2e-2 };
                assert!(err <= bound, "head_dim {hd}, {kv}, chunk {chunk}: {err:e}");
                assert!(moved > 0.0, "the mma prefill kernel changed nothing");
            }
        }
    }
}

#[test]
fn cuda_picks_tokens_on_the_device_like_the_host() {
    // Greedy decoding and teacher forcing reduce the logits on the GPU (argmax, log-sum-exp,
    // entropy, top-k) and copy back only that. Against the host's reduction of the same logits
    // (copied back whole): the same token and alternatives, logprobs within 1e-6 (both sum in
    // f64; only the order of the partial sums differs), on a vocabulary of 35 partial chunks with
    // a ragged last one, in batches that mix picked, whole-row and no-logit segments.
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut spec = tapedeck_engine::fixture::FixtureSpec::tiny_llama();
    spec.name = "pick-70k".into();
    spec.model_vocab_size = Some(70_001);
    spec.num_layers = 2;
    let gpu = build_on_gpu(dir.path(), &spec);
    let vocab = gpu.config().vocab_size;
    assert_eq!(vocab, 70_001);
    let mut r = rng();
    let t = Toggles::default();
    let seqs: Vec<Vec<u32>> = (0..4).map(|i| tokens(&gpu, 5 + 17 * i, &mut r)).collect();
    let wants = |seq: usize| -> WantLogits {
        match seq {
            0 => WantLogits::Pick(Pick { k: 8, token: None }),
            1 => WantLogits::Pick(Pick {
                k: 3,
                token: Some(r_token(seq, vocab)),
            }),
            // More alternatives than the device keeps: picked on the host from copied rows.
            2 => WantLogits::Pick(Pick { k: 40, token: None }),
            _ => WantLogits::Pick(Pick { k: 0, token: None }),
        }
    };
    let run_batch = |want: &dyn Fn(usize) -> WantLogits| -> Vec<Logits> {
        let mut pool = gpu.backend().new_pool(16, 64, KvDtype::F32).unwrap();
        let mut tables: Vec<BlockTable> = Vec::new();
        let mut next = 0u32;
        for s in &seqs {
            let n = s.len().div_ceil(16) as u32;
            tables.push(BlockTable {
                blocks: (next..next + n).collect(),
                len: 0,
            });
            next += n;
        }
        let mut segs: Vec<Segment> = seqs
            .iter()
            .zip(tables.iter_mut())
            .enumerate()
            .map(|(i, (s, table))| Segment {
                tokens: s,
                table,
                decode: false,
                want: want(i),
                fault_chunk_boundary: false,
            })
            .collect();
        gpu.backend().forward(&mut pool, &mut segs, &t).unwrap()
    };
    let picked = run_batch(&wants);
    let rows = run_batch(&|_| WantLogits::Last);
    for (i, (got, row)) in picked.into_iter().zip(rows).enumerate() {
        let WantLogits::Pick(p) = wants(i) else {
            unreachable!()
        };
        let row = row.into_rows().unwrap();
        assert!(row.iter().all(|v| v.is_finite()));
        let want = Logits::pick(&row, p);
        let (
            Logits::Picked { token, summary },
            Logits::Picked {
                token: want_token,
                summary: want_summary,
            },
        ) = (got, want)
        else {
            panic!("segment {i} was not picked")
        };
        println!(
            "segment {i} ({p:?}): token {token} (host {want_token}), logprob {} vs {}, \
             entropy {} vs {}",
            summary.logprob, want_summary.logprob, summary.entropy, want_summary.entropy
        );
        assert_eq!(token, want_token, "segment {i}");
        assert!(
            (summary.logprob - want_summary.logprob).abs() <= 1e-6,
            "segment {i}"
        );
        assert!(
            (summary.entropy - want_summary.entropy).abs() <= 1e-5,
            "segment {i}"
        );
        assert_eq!(summary.top.len(), p.k, "segment {i}");
        for (a, b) in summary.top.iter().zip(&want_summary.top) {
            assert_eq!(a.0, b.0, "segment {i}: alternatives differ");
            assert!((a.1 - b.1).abs() <= 1e-6, "segment {i}");
        }
    }
}

/// A fixed token in the padded part of the vocabulary or not, per segment.
fn r_token(seq: usize, vocab: usize) -> u32 {
    ((seq * 7919 + 65_537) % vocab) as u32
}

/// Teacher-forced logprobs (top 4 alternatives) of `all[from..]`, one decode step per token, under
/// the toggles `t`.
fn forced_decode(
    e: &Engine,
    all: &[u32],
    from: usize,
    t: &str,
) -> Vec<tapedeck_engine::engine::TokenScore> {
    let t: Toggles = t.parse().unwrap();
    e.score_with(all, from, 4, &t, tapedeck_engine::engine::ScoreMode::Decode)
        .unwrap()
}

/// Whether two teacher-forced runs have the same logprob bits and the same alternatives, and the
/// largest logprob difference between them.
fn same_scores(
    a: &[tapedeck_engine::engine::TokenScore],
    b: &[tapedeck_engine::engine::TokenScore],
) -> (bool, f32) {
    let same = a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.logprob.to_bits() == y.logprob.to_bits()
                && x.top.iter().map(|t| t.0).eq(y.top.iter().map(|t| t.0))
        });
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x.logprob - y.logprob).abs())
        .fold(0.0f32, f32::max);
    (same, worst)
}

/// The two decode shapes the bit-identity tests build: head_dim 64 with GQA 8/2 (a down
/// projection split over 2 warps) and head_dim 128 with GQA 4/1 and q/k/v biases (split over 4).
fn decode_shapes(prefix: &str) -> [tapedeck_engine::fixture::FixtureSpec; 2] {
    let mut a = tapedeck_engine::fixture::FixtureSpec::tiny_llama();
    a.name = format!("{prefix}-hd64");
    (a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) = (256, 8, 2, Some(64));
    (a.num_layers, a.intermediate_size) = (2, 2560);
    let mut b = tapedeck_engine::fixture::FixtureSpec::tiny_qwen2();
    b.name = format!("{prefix}-hd128-bias");
    (b.hidden_size, b.num_heads, b.num_kv_heads, b.head_dim) = (512, 4, 1, Some(128));
    (b.num_layers, b.intermediate_size) = (2, 4608);
    [a, b]
}

#[test]
fn cuda_graphs_replay_what_eager_decode_computes() {
    // One sequence alone: a graph pass has the eager pass's shape (batch bucket 1), so the same
    // kernels run on the same inputs and teacher-forced logprobs must be identical, under every
    // toggle that changes the decode path (the mma kernel's split geometry follows the graph's
    // context bucket instead of the exact context, so it is compared to 1e-5 instead). The
    // contexts cross block-table buckets, so graphs are recaptured as they grow.
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut spec = tapedeck_engine::fixture::FixtureSpec::tiny_llama();
    spec.name = "graphs-hd64".into();
    spec.hidden_size = 256;
    spec.num_heads = 8;
    spec.num_kv_heads = 2;
    spec.head_dim = Some(64);
    spec.num_layers = 2;
    let gpu = Arc::new(build_on_gpu(dir.path(), &spec));
    let mut r = rng();
    let p = tokens(&gpu, r.random_range(20..60), &mut r);
    let forced = tokens(&gpu, 90, &mut r);
    let all = [p.clone(), forced].concat();
    for (toggles, bound) in [
        ("", 0.0),
        ("decode_topk=8", 0.0),
        ("kv_dtype=fp8-e4m3", 0.0),
        ("matmul=bf16,attn_scores=bf16", 0.0),
        ("matmul=bf16,small_gemm=gemv", 0.0),
        ("matmul=bf16,small_gemm=gemv,pdl=on", 0.0),
        ("matmul=bf16,small_gemm=gemv,pdl=all", 0.0),
        (
            "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=all",
            1e-5,
        ),
        ("pdl=all", 0.0),
        ("attn_decode=mma-bf16", 1e-5),
    ] {
        let score = |t: &str| forced_decode(&gpu, &all, p.len(), t);
        let eager = score(toggles);
        let graphs = score(format!("{toggles},cuda_graphs=on").trim_start_matches(','));
        let worst = eager
            .iter()
            .zip(&graphs)
            .map(|(a, b)| {
                assert_eq!(
                    a.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                    b.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                    "{toggles}: alternatives differ"
                );
                (a.logprob - b.logprob).abs()
            })
            .fold(0.0f32, f32::max);
        println!("{toggles:?}: graphs vs eager, worst |Δ logprob| {worst:e}");
        assert!(worst <= bound, "{toggles}: {worst:e} > {bound:e}");
        // Early launch changes only when kernels start: every bit must be the same as without it
        // (a kernel that read its input before its wait would race).
        for speed_only in ["pdl=on", "pdl=all"] {
            if !toggles.contains(speed_only) {
                continue;
            }
            let without = toggles
                .split(',')
                .filter(|t| *t != speed_only)
                .collect::<Vec<_>>()
                .join(",");
            let (same, _) = same_scores(&score(&without), &eager);
            println!("{toggles:?}: identical to [{without}]: {same}");
            assert!(same, "{toggles}: {speed_only} changed the logprobs");
        }
    }
}

#[test]
fn cuda_megakernel_is_bit_identical_to_the_separate_kernels() {
    // `megakernel=on` runs a one-sequence decode step as one persistent kernel whose phases call
    // the separate kernels' device functions over the same virtual blocks: every teacher-forced
    // logprob must have the same bits as without it (a missing barrier or a stale read would
    // show here), on head_dim 64 (GQA 8/2, a down projection split over 2 warps) and 128 (4/1,
    // q/k/v biases, split over 4), under the toggles the path takes, with graphs, with FP8
    // KV and with a bf16 pool (`decode_step_bf16kv`). The contexts (300-420 prompt + 90 forced tokens) span 3-4 attention splits of the
    // default 128-position floor, so the split merge runs too (run it also with
    // TAPEDECK_MMA_MERGE=in-kernel: the separate mma kernel then merges in its own 128-thread
    // blocks, the persistent kernel with the 256-thread combine, and the bits must agree). The
    // persistent step counter proves the kernel ran.
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for spec in decode_shapes("mk") {
        let gpu = build_on_gpu(dir.path(), &spec);
        let mut r = rng();
        let p = tokens(&gpu, r.random_range(300..420), &mut r);
        let forced = tokens(&gpu, 90, &mut r);
        let all = [p.clone(), forced].concat();
        let score = |t: &str| forced_decode(&gpu, &all, p.len(), t);
        let base = "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv";
        for extra in [
            "",
            ",cuda_graphs=on",
            ",kv_dtype=fp8-e4m3",
            ",kv_dtype=bf16",
            ",pdl=on",
        ] {
            let clustered = tapedeck_engine::cuda::cluster_merges();
            let plain = score(&format!("{base}{extra}"));
            if std::env::var("TAPEDECK_MMA_MERGE").as_deref() == Ok("cluster") {
                // The separate kernels' splits merged in their clusters (3-4 splits here).
                let n = tapedeck_engine::cuda::cluster_merges() - clustered;
                println!("{} [{base}{extra}]: {n} cluster-merged launches", spec.name);
                assert!(n > 0, "{} [{base}{extra}]: no cluster merge ran", spec.name);
            }
            let before = tapedeck_engine::cuda::persistent_steps();
            let mk = score(&format!("{base}{extra},megakernel=on"));
            let steps = tapedeck_engine::cuda::persistent_steps() - before;
            let (same, worst) = same_scores(&plain, &mk);
            println!(
                "{} [{base}{extra}] megakernel: {steps} persistent steps, identical: {same} \
                 (worst |Δ logprob| {worst:e})",
                spec.name
            );
            if extra.contains("fp8") {
                // The persistent kernel stages f32 or bf16 KV only: an FP8 pool keeps the
                // separate kernels.
                assert_eq!(
                    steps, 0,
                    "{}: the persistent kernel ran on FP8 KV",
                    spec.name
                );
            } else {
                assert!(
                    steps >= 80,
                    "{}: the persistent kernel ran {steps} times",
                    spec.name
                );
            }
            assert!(
                same,
                "{} [{base}{extra}]: megakernel=on changed the logprobs",
                spec.name
            );
        }
    }
}

/// Logit rows of `prompts.len()` sequences decoded together: each prompt prefilled (one pass),
/// then one pass per step with every sequence's next token of `steps` as a decode row, so the
/// decode kernels see several rows. Rows: per step, per sequence.
fn batched_decode(
    e: &Engine,
    prompts: &[Vec<u32>],
    steps: &[Vec<u32>],
    toggles: &Toggles,
) -> Vec<Vec<f32>> {
    batched_decode_in(e, prompts, steps, usize::MAX, toggles, toggles.kv_dtype)
}

/// [`batched_decode`] with the prompts prefilled together in chunks of `chunk` tokens (one pass
/// per chunk, every prompt with tokens left in it), in a pool storing `storage`.
fn batched_decode_in(
    e: &Engine,
    prompts: &[Vec<u32>],
    steps: &[Vec<u32>],
    chunk: usize,
    toggles: &Toggles,
    storage: KvDtype,
) -> Vec<Vec<f32>> {
    let bs = 16;
    let need: Vec<usize> = prompts
        .iter()
        .zip(steps)
        .map(|(p, s)| (p.len() + s.len()).div_ceil(bs))
        .collect();
    let mut pool = e
        .backend()
        .new_pool(bs, need.iter().sum(), storage)
        .unwrap();
    let mut next = 0u32;
    let mut tables: Vec<BlockTable> = need
        .iter()
        .map(|&n| {
            let mut t = BlockTable::default();
            t.blocks.extend(next..next + n as u32);
            next += n as u32;
            t
        })
        .collect();
    fn seg<'a>(
        tokens: &'a [u32],
        table: &'a mut BlockTable,
        decode: bool,
        want: WantLogits,
    ) -> Segment<'a> {
        Segment {
            tokens,
            table,
            decode,
            want,
            fault_chunk_boundary: false,
        }
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut at = 0;
    while at < longest {
        let mut segs: Vec<Segment> = prompts
            .iter()
            .zip(tables.iter_mut())
            .filter(|(p, _)| p.len() > at)
            .map(|(p, t)| {
                let piece = &p[at..p.len().min(at.saturating_add(chunk))];
                seg(piece, t, false, WantLogits::None)
            })
            .collect();
        e.backend().forward(&mut pool, &mut segs, toggles).unwrap();
        at = at.saturating_add(chunk);
    }
    let mut rows = Vec::new();
    for j in 0..steps[0].len() {
        let mut segs: Vec<Segment> = steps
            .iter()
            .zip(tables.iter_mut())
            .map(|(s, t)| seg(std::slice::from_ref(&s[j]), t, true, WantLogits::Last))
            .collect();
        for l in e.backend().forward(&mut pool, &mut segs, toggles).unwrap() {
            rows.push(l.into_rows().unwrap());
        }
    }
    rows
}

#[test]
fn cuda_packed_kv_pools_are_bit_identical_to_an_f32_pool() {
    // A kv_dtype=bf16 pool stores bf16 bits (the `_bf16kv` kernels), a kv_dtype=fp8-e4m3 pool
    // FP8 codes and a scale per position and KV head (`_fp8kv`), an f32 pool the same values as
    // f32: every kernel that writes or reads the cache must give the same logits bit for bit, at
    // a half / about a quarter of the bytes. Three sequences prefilled together in chunks of 48
    // (the tiled prefill kernel over context written by earlier chunks), then decoded together,
    // under the SIMT kernels, bf16 attention roundings, the sparse top-k path, the GEMV path,
    // graphs, the tensor-core decode kernel (for FP8 `decode_attn_mma_fp8kv`, which decodes
    // code * scale and rounds it to bf16 as the f32 pool's `_f32kv` variant rounds the stored
    // product), and for bf16 the fused q/k/v + RoPE + KV write GEMV; head_dim 64 (GQA 8/2) and
    // 128 (4/1, biases). Then the scheduler's pool: 2x / ~3.8x the blocks in the same budget, and
    // it says what it stores.
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let gemv = "matmul=bf16,small_gemm=gemv";
    let mma = "attn_decode=mma-bf16";
    for spec in decode_shapes("packedkv") {
        let gpu = Arc::new(build_on_gpu(dir.path(), &spec));
        let mut r = rng();
        let prompts: Vec<Vec<u32>> = [r.random_range(200..320), r.random_range(60..140), 17]
            .into_iter()
            .map(|n| tokens(&gpu, n, &mut r))
            .collect();
        let steps: Vec<Vec<u32>> = (0..3).map(|_| tokens(&gpu, 12, &mut r)).collect();
        for (dtype, name) in [(KvDtype::Bf16, "bf16"), (KvDtype::Fp8E4m3, "fp8-e4m3")] {
            let mut sets = vec![
                String::new(),
                ",attn_scores=bf16".into(),
                ",decode_topk=24".into(),
                format!(",{gemv},pdl=on"),
                format!(",{gemv},cuda_graphs=on"),
            ];
            sets.push(format!(",{mma},attn_scores=bf16"));
            sets.push(format!(",{gemv},{mma},cuda_graphs=on"));
            if dtype == KvDtype::Bf16 {
                sets.push(format!(",{gemv},{mma},fuse=on,pdl=on"));
            }
            sets.push(format!(",{gemv},{mma}"));
            for extra in &sets {
                let t: Toggles = format!("kv_dtype={name}{extra}").parse().unwrap();
                let wide = batched_decode_in(&gpu, &prompts, &steps, 48, &t, KvDtype::F32);
                let packed = batched_decode_in(&gpu, &prompts, &steps, 48, &t, dtype);
                let same = wide.len() == packed.len()
                    && wide.iter().zip(&packed).all(|(x, y)| {
                        x.iter()
                            .map(|v| v.to_bits())
                            .eq(y.iter().map(|v| v.to_bits()))
                    });
                let err = worst(&packed, &wide);
                println!(
                    "{} [kv_dtype={name}{extra}] {name} pool vs f32 pool: identical {same}, \
                     worst rel L2 {err:e}",
                    spec.name
                );
                assert!(
                    same,
                    "{} [{extra}]: the {name} pool changed the logits (worst rel L2 {err:e})",
                    spec.name
                );
            }
        }
        let start = |kv_dtype| {
            EngineHandle::start(
                gpu.clone(),
                SchedulerConfig {
                    kv_budget_bytes: 8 << 20,
                    kv_dtype,
                    ..Default::default()
                },
            )
            .unwrap()
        };
        let blocks = |h: &EngineHandle| {
            h.stats()
                .kv_blocks_total
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        let wide = start(KvDtype::F32);
        assert_eq!(wide.kv_storage(), KvDtype::F32);
        let hd = gpu.config().head_dim;
        for (dtype, per_head) in [(KvDtype::Bf16, 2 * hd), (KvDtype::Fp8E4m3, hd + 4)] {
            let packed = start(dtype);
            assert_eq!(packed.kv_storage(), dtype);
            let want = blocks(&wide) * 4 * hd / per_head;
            assert!(
                blocks(&packed).abs_diff(want) <= 4 * hd / per_head,
                "{}: {} {} blocks vs {} f32 blocks",
                spec.name,
                blocks(&packed),
                dtype.name(),
                blocks(&wide)
            );
        }
    }
}

#[test]
fn cuda_fused_decode_kernels_are_bit_identical_to_the_separate_ones() {
    // `fuse=on`: the q/k/v GEMV applies RoPE and writes the KV cache in its epilogue, and the o
    // GEMV merges the mma kernel's splits as it reads them. Same arithmetic in the same order as
    // the separate kernels, so every bit must agree: teacher-forced logprobs of one sequence
    // (head_dim 64 with GQA 8/2; head_dim 128 with q/k/v biases) under f32, bf16 and FP8 KV (FP8
    // keeps the separate RoPE kernel, the merge still fuses), graphs and PDL; then whole logit
    // rows of 2 and 3 sequences decoded together (the kernels' multi-row entry points). Contexts
    // of 300-420 positions span 3-4 splits of the mma kernel, so the merge has work. The fusion
    // counters prove that the fusions `TAPEDECK_FUSE` selects ran and the others did not (the
    // default leaves the merge out; run_engine_tests.sh runs this again with every fusion on).
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv";
    let same_bits = |x: &[f32], y: &[f32]| {
        x.iter()
            .map(|v| v.to_bits())
            .eq(y.iter().map(|v| v.to_bits()))
    };
    for spec in decode_shapes("fuse") {
        let gpu = build_on_gpu(dir.path(), &spec);
        let mut r = rng();
        let p = tokens(&gpu, r.random_range(300..420), &mut r);
        let forced = tokens(&gpu, 60, &mut r);
        let all = [p.clone(), forced].concat();
        let score = |t: &str| forced_decode(&gpu, &all, p.len(), t);
        for extra in [
            "",
            ",cuda_graphs=on",
            ",kv_dtype=bf16",
            ",kv_dtype=fp8-e4m3",
            ",pdl=all",
            ",pdl=on,cuda_graphs=on,kv_dtype=bf16",
        ] {
            let plain = score(&format!("{base}{extra}"));
            let (rope0, merge0) = tapedeck_engine::cuda::fused_layers();
            let mlp0 = tapedeck_engine::cuda::fused_mlp_layers();
            let fused = score(&format!("{base}{extra},fuse=on"));
            let (rope1, merge1) = tapedeck_engine::cuda::fused_layers();
            let mlp = tapedeck_engine::cuda::fused_mlp_layers() - mlp0;
            let (same, worst) = same_scores(&plain, &fused);
            let (rope, merge) = (rope1 - rope0, merge1 - merge0);
            println!(
                "{} [{base}{extra}] fuse=on: {rope} layers with RoPE fused, {merge} with the merge \
                 fused, {mlp} with the MLP as one grid; identical: {same} (worst |Δ logprob| \
                 {worst:e})",
                spec.name
            );
            // The MLP fusion is opt-in (TAPEDECK_FUSE=...,mlp): every one-row layer takes it.
            if tapedeck_engine::cuda::mlp_fusion_in_effect() {
                assert!(mlp >= 2, "{}{extra}: the MLP never fused", spec.name);
            } else {
                assert_eq!(mlp, 0, "{}{extra}: the MLP fused though off", spec.name);
            }
            // What `fuse=on` applies here (TAPEDECK_FUSE; the default leaves the merge out, so
            // the device scripts run this test a second time with TAPEDECK_FUSE=rope,merge,head).
            let (want_rope, want_merge, _) = tapedeck_engine::cuda::fusions_in_effect();
            if want_merge {
                // The o GEMV merges the splits of every tensor-core kernel, FP8's included.
                assert!(merge >= 2, "{}{extra}: the merge never fused", spec.name);
            } else {
                assert_eq!(merge, 0, "{}{extra}: the merge fused though off", spec.name);
            }
            if extra.contains("fp8") || !want_rope {
                // FP8 KV keeps the RoPE kernel (its scale needs the whole head).
                assert_eq!(rope, 0, "{}{extra}: the RoPE kernel must stay", spec.name);
            } else {
                assert!(rope >= 2, "{}{extra}: RoPE never fused", spec.name);
            }
            assert!(
                same,
                "{} [{base}{extra}]: fuse=on changed the logprobs",
                spec.name
            );
        }
        for (n, kv) in [(2, ""), (3, ",kv_dtype=bf16")] {
            let prompts: Vec<Vec<u32>> = (0..n)
                .map(|_| tokens(&gpu, r.random_range(150..420), &mut r))
                .collect();
            let steps: Vec<Vec<u32>> = (0..n).map(|_| tokens(&gpu, 5, &mut r)).collect();
            let t = |f: &str| format!("{base}{kv}{f}").parse::<Toggles>().unwrap();
            let plain = batched_decode(&gpu, &prompts, &steps, &t(""));
            let (_, merge0) = tapedeck_engine::cuda::fused_layers();
            let mlp0 = tapedeck_engine::cuda::fused_mlp_layers();
            let fused = batched_decode(&gpu, &prompts, &steps, &t(",fuse=on"));
            let (_, merge1) = tapedeck_engine::cuda::fused_layers();
            // The MLP grid has entry points for 1-2 rows: 2 sequences take it, 3 do not.
            let mlp = tapedeck_engine::cuda::fused_mlp_layers() - mlp0;
            let want_mlp = tapedeck_engine::cuda::mlp_fusion_in_effect() && n <= 2;
            assert_eq!(
                mlp > 0,
                want_mlp,
                "{} {n} sequences: {mlp} layers with the MLP as one grid",
                spec.name
            );
            let same = plain.iter().zip(&fused).all(|(x, y)| same_bits(x, y));
            println!(
                "{} {n} sequences{kv}: fuse=on identical: {same}, worst rel L2 {:e}",
                spec.name,
                worst(&fused, &plain)
            );
            if tapedeck_engine::cuda::fusions_in_effect().1 {
                assert!(
                    merge1 - merge0 >= 2,
                    "{}: the batched merge never fused",
                    spec.name
                );
            } else {
                assert_eq!(merge1, merge0, "{}: the merge fused though off", spec.name);
            }
            assert!(
                same,
                "{} {n} sequences{kv}: fuse=on changed the logits",
                spec.name
            );
        }
    }
}

#[test]
fn cuda_llama_1b_logits_match_the_cpu_engine() {
    // Full-model check on the Llama-3.2-1B-shaped random bf16 model (16 layers, hidden 2048,
    // 32/8 heads of 64, 128k vocabulary): prefill and decode logits of the CUDA backend against
    // the CPU engine, f32 (≤ 1e-4 relative L2) and with the bf16 kernels (≤ 5e-2: the fixtures'
    // 2e-2 bf16 bound is for 2-4 layers; one flipped bf16 rounding cascades through 16 here, and
    // the H200 measured 2.3e-2 against the CPU's emulation of the same roundings). The model is
    // 2.5 GB, so this runs only where it was generated (`tapedeck bench engine --model llama-1b`
    // writes it; `bench/cuda/run_engine_tests.sh` then sets TAPEDECK_LLAMA1B to its folder).
    let Some(dir) = std::env::var_os("TAPEDECK_LLAMA1B") else {
        println!("SKIPPED: set TAPEDECK_LLAMA1B to the llama-1b model folder to run this");
        return;
    };
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return;
    }
    let load = |device| {
        Engine::load_with(
            Path::new(&dir),
            &EngineOptions {
                threads: None,
                device,
            },
        )
        .unwrap()
    };
    let (cpu, gpu) = (load(Device::Cpu), load(Device::Cuda(0)));
    let mut r = rng();
    let p = tokens(&cpu, 150, &mut r);
    let d = tokens(&cpu, 6, &mut r);
    for (toggles, bound) in [
        ("", 1e-4),
        ("matmul=bf16,attn_decode=mma-bf16", 5e-2),
        ("matmul=bf16,attn_decode=mma-bf16,cuda_graphs=on", 5e-2),
        (
            "matmul=bf16,attn_decode=mma-bf16,attn_prefill=mma-bf16",
            5e-2,
        ),
        (
            "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=on,cuda_graphs=on",
            5e-2,
        ),
        (
            "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,pdl=all,cuda_graphs=on",
            5e-2,
        ),
        (
            "matmul=bf16,attn_decode=mma-bf16,small_gemm=gemv,megakernel=on,cuda_graphs=on",
            5e-2,
        ),
    ] {
        let t: Toggles = toggles.parse().unwrap();
        let want = run(&cpu, &p, &d, 64, &t);
        let got = run(&gpu, &p, &d, 64, &t);
        let err = worst(&got, &want);
        println!(
            "llama-1b [{toggles}] {}+{} tokens, chunks of 64: max rel L2 {err:.2e} (bound {bound:e})",
            p.len(),
            d.len()
        );
        assert!(err <= bound, "{toggles}: {err:e}");
    }
}

#[test]
fn cuda_running_ahead_gives_the_tokens_of_one_step_at_a_time() {
    // `generate` on the GPU enqueues each decode step before reading the token of the one in
    // flight, and the step reads that token on the device (`embed_tokens`). Same kernels, same
    // inputs: every bit must match stepping one at a time, eager or graphs, with the fastest
    // set, however generation ends. Two requests on one engine from two threads interleave
    // their passes, so a step's feed is sometimes not the pass before it: the backend must then
    // read the token back first, with the same result.
    if let Err(e) = probe() {
        println!("SKIPPED: no usable GPU here ({e})");
        return;
    }
    let load = |ahead: bool| {
        let mut e = Engine::load_with(
            &fixture("tiny-llama"),
            &EngineOptions {
                threads: None,
                device: Device::Cuda(0),
            },
        )
        .expect("fixture loads");
        e.set_run_ahead(ahead);
        Arc::new(e)
    };
    let (plain, ahead) = (load(false), load(true));
    let mut r = rng();
    let greedy = |prompt: Vec<u32>, toggles: &str, max_tokens: usize| GenerateRequest {
        prompt,
        sampling: SamplingParams::default(),
        stop: StopCriteria {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
        top_k_summary: 4,
        toggles: toggles.parse().unwrap(),
    };
    let same_bits = |a: &GenerateOutput, b: &GenerateOutput, what: &str| {
        assert_eq!(a.tokens, b.tokens, "{what}: tokens");
        assert_eq!(a.finish_reason, b.finish_reason, "{what}: finish");
        for (i, (x, y)) in a.summaries.iter().zip(&b.summaries).enumerate() {
            assert_eq!(
                x.logprob.to_bits(),
                y.logprob.to_bits(),
                "{what}: logprob {i}"
            );
            assert_eq!(x.top, y.top, "{what}: alternatives {i}");
        }
    };
    for toggles in [
        "",
        "cuda_graphs=on",
        "preset=gpu-fast",
        "preset=gpu-fast,megakernel=on",
    ] {
        let req = greedy(tokens(&plain, r.random_range(20..90), &mut r), toggles, 40);
        let want = plain.generate(&req, &mut |_| true).unwrap();
        let got = ahead.generate(&req, &mut |_| true).unwrap();
        same_bits(&want, &got, toggles);
        // Ends at a stop token mid-way, with the step ahead discarded; then the same engine
        // serves the next request as if nothing had run ahead.
        let mut stopped = req.clone();
        stopped.stop.stop_token_ids = vec![want.tokens[10]];
        let a = plain.generate(&stopped, &mut |_| true).unwrap();
        let b = ahead.generate(&stopped, &mut |_| true).unwrap();
        same_bits(&a, &b, &format!("{toggles}, stop token"));
        same_bits(
            &want,
            &ahead.generate(&req, &mut |_| true).unwrap(),
            toggles,
        );
        // Two requests at once on the engine that runs ahead.
        let other = greedy(tokens(&plain, 33, &mut r), toggles, 40);
        let want_other = plain.generate(&other, &mut |_| true).unwrap();
        let (x, y) = std::thread::scope(|s| {
            let e = &ahead;
            let h = s.spawn(|| e.generate(&other, &mut |_| true).unwrap());
            (e.generate(&req, &mut |_| true).unwrap(), h.join().unwrap())
        });
        same_bits(&want, &x, &format!("{toggles}, concurrent"));
        same_bits(&want_other, &y, &format!("{toggles}, concurrent other"));
        // The scheduler runs a lone greedy sequence ahead too: the same bits as its one pass
        // at a time, at max_tokens and at a stop token.
        let sched = |e: &Arc<Engine>| {
            EngineHandle::start(
                e.clone(),
                SchedulerConfig {
                    kv_budget_bytes: 64 << 20,
                    kv_dtype: req.toggles.kv_dtype,
                    ..Default::default()
                },
            )
            .unwrap()
        };
        let (hp, ha) = (sched(&plain), sched(&ahead));
        for (r, what) in [(&req, "scheduler"), (&stopped, "scheduler, stop token")] {
            let a = collect(hp.submit(r.clone()).unwrap());
            let b = collect(ha.submit(r.clone()).unwrap());
            same_bits(&a, &b, &format!("{toggles}, {what}"));
        }
        let ran = |h: &EngineHandle| {
            h.stats()
                .steps_ahead
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        assert!(
            ran(&ha) > 0,
            "{toggles}: the scheduler never ran a step ahead"
        );
        assert_eq!(ran(&hp), 0, "{toggles}: run-ahead was off");
        println!("{toggles:?}: running ahead gives the same bits (generate and the scheduler)");
    }
}

//! `tapedeck bench gemv`: the few-token bf16 GEMV kernels (`small_gemm=gemv`) against the cuBLAS
//! path they replace, on the linear layers of Llama-3.2-1B, as time and weight-read bandwidth.
//! What batch-1 decode spends on weights is the sum over a layer's matrices, times 16 layers,
//! plus the head; the table ends with that sum as a tokens/s ceiling for each path.

use anyhow::{bail, Result};
use clap::Args;
use rand::{Rng, SeedableRng};
use tapedeck_engine::backend::Device;
use tapedeck_engine::cuda::check::{gemv, swiglu, GemvCase, KernelRun, SwigluCase};

/// Arguments of `tapedeck bench gemv`.
#[derive(Args, Debug)]
pub struct GemvBenchArgs {
    /// The GPU: `cuda` or `cuda:N`.
    #[arg(long, default_value = "cuda")]
    pub device: Device,
    /// Token rows per product (1 to 4).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2, 4])]
    pub rows: Vec<usize>,
    /// Timed launches per measurement.
    #[arg(long, default_value_t = 200)]
    pub reps: usize,
}

/// One linear layer of the model: name, output and input features, how many per layer (0 for
/// the head, once per token), and the kind of launch.
struct Shape {
    name: &'static str,
    out: usize,
    inp: usize,
    per_layer: usize,
    kind: Kind,
}

#[derive(Clone, Copy)]
enum Kind {
    /// bf16 input, stored.
    Plain,
    /// The f32 residual stream, RMS-normalized by the kernel, stored (one launch for q, k, v:
    /// their rows stacked).
    Normed,
    /// f32 input (rounded by the kernel), added to the residual stream.
    F32InAdd,
    /// bf16 input, added to the residual stream.
    Add,
    /// Gate and up fused with SiLU·up (`out` features each).
    GateUp,
}

const LAYERS: usize = 16;

fn shapes() -> Vec<Shape> {
    let s = |name, out, inp, per_layer, kind| Shape {
        name,
        out,
        inp,
        per_layer,
        kind,
    };
    vec![
        s("rmsnorm+q,k,v", 3072, 2048, 1, Kind::Normed),
        s("o_proj + residual", 2048, 2048, 1, Kind::F32InAdd),
        s("gate+up+silu", 8192, 2048, 1, Kind::GateUp),
        s("down_proj + residual", 2048, 8192, 1, Kind::Add),
        s("lm_head", 128256, 2048, 0, Kind::Plain),
    ]
}

/// Runs the benchmark and prints the table.
pub fn run(args: GemvBenchArgs) -> Result<()> {
    let Device::Cuda(ordinal) = args.device else {
        bail!("bench gemv runs on a GPU: pass --device cuda[:N]");
    };
    if let Some(&n) = args.rows.iter().find(|&&n| n == 0 || n > 4) {
        bail!("--rows takes 1 to 4 (got {n})");
    }
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
    let mut randn =
        |len: usize| -> Vec<f32> { (0..len).map(|_| r.random_range(-1.0f32..1.0)).collect() };
    println!("bf16 GEMV (small_gemm=gemv) vs the cuBLAS path, Llama-3.2-1B linear layers, {} reps, weights cycled past L2", args.reps);
    println!(
        "{:<22} {:>13} {:>4} {:>10} {:>8} {:>12} {:>8} {:>7}  streaming kernels (TAPEDECK_GEMV_STREAM=K): us (GB/s)",
        "matrix", "out x in", "rows", "ours us", "GB/s", "cuBLAS us", "GB/s", "speedup"
    );
    let norm_w: Vec<f32> = (0..2048).map(|i| 1.0 + (i % 7) as f32 * 0.01).collect();
    let mut per_token: Vec<(usize, f64, f64)> = args.rows.iter().map(|&n| (n, 0.0, 0.0)).collect();
    for sh in shapes() {
        let mats = if matches!(sh.kind, Kind::GateUp) {
            2
        } else {
            1
        };
        let w = randn(sh.out * sh.inp);
        let w2 = if mats == 2 {
            randn(sh.out * sh.inp)
        } else {
            Vec::new()
        };
        for (i, &n) in args.rows.iter().enumerate() {
            let x = randn(n * sh.inp);
            let run: KernelRun = match sh.kind {
                Kind::GateUp => {
                    let case = SwigluCase {
                        wg: &w,
                        wu: &w2,
                        inter: sh.out,
                        inp: sh.inp,
                        x: &x,
                        n,
                    };
                    swiglu(ordinal, &case, args.reps)?
                }
                kind => {
                    let residual = randn(n * sh.out);
                    let add = matches!(kind, Kind::Add | Kind::F32InAdd);
                    let case = GemvCase {
                        w: &w,
                        out: sh.out,
                        inp: sh.inp,
                        bias: None,
                        x: &x,
                        n,
                        x_f32: matches!(kind, Kind::F32InAdd),
                        norm: matches!(kind, Kind::Normed).then_some((&norm_w[..], 1e-5)),
                        residual: add.then_some(&residual[..]),
                    };
                    gemv(ordinal, &case, args.reps)?
                }
            };
            let bytes = (mats * sh.out * sh.inp * 2) as f64;
            let gbs = |us: f64| bytes / (us * 1e3);
            let streamed: Vec<String> = run
                .stream
                .iter()
                .map(|(k, _, us)| format!("K={k} {us:.2} ({:.0})", gbs(*us)))
                .collect();
            println!(
                "{:<22} {:>13} {:>4} {:>10.2} {:>8.0} {:>12.2} {:>8.0} {:>6.2}x  {}",
                sh.name,
                format!("{}x{}", sh.out, sh.inp),
                n,
                run.ours_us,
                gbs(run.ours_us),
                run.cublas_us,
                gbs(run.cublas_us),
                run.cublas_us / run.ours_us,
                streamed.join(", ")
            );
            let times = if sh.per_layer == 0 {
                1
            } else {
                sh.per_layer * LAYERS
            };
            per_token[i].1 += run.ours_us * times as f64;
            per_token[i].2 += run.cublas_us * times as f64;
        }
    }
    println!(
        "\nall weights once (16 layers + head): the decode-step ceiling from linear layers alone"
    );
    for (n, ours, cublas) in per_token {
        println!(
            "  {n} rows: ours {:.0} us ({:.0} steps/s), cuBLAS path {:.0} us ({:.0} steps/s)",
            ours,
            1e6 / ours,
            cublas,
            1e6 / cublas
        );
    }
    Ok(())
}

//! Prints the GFLOP/s of the engine's matrix product at decode and prefill shapes.
//!
//! `cargo run --release -p tapedeck-engine --example matmul_speed`

use std::time::Instant;

use tapedeck_engine::numerics::matmul_t;

fn main() {
    for &(n, k, m) in &[
        (1, 768, 2048),
        (1, 768, 768),
        (4, 768, 2048),
        (64, 768, 2048),
        (256, 768, 2048),
    ] {
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let w: Vec<f32> = (0..m * k)
            .map(|i| ((i * 104729) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let mut out = vec![0.0f32; n * m];
        matmul_t(&x, &w, None, n, k, m, &mut out);
        let reps = (200_000_000 / (n * k * m)).max(3);
        let t = Instant::now();
        for _ in 0..reps {
            matmul_t(&x, &w, None, n, k, m, &mut out);
        }
        let s = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "n={n:4} k={k} m={m}: {:8.1} µs  {:6.1} GFLOP/s  {:6.1} GB/s weights",
            s * 1e6,
            2.0 * (n * k * m) as f64 / s / 1e9,
            (m * k * 4) as f64 / s / 1e9
        );
    }
}

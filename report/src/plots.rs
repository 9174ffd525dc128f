//! SVG plots for the HTML report, drawn with `plotters` into strings.
//!
//! Each function returns one complete `<svg>` element. Text uses a font-family name only, so the
//! page stays self-contained (the browser picks a local sans-serif font).

use plotters::coord::Shift;
use plotters::prelude::*;
use tapedeck_replayer::metrics::{BucketDrift, Latency, LatencySummary};

use crate::error::{Error, Result};
use crate::render::Timeline;

type PResult = std::result::Result<(), Box<dyn std::error::Error>>;

const FONT: &str = "sans-serif";
const PALETTE: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

fn render_svg(
    plot: &str,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend<'_>, Shift>) -> PResult,
) -> Result<String> {
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, size).into_drawing_area();
        let drawn = root
            .fill(&WHITE)
            .map_err(|e| -> Box<dyn std::error::Error> { Box::new(e) })
            .and_then(|_| draw(&root))
            .and_then(|_| root.present().map_err(|e| e.into()));
        drawn.map_err(|e| Error::Plot {
            plot: plot.to_string(),
            message: e.to_string(),
        })?;
    }
    Ok(buf)
}

fn no_data(area: &DrawingArea<SVGBackend<'_>, Shift>, title: &str) -> PResult {
    let (w, h) = area.dim_in_pixel();
    area.draw(&Text::new(
        title.to_string(),
        (10, 10),
        (FONT, 16).into_font().color(&BLACK),
    ))?;
    area.draw(&Text::new(
        "no data".to_string(),
        (w as i32 / 2 - 25, h as i32 / 2),
        (FONT, 14).into_font().color(&RGBColor(120, 120, 120)),
    ))?;
    Ok(())
}

/// `x` nines → percentile label: 0 → 0%, 1 → 90%, 2 → 99%, 3 → 99.9%.
fn pct_label(x: f64) -> String {
    let p = 100.0 * (1.0 - 10f64.powf(-x));
    if p >= 99.0 {
        format!("{p:.1}%")
    } else {
        format!("{p:.0}%")
    }
}

/// The latency percentile curve of a histogram: percentile on x (log-scaled in "nines", so the
/// tail is readable), latency on y. Points come from the HDR histogram itself, not the summary's
/// six percentiles.
pub fn latency_curve(title: &str, summary: &LatencySummary) -> Result<String> {
    let hist = if summary.hdr.is_empty() {
        None
    } else {
        Some(Latency::decode(&summary.hdr).map_err(|e| Error::Histogram {
            metric: title.to_string(),
            message: e.to_string(),
        })?)
    };
    let points: Vec<(f64, f64)> = match &hist {
        Some(h) if !h.histogram().is_empty() => (0..=150)
            .map(|i| {
                let x = f64::from(i) * 0.02;
                let q = 1.0 - 10f64.powf(-x);
                (x, h.histogram().value_at_quantile(q) as f64 / 1000.0)
            })
            .collect(),
        _ => Vec::new(),
    };
    render_svg(title, (400, 280), |root| {
        if points.is_empty() {
            return no_data(root, title);
        }
        let ymax = points.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-3) * 1.1;
        let mut chart = ChartBuilder::on(root)
            .caption(title, (FONT, 16))
            .margin(10)
            .margin_right(24)
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d(0f64..3f64, 0f64..ymax)?;
        chart
            .configure_mesh()
            .x_labels(4)
            .x_label_formatter(&|x| pct_label(*x))
            .y_desc("ms")
            .x_desc("percentile")
            .light_line_style(RGBColor(235, 235, 235))
            .draw()?;
        chart.draw_series(LineSeries::new(
            points.iter().copied(),
            PALETTE[0].stroke_width(2),
        ))?;
        // Mark the reported percentiles.
        let marks = [
            (0.301, summary.p50_ms),
            (1.0, summary.p90_ms),
            (2.0, summary.p99_ms),
            (3.0, summary.p999_ms),
        ];
        chart.draw_series(
            marks
                .iter()
                .map(|&(x, y)| Circle::new((x, y), 3, PALETTE[1].filled())),
        )?;
        Ok(())
    })
}

/// Completed turns and output tokens per second over the run, as bars per time bin.
pub fn throughput(tl: &Timeline) -> Result<String> {
    let title = "Throughput over time";
    render_svg("throughput", (820, 360), |root| {
        if tl.bins.is_empty() {
            return no_data(root, title);
        }
        let root = root.titled(&format!("{title} ({})", tl.source), (FONT, 16))?;
        let panels = root.split_evenly((1, 2));
        let end = tl.bins.last().map_or(1.0, |b| b.start_s + tl.bin_s);
        let series: [(&str, Vec<f64>); 2] = [
            (
                "output tokens/s",
                tl.bins
                    .iter()
                    .map(|b| b.output_tokens as f64 / tl.bin_s)
                    .collect(),
            ),
            (
                "turns/s",
                tl.bins.iter().map(|b| b.turns as f64 / tl.bin_s).collect(),
            ),
        ];
        for (i, (area, (name, ys))) in panels.iter().zip(series).enumerate() {
            let ymax = ys.iter().copied().fold(0.0, f64::max).max(1e-6) * 1.15;
            let mut chart = ChartBuilder::on(area)
                .margin(10)
                .x_label_area_size(35)
                .y_label_area_size(55)
                .caption(name, (FONT, 14))
                .build_cartesian_2d(0f64..end, 0f64..ymax)?;
            chart
                .configure_mesh()
                .x_desc("seconds since start")
                .light_line_style(RGBColor(235, 235, 235))
                .draw()?;
            let color = PALETTE[i];
            chart.draw_series(tl.bins.iter().zip(&ys).map(|(b, &y)| {
                Rectangle::new(
                    [(b.start_s, 0.0), (b.start_s + tl.bin_s * 0.9, y)],
                    color.mix(0.7).filled(),
                )
            }))?;
        }
        Ok(())
    })
}

/// Drift against absolute context position: mean |Δlogprob|, mean KL and top-1 agreement per
/// bucket, three panels sharing the bucket axis.
pub fn drift(buckets: &[BucketDrift]) -> Result<String> {
    let title = "Fidelity drift by context position";
    let b: Vec<&BucketDrift> = buckets.iter().filter(|b| b.drift.positions > 0).collect();
    render_svg("drift", (1000, 330), |root| {
        if b.is_empty() {
            return no_data(root, title);
        }
        let root = root.titled(title, (FONT, 16))?;
        let panels = root.split_evenly((1, 3));
        let labels: Vec<String> = b.iter().map(|x| x.bucket.clone()).collect();
        type Metric = (&'static str, fn(&BucketDrift) -> f64, Option<(f64, f64)>);
        let metrics: [Metric; 3] = [
            (
                "mean |Δlogprob| (nats)",
                |x| x.drift.abs_dlogprob.mean,
                None,
            ),
            ("mean KL (nats)", |x| x.drift.kl.mean, None),
            (
                "top-1 agreement",
                |x| x.drift.top1_agreement,
                Some((0.0, 1.05)),
            ),
        ];
        let n = b.len() as f64;
        for (i, (area, (name, f, range))) in panels.iter().zip(metrics).enumerate() {
            let ys: Vec<f64> = b.iter().map(|x| f(x)).collect();
            let (lo, hi) =
                range.unwrap_or((0.0, ys.iter().copied().fold(0.0, f64::max).max(1e-6) * 1.2));
            let mut chart = ChartBuilder::on(area)
                .margin(12)
                .caption(name, (FONT, 14))
                .x_label_area_size(35)
                .y_label_area_size(55)
                .build_cartesian_2d(-0.5f64..(n - 0.5), lo..hi)?;
            let labels = labels.clone();
            chart
                .configure_mesh()
                .x_labels(b.len().max(2))
                .x_label_formatter(&move |x| {
                    let r = x.round();
                    if (x - r).abs() < 1e-6 && r >= 0.0 {
                        labels.get(r as usize).cloned().unwrap_or_default()
                    } else {
                        String::new()
                    }
                })
                .x_desc("context position (tokens)")
                .light_line_style(RGBColor(235, 235, 235))
                .draw()?;
            let color = PALETTE[i];
            let pts: Vec<(f64, f64)> = ys.iter().enumerate().map(|(k, &y)| (k as f64, y)).collect();
            chart.draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?;
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        Ok(())
    })
}

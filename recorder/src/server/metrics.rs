//! Prometheus metrics, rendered in the text exposition format.
//!
//! A few counters, gauges and fixed-bucket histograms are all `/metrics` needs, so they are kept
//! here with atomics instead of a global metrics registry: every [`crate::server::AppState`] owns
//! its own set, which keeps tests that run several servers in one process independent.
//! Names follow vLLM's where one exists (`time_to_first_token_seconds`, ...), under `tapedeck_`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::backend::{CacheStats, Load};
use crate::writer::WriterStats;

/// A histogram with fixed upper bounds (seconds); the sum is kept in microseconds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_us: AtomicU64,
}

const LATENCY_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|&b| s <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, n) in self.bounds.iter().zip(&self.buckets) {
            cum += n.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// The server's metrics.
#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between consecutive tokens.
    pub itl: Histogram,
    /// Arrival to end.
    pub e2e: Histogram,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    disconnects: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            ttft: Histogram::new(LATENCY_BOUNDS),
            itl: Histogram::new(LATENCY_BOUNDS),
            e2e: Histogram::new(LATENCY_BOUNDS),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            disconnects: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// Counts a finished request.
    pub fn request_done(&self, endpoint: &str, status: u16, prompt: usize, completion: usize) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint.to_string(), status)).or_insert(0) += 1;
        }
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
    }

    /// Counts a client that went away before its response was complete.
    pub fn client_disconnected(&self) {
        self.disconnects.fetch_add(1, Ordering::Relaxed);
    }

    /// The text exposition, with the backend's load and the writer's counters as of now.
    pub fn render(&self, load: Load, cache: Option<CacheStats>, writer: WriterStats) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let _ = writeln!(
            out,
            "# HELP tapedeck_requests_total Finished HTTP requests by endpoint and status.\n\
             # TYPE tapedeck_requests_total counter"
        );
        if let Ok(m) = self.requests.lock() {
            for ((endpoint, status), n) in m.iter() {
                let _ = writeln!(
                    out,
                    "tapedeck_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
                );
            }
        }
        counter(
            &mut out,
            "tapedeck_prompt_tokens_total",
            "Prompt tokens processed.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "tapedeck_generation_tokens_total",
            "Tokens generated.",
            self.completion_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "tapedeck_client_disconnects_total",
            "Requests whose client went away before the end.",
            self.disconnects.load(Ordering::Relaxed),
        );
        self.ttft.render(
            &mut out,
            "tapedeck_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
        );
        self.itl.render(
            &mut out,
            "tapedeck_inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
        );
        self.e2e.render(
            &mut out,
            "tapedeck_e2e_request_latency_seconds",
            "Time from arrival to the end of the response.",
        );
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        gauge(
            &mut out,
            "tapedeck_requests_running",
            "Requests generating now.",
            load.running as u64,
        );
        gauge(
            &mut out,
            "tapedeck_requests_waiting",
            "Requests waiting for the engine.",
            load.queued as u64,
        );
        if let Some(c) = cache {
            counter(
                &mut out,
                "tapedeck_prefix_cache_hit_tokens_total",
                "Prompt tokens served from the prefix cache.",
                c.prefix_hit_tokens,
            );
            counter(
                &mut out,
                "tapedeck_prefill_tokens_total",
                "Prompt tokens that had to be prefilled.",
                c.prefill_tokens,
            );
            counter(
                &mut out,
                "tapedeck_decode_steps_ahead_total",
                "Decode steps submitted before the step ahead of them was collected (a lone greedy sequence on a GPU).",
                c.decode_steps_ahead,
            );
            gauge(
                &mut out,
                "tapedeck_kv_blocks_used",
                "KV cache blocks in use.",
                c.kv_blocks_used,
            );
            gauge(
                &mut out,
                "tapedeck_kv_blocks_total",
                "KV cache blocks in the pool.",
                c.kv_blocks_total,
            );
            gauge(
                &mut out,
                "tapedeck_kv_pool_bytes",
                "Bytes of the KV cache pool.",
                c.kv_pool_bytes,
            );
            if let Some(storage) = c.kv_storage {
                let name = "tapedeck_kv_cache_info";
                let _ = writeln!(
                    out,
                    "# HELP {name} The KV cache's storage type (label), always 1.\n\
                     # TYPE {name} gauge\n{name}{{storage=\"{}\"}} 1",
                    storage.name()
                );
            }
            if let Some((busy, passes)) = c.device_busy {
                let name = "tapedeck_device_busy_seconds_total";
                let _ = writeln!(
                    out,
                    "# HELP {name} Accelerator time spent in forward passes (its rate is the busy fraction).\n\
                     # TYPE {name} counter\n{name} {}",
                    busy.as_secs_f64()
                );
                counter(
                    &mut out,
                    "tapedeck_device_forward_passes_total",
                    "Forward passes run on the accelerator.",
                    passes,
                );
            }
        }
        gauge(
            &mut out,
            "tapedeck_recorder_queue_depth",
            "Records waiting to be written.",
            writer.depth,
        );
        gauge(
            &mut out,
            "tapedeck_recorder_queue_capacity",
            "Capacity of the record queue.",
            writer.capacity,
        );
        counter(
            &mut out,
            "tapedeck_recorder_records_written_total",
            "Records committed to the database.",
            writer.written,
        );
        counter(
            &mut out,
            "tapedeck_recorder_records_dropped_total",
            "Records dropped because the queue was full or closed.",
            writer.dropped,
        );
        counter(
            &mut out,
            "tapedeck_recorder_records_failed_total",
            "Records lost because their transaction failed.",
            writer.failed,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, name: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .map(|v| v.parse().unwrap())
    }

    #[test]
    fn device_time_shows_only_where_the_engine_has_a_device() {
        let m = Metrics::default();
        let cache = CacheStats {
            prefill_tokens: 7,
            decode_steps_ahead: 5,
            kv_pool_bytes: 3 << 20,
            kv_storage: Some(tapedeck_engine::toggles::KvDtype::Bf16),
            ..Default::default()
        };
        let cpu = m.render(Load::default(), Some(cache), WriterStats::default());
        assert_eq!(value(&cpu, "tapedeck_prefill_tokens_total"), Some(7.0));
        assert_eq!(value(&cpu, "tapedeck_decode_steps_ahead_total"), Some(5.0));
        assert_eq!(value(&cpu, "tapedeck_kv_pool_bytes"), Some(3145728.0));
        assert_eq!(
            value(&cpu, "tapedeck_kv_cache_info{storage=\"bf16\"}"),
            Some(1.0)
        );
        assert_eq!(value(&cpu, "tapedeck_device_busy_seconds_total"), None);
        let busy = (std::time::Duration::from_micros(2_500_250), 1234);
        let gpu = CacheStats {
            device_busy: Some(busy),
            ..cache
        };
        let gpu = m.render(Load::default(), Some(gpu), WriterStats::default());
        assert_eq!(
            value(&gpu, "tapedeck_device_busy_seconds_total"),
            Some(2.50025)
        );
        assert_eq!(
            value(&gpu, "tapedeck_device_forward_passes_total"),
            Some(1234.0)
        );
        assert!(gpu.contains("# TYPE tapedeck_device_busy_seconds_total counter"));
    }
}

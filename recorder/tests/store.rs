//! The store and the writer: records survive a round trip, batching keeps up under load, the
//! queue policies count what they drop, and shutdown drains the queue.

mod common;

use std::time::{Duration, Instant};

use common::{full_record, temp_store};
use tapedeck_recorder::record::BuildInfo;
use tapedeck_recorder::writer::Submitted;
use tapedeck_recorder::{QueuePolicy, RecordWriter, Store, WriterConfig};

#[tokio::test]
async fn record_round_trips_every_column() {
    let (_dir, store) = temp_store().await;
    let build = store
        .register_build(&BuildInfo::current("cpu", "cpu"))
        .await
        .unwrap();
    // Registering the same identity again returns the same row.
    assert_eq!(
        store
            .register_build(&BuildInfo::current("cpu", "cpu"))
            .await
            .unwrap(),
        build
    );
    let mut rec = full_record(3);
    rec.build_id = Some(build);
    store
        .insert_batch(std::slice::from_ref(&rec))
        .await
        .unwrap();
    let back = store.request(rec.id).await.unwrap().expect("stored");
    assert_eq!(back, rec);
    assert_eq!(back.first_token_us(), Some(rec.arrival_us + 1_000));
    assert_eq!(
        store.build(build).await.unwrap(),
        Some(BuildInfo::current("cpu", "cpu"))
    );
}

#[tokio::test]
async fn error_record_without_output_round_trips() {
    let (_dir, store) = temp_store().await;
    let mut rec = full_record(1);
    rec.session = None;
    rec.output = None;
    rec.prompt_ids = None;
    rec.status = 400;
    rec.error = Some("messages must not be empty".into());
    rec.request_body = "{not json".into();
    store
        .insert_batch(std::slice::from_ref(&rec))
        .await
        .unwrap();
    assert_eq!(store.request(rec.id).await.unwrap(), Some(rec));
}

#[tokio::test]
async fn reopening_keeps_records_and_migrations_are_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    // A missing parent directory is created.
    let path = dir.path().join("not/yet/there.db");
    let rec = full_record(0);
    {
        let store = Store::open(&path).await.unwrap();
        store
            .insert_batch(std::slice::from_ref(&rec))
            .await
            .unwrap();
        store.close().await;
    }
    let store = Store::open(&path).await.unwrap();
    assert_eq!(store.count_requests().await.unwrap(), 1);
    assert!(store.has_request(rec.id).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_batches_2000_records() {
    let (_dir, store) = temp_store().await;
    let writer = RecordWriter::spawn(
        store.clone(),
        WriterConfig {
            capacity: 256,
            policy: QueuePolicy::Wait(Duration::from_secs(30)),
            max_batch: 64,
            max_delay: Duration::from_millis(20),
        },
    );
    let start = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..8u32 {
        let w = writer.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..250 {
                assert_eq!(w.submit(full_record(t * 1000 + i)).await, Submitted::Queued);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let stats = writer.shutdown().await;
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "wrote 2000 records in {} transactions, {:.0} records/s",
        stats.batches,
        2000.0 / secs
    );
    assert_eq!(stats.written, 2000);
    assert_eq!(stats.dropped, 0);
    assert_eq!(stats.failed, 0);
    assert!(stats.batches >= 2000 / 64, "{stats:?}");
    assert!(stats.batches < 2000, "records were not batched: {stats:?}");
    assert_eq!(store.count_requests().await.unwrap(), 2000);
}

#[tokio::test]
async fn drop_policy_counts_what_does_not_fit() {
    let (_dir, store) = temp_store().await;
    let writer = RecordWriter::spawn(
        store.clone(),
        WriterConfig {
            capacity: 4,
            policy: QueuePolicy::Drop,
            max_batch: 64,
            max_delay: Duration::from_millis(1),
        },
    );
    // On this single-threaded runtime the writer task cannot run until we yield, and a `Drop`
    // submit never yields: exactly `capacity` records fit.
    let mut queued = 0;
    for i in 0..100 {
        if writer.submit(full_record(i)).await == Submitted::Queued {
            queued += 1;
        }
    }
    assert_eq!(queued, 4);
    assert_eq!(writer.stats().depth, 4);
    assert_eq!(writer.stats().dropped, 96);
    writer.flush().await.unwrap();
    let stats = writer.stats();
    assert_eq!((stats.written, stats.dropped, stats.depth), (4, 96, 0));
    assert_eq!(store.count_requests().await.unwrap(), 4);
}

#[tokio::test]
async fn shutdown_drains_the_queue_and_later_records_are_dropped() {
    let (_dir, store) = temp_store().await;
    let writer = RecordWriter::spawn(
        store.clone(),
        WriterConfig {
            capacity: 1000,
            policy: QueuePolicy::Drop,
            max_batch: 16,
            max_delay: Duration::from_secs(3600),
        },
    );
    for i in 0..500 {
        writer.submit(full_record(i)).await;
    }
    let stats = writer.shutdown().await;
    assert_eq!(stats.written, 500);
    assert_eq!(store.count_requests().await.unwrap(), 500);
    assert_eq!(writer.submit(full_record(9999)).await, Submitted::Dropped);
    assert_eq!(writer.stats().dropped, 1);
    assert!(writer.flush().await.is_err());
}

#[tokio::test]
async fn a_bad_record_does_not_lose_its_batch() {
    let (_dir, store) = temp_store().await;
    let writer = RecordWriter::spawn(store.clone(), WriterConfig::default());
    let dup = full_record(1);
    writer.submit(dup.clone()).await;
    writer.submit(full_record(2)).await;
    writer.submit(dup).await; // same primary key
    writer.submit(full_record(3)).await;
    let stats = writer.shutdown().await;
    assert_eq!((stats.written, stats.failed), (3, 1));
    assert_eq!(store.count_requests().await.unwrap(), 3);
}

#[test]
fn queue_policy_parses() {
    assert_eq!("drop".parse::<QueuePolicy>().unwrap(), QueuePolicy::Drop);
    assert_eq!(
        "wait:250".parse::<QueuePolicy>().unwrap(),
        QueuePolicy::Wait(Duration::from_millis(250))
    );
    assert_eq!(
        "wait(5ms)".parse::<QueuePolicy>().unwrap(),
        QueuePolicy::Wait(Duration::from_millis(5))
    );
    assert!("sometimes".parse::<QueuePolicy>().is_err());
}

#[tokio::test]
async fn replay_runs_round_trip_with_their_turns() {
    use tapedeck_recorder::store::{StoredRun, StoredTurn};
    let dir = tempfile::tempdir().unwrap();
    let store = tapedeck_recorder::store::Store::open(&dir.path().join("runs.db"))
        .await
        .unwrap();
    let run = StoredRun {
        id: "run-1".into(),
        format: "tapedeck.run.v1".into(),
        target_spec: "engine:tiny-qwen2?matmul=bf16".into(),
        target_kind: "engine".into(),
        toggles: Some("matmul=bf16".into()),
        build: None,
        started_at_us: 10,
        ended_at_us: 20,
        cancelled: false,
        flagged: true,
        summary_json: r#"{"format":"tapedeck.run.v1"}"#.into(),
    };
    let turns = vec![
        StoredTurn {
            session_id: "s".into(),
            turn: 1,
            flags: "drift".into(),
            error: None,
            row_json: "{}".into(),
        },
        StoredTurn {
            session_id: "s".into(),
            turn: 0,
            flags: String::new(),
            error: Some("boom".into()),
            row_json: "{}".into(),
        },
    ];
    store.save_run(&run, &turns).await.unwrap();
    assert_eq!(store.run("run-1").await.unwrap(), Some(run.clone()));
    assert_eq!(store.runs().await.unwrap(), vec![run.clone()]);
    let got = store.run_turns("run-1").await.unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].turn, 0);
    assert_eq!(got[0].error.as_deref(), Some("boom"));
    assert!(store.run("nope").await.unwrap().is_none());
    // The same ID twice is an error, and the first run is untouched.
    assert!(store.save_run(&run, &turns).await.is_err());
    assert_eq!(store.run_turns("run-1").await.unwrap().len(), 2);
}

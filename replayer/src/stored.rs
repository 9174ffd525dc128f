//! Runs written back to a tapedeck database (`runs` and `run_turns` tables), so that a recording
//! and the replays judged against it live in one file and `report`/`compare` can name a run by ID.

use tapedeck_recorder::store::{Store, StoredRun, StoredTurn};

use crate::error::{Error, Result};
use crate::report::RunSummary;

fn json_err(context: &str) -> impl FnOnce(serde_json::Error) -> Error + '_ {
    move |source| Error::Json {
        context: context.to_string(),
        source,
    }
}

/// Saves a run and its per-turn rows; returns the new run's ID (`run-<started µs>-<random>`).
pub async fn save_run(store: &Store, run: &RunSummary) -> Result<String> {
    let id = format!("run-{}-{:08x}", run.started_at_us, rand::random::<u32>());
    let stored = StoredRun {
        id: id.clone(),
        format: run.format.clone(),
        target_spec: run.target.spec.clone(),
        target_kind: run.target.kind.clone(),
        toggles: run.target.toggles.clone(),
        build: run.target.build.clone(),
        started_at_us: run.started_at_us,
        ended_at_us: run.ended_at_us,
        cancelled: run.cancelled,
        flagged: run.flagged,
        summary_json: serde_json::to_string(run).map_err(json_err("serializing the run"))?,
    };
    let mut turns = Vec::new();
    for s in &run.sessions {
        for t in &s.turns {
            turns.push(StoredTurn {
                session_id: t.session_id.clone(),
                turn: t.turn as i64,
                flags: t.flags.join(","),
                error: t.error.clone(),
                row_json: serde_json::to_string(t).map_err(json_err("serializing a turn"))?,
            });
        }
    }
    store.save_run(&stored, &turns).await?;
    Ok(id)
}

/// Loads a stored run's summary by ID.
pub async fn load_run(store: &Store, id: &str) -> Result<RunSummary> {
    let run = store.run(id).await?.ok_or_else(|| Error::Setting {
        name: "run",
        message: format!("no run {id:?} in {}", store.path().display()),
    })?;
    serde_json::from_str(&run.summary_json).map_err(json_err("reading a stored run"))
}

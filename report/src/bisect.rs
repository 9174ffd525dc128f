//! Which toggle broke it: delta debugging over the difference between a good and a bad toggle set.
//!
//! The changes are the toggles whose values differ between `good` and `bad`. A *configuration* is
//! `good` with a subset of the changes applied. Zeller and Hildebrandt's `ddmin` ("Simplifying and
//! Isolating Failure-Inducing Input", TSE 2002) searches for a 1-minimal failing subset: removing
//! any single change from it makes the failure disappear. It splits the current failing set into
//! `n` parts, tries each part alone (shrinking fast when one part reproduces), then each complement
//! (which is what finds an interaction of two changes that only fail together), and doubles `n`
//! when neither reproduces. With one culprit among `k` changes it needs about `2·log2(k)` replays;
//! an interaction costs a few more.
//!
//! Replays are expensive, so outcomes are cached by the canonical toggle text: a configuration is
//! never replayed twice. Before searching, the full bad set is replayed (if it does not fail there
//! is nothing to explain) and then the good set (if it fails too, no toggle explains the failure).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;

use serde::Serialize;
use tapedeck_engine::Toggles;
use tapedeck_replayer::metrics::bucket_of;
use tapedeck_replayer::metrics::BUCKET_LABELS;
use tapedeck_replayer::report::RunSummary;

use crate::error::{Error, Result};

/// One toggle whose value differs between the good and the bad set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToggleChange {
    /// Toggle name (`fault.encoding`).
    pub name: String,
    /// Its value in the good set.
    pub good: String,
    /// Its value in the bad set.
    pub bad: String,
}

impl fmt::Display for ToggleChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} -> {}", self.name, self.good, self.bad)
    }
}

/// One flagged turn of a failing replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FlaggedTurn {
    /// Session.
    pub session_id: String,
    /// Turn index.
    pub turn: usize,
    /// Absolute context position where it first went wrong (prompt divergence, else the first
    /// output disagreement), when known.
    pub position: Option<usize>,
    /// Context bucket of `position` (`0-1k`, ...).
    pub bucket: Option<String>,
    /// The turn's flags.
    pub flags: Vec<String>,
}

/// Why a replay was judged bad: what the caller's predicate saw.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Evidence {
    /// Flagged turns, the first flagged turn of each session (at most 20).
    pub turns: Vec<FlaggedTurn>,
    /// Flag counts of the run.
    pub flags: std::collections::BTreeMap<String, usize>,
    /// Sessions with at least one flagged turn.
    pub sessions_flagged: usize,
    /// Sessions replayed.
    pub sessions: usize,
    /// Free text from the caller (e.g. the compare verdict).
    pub note: String,
}

impl Evidence {
    /// Evidence with only a note (for predicates that do not replay, e.g. tests).
    pub fn note(note: impl Into<String>) -> Self {
        Evidence {
            note: note.into(),
            ..Evidence::default()
        }
    }

    /// Extracts the evidence from a replay's summary: for each session, its first flagged turn
    /// with the context position and bucket where it went wrong.
    pub fn from_run(run: &RunSummary) -> Self {
        let mut ev = Evidence {
            flags: run.fidelity.flags.clone(),
            sessions: run.sessions.len(),
            ..Evidence::default()
        };
        for s in &run.sessions {
            let Some(t) = s.turns.iter().find(|t| t.flagged()) else {
                continue;
            };
            ev.sessions_flagged += 1;
            if ev.turns.len() >= 20 {
                continue;
            }
            let prompt_len = t
                .prompt
                .as_ref()
                .and_then(|p| p.candidate_tokens.or(p.recorded_tokens));
            let position = t
                .prompt
                .as_ref()
                .and_then(|p| p.first_divergence.filter(|_| p.diverged))
                .or_else(|| {
                    let off = t
                        .drift
                        .as_ref()
                        .and_then(|d| d.first_top1_disagreement)
                        .or_else(|| t.output.as_ref().and_then(|o| o.first_divergence))?;
                    Some(prompt_len? + off)
                })
                .or(prompt_len);
            ev.turns.push(FlaggedTurn {
                session_id: t.session_id.clone(),
                turn: t.turn,
                position,
                bucket: position.map(|p| BUCKET_LABELS[bucket_of(p)].to_string()),
                flags: t.flags.clone(),
            });
        }
        ev
    }

    /// The usual fidelity predicate for a bisect: a replay is bad when any turn is flagged.
    pub fn judge(run: &RunSummary) -> (bool, Evidence) {
        (run.flagged, Evidence::from_run(run))
    }
}

/// How a bisect ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BisectOutcome {
    /// A minimal set of changes reproduces the failure.
    Found,
    /// The bad set did not fail: nothing to explain (flaky, or the wrong sessions).
    NotReproduced,
    /// The good set fails too: no toggle change explains the failure.
    GoodAlsoFails,
    /// The two sets are identical.
    NoDifference,
}

/// One replay the bisect asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Trial {
    /// Toggles replayed (canonical text).
    pub toggles: String,
    /// Names of the changes applied to the good set.
    pub applied: Vec<String>,
    /// Whether it reproduced the failure.
    pub bad: bool,
}

/// The result of [`bisect`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BisectResult {
    /// How it ended.
    pub outcome: BisectOutcome,
    /// Every change between good and bad.
    pub changes: Vec<ToggleChange>,
    /// The minimal failing changes (empty unless `Found`).
    pub culprit: Vec<ToggleChange>,
    /// `good` with the culprit applied (canonical text), when found.
    pub culprit_toggles: Option<String>,
    /// What the last failing replay of the culprit (or of the bad set) showed.
    pub evidence: Option<Evidence>,
    /// Replays actually run (cache misses).
    pub replays: usize,
    /// Configurations asked for again and answered from the cache.
    pub cache_hits: usize,
    /// Every replay in order.
    pub trials: Vec<Trial>,
}

impl BisectResult {
    /// 0 when a culprit was found, 1 when the failure did not reproduce or the good set fails,
    /// 2 when there was nothing to bisect.
    pub fn exit_code(&self) -> i32 {
        match self.outcome {
            BisectOutcome::Found => 0,
            BisectOutcome::NotReproduced | BisectOutcome::GoodAlsoFails => 1,
            BisectOutcome::NoDifference => 2,
        }
    }
}

impl fmt::Display for BisectResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let changes: Vec<String> = self.changes.iter().map(|c| c.to_string()).collect();
        writeln!(
            f,
            "toggle differences ({}): {}",
            changes.len(),
            changes.join(", ")
        )?;
        match self.outcome {
            BisectOutcome::Found => {
                let names: Vec<String> = self.culprit.iter().map(|c| c.to_string()).collect();
                writeln!(
                    f,
                    "culprit ({} of {} changes): {}",
                    self.culprit.len(),
                    self.changes.len(),
                    names.join(" + ")
                )?;
                if self.culprit.len() > 1 {
                    writeln!(
                        f,
                        "  (an interaction: the failure needs all of these together)"
                    )?;
                }
                if let Some(t) = &self.culprit_toggles {
                    writeln!(f, "reproduce with: --toggles {t:?}")?;
                }
            }
            BisectOutcome::NotReproduced => writeln!(
                f,
                "could not reproduce: the bad toggle set replayed without a failure, so there is \
                 nothing to explain (a flaky failure, or sessions that do not exercise it)"
            )?,
            BisectOutcome::GoodAlsoFails => writeln!(
                f,
                "the good toggle set fails too: the failure is not caused by a toggle difference"
            )?,
            BisectOutcome::NoDifference => writeln!(
                f,
                "good and bad toggle sets are identical: nothing to bisect"
            )?,
        }
        if let Some(ev) = &self.evidence {
            if ev.sessions > 0 {
                writeln!(
                    f,
                    "evidence: {} of {} sessions flagged",
                    ev.sessions_flagged, ev.sessions
                )?;
            }
            if !ev.flags.is_empty() {
                let fl: Vec<String> = ev.flags.iter().map(|(k, v)| format!("{k}={v}")).collect();
                writeln!(f, "  flags: {}", fl.join(", "))?;
            }
            for t in ev.turns.iter().take(5) {
                writeln!(
                    f,
                    "  session {} turn {}: {}{}",
                    t.session_id,
                    t.turn,
                    t.flags.join(", "),
                    match (&t.position, &t.bucket) {
                        (Some(p), Some(b)) => format!(" at context position {p} (bucket {b})"),
                        _ => String::new(),
                    }
                )?;
            }
            if !ev.note.is_empty() {
                writeln!(f, "  {}", ev.note)?;
            }
        }
        write!(
            f,
            "replays: {} ({} answered from cache)",
            self.replays, self.cache_hits
        )
    }
}

/// The replay cache and counters, shared by the steps of one bisect.
struct Search<'a, F> {
    good: Toggles,
    changes: &'a [ToggleChange],
    cache: HashMap<String, (bool, Evidence)>,
    trials: Vec<Trial>,
    hits: usize,
    is_bad: F,
}

impl<F, Fut, E> Search<'_, F>
where
    F: FnMut(Toggles) -> Fut,
    Fut: Future<Output = std::result::Result<(bool, Evidence), E>>,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn config(&self, subset: &[usize]) -> Result<Toggles> {
        let mut t = self.good;
        for &i in subset {
            let c = &self.changes[i];
            t.set(&c.name, &c.bad)?;
        }
        Ok(t)
    }

    /// Replays `good` + `subset` unless the configuration is cached.
    async fn test(&mut self, subset: &[usize]) -> Result<(bool, Evidence)> {
        let t = self.config(subset)?;
        let key = t.to_string();
        if let Some(hit) = self.cache.get(&key) {
            self.hits += 1;
            return Ok(hit.clone());
        }
        let out = (self.is_bad)(t).await.map_err(|e| Error::Replay {
            toggles: key.clone(),
            source: e.into(),
        })?;
        self.trials.push(Trial {
            toggles: key.clone(),
            applied: subset
                .iter()
                .map(|&i| self.changes[i].name.clone())
                .collect(),
            bad: out.0,
        });
        self.cache.insert(key, out.clone());
        Ok(out)
    }
}

/// Splits `c` into `n` nearly equal contiguous parts.
fn split(c: &[usize], n: usize) -> Vec<Vec<usize>> {
    let mut parts = Vec::with_capacity(n);
    let mut start = 0;
    for i in 0..n {
        let end = start + (c.len() - start) / (n - i);
        parts.push(c[start..end].to_vec());
        start = end;
    }
    parts
}

/// Finds the smallest set of toggle changes from `good` towards `bad` that still makes `is_bad`
/// report a failure (ddmin; see the module docs).
///
/// `is_bad` replays the sessions with the given toggles and says whether the run is bad, with the
/// evidence (usually [`Evidence::judge`] of the replay's [`RunSummary`]). It is called at most once
/// per distinct configuration. Its error aborts the bisect as [`Error::Replay`].
pub async fn bisect<F, Fut, E>(good: Toggles, bad: Toggles, is_bad: F) -> Result<BisectResult>
where
    F: FnMut(Toggles) -> Fut,
    Fut: Future<Output = std::result::Result<(bool, Evidence), E>>,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let changes: Vec<ToggleChange> = good
        .diff(&bad)
        .into_iter()
        .map(|n| ToggleChange {
            name: n.to_string(),
            good: good.get(n).unwrap_or_default(),
            bad: bad.get(n).unwrap_or_default(),
        })
        .collect();
    let mut result = BisectResult {
        outcome: BisectOutcome::NoDifference,
        changes: changes.clone(),
        culprit: Vec::new(),
        culprit_toggles: None,
        evidence: None,
        replays: 0,
        cache_hits: 0,
        trials: Vec::new(),
    };
    if changes.is_empty() {
        return Ok(result);
    }
    let mut s = Search {
        good,
        changes: &changes,
        cache: HashMap::new(),
        trials: Vec::new(),
        hits: 0,
        is_bad,
    };
    let all: Vec<usize> = (0..changes.len()).collect();
    let (bad_fails, bad_ev) = s.test(&all).await?;
    let finish = |s: Search<'_, F>, mut r: BisectResult| {
        r.replays = s.trials.len();
        r.cache_hits = s.hits;
        r.trials = s.trials;
        r
    };
    if !bad_fails {
        result.outcome = BisectOutcome::NotReproduced;
        return Ok(finish(s, result));
    }
    let (good_fails, good_ev) = s.test(&[]).await?;
    if good_fails {
        result.outcome = BisectOutcome::GoodAlsoFails;
        result.evidence = Some(good_ev);
        return Ok(finish(s, result));
    }
    // ddmin.
    let mut c = all;
    let mut ev = bad_ev;
    let mut n = 2usize;
    while c.len() >= 2 {
        let parts = split(&c, n);
        let mut reduced = false;
        for p in &parts {
            let (f, e) = s.test(p).await?;
            if f {
                c = p.clone();
                ev = e;
                n = 2;
                reduced = true;
                break;
            }
        }
        if !reduced && n > 2 {
            for i in 0..parts.len() {
                let comp: Vec<usize> = parts
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .flat_map(|(_, p)| p.iter().copied())
                    .collect();
                let (f, e) = s.test(&comp).await?;
                if f {
                    c = comp;
                    ev = e;
                    n = (n - 1).max(2);
                    reduced = true;
                    break;
                }
            }
        }
        if !reduced {
            if n >= c.len() {
                break;
            }
            n = (2 * n).min(c.len());
        }
    }
    result.outcome = BisectOutcome::Found;
    result.culprit = c.iter().map(|&i| changes[i].clone()).collect();
    result.culprit_toggles = Some(s.config(&c)?.to_string());
    result.evidence = Some(ev);
    Ok(finish(s, result))
}

-- Replay runs written back to the database they replayed (or any tapedeck database): one row per
-- run with its full summary (format tapedeck.run.v1, see replayer/FORMAT.md), and one row per
-- replayed turn so runs can be queried by session, turn and flag without parsing the summary.
CREATE TABLE runs (
    id              TEXT PRIMARY KEY,
    format          TEXT NOT NULL,
    target_spec     TEXT NOT NULL,
    target_kind     TEXT NOT NULL,
    toggles         TEXT,
    build           TEXT,
    started_at_us   INTEGER NOT NULL,
    ended_at_us     INTEGER NOT NULL,
    cancelled       INTEGER NOT NULL,
    flagged         INTEGER NOT NULL,
    summary_json    TEXT NOT NULL
);
CREATE INDEX runs_started ON runs (started_at_us);

CREATE TABLE run_turns (
    run_id      TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    session_id  TEXT NOT NULL,
    turn        INTEGER NOT NULL,
    flagged     INTEGER NOT NULL,
    flags       TEXT NOT NULL,
    error       TEXT,
    row_json    TEXT NOT NULL,
    PRIMARY KEY (run_id, session_id, turn)
);

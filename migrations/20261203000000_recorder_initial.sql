-- tapedeck recorder schema, version 1.
--
-- Timestamps are integer microseconds since the Unix epoch (UTC). Per-token columns are BLOBs in
-- the versioned binary format documented in recorder/FORMAT.md and recorder/src/blob.rs.

-- One row per distinct build identity that served requests.
CREATE TABLE builds (
    id            INTEGER PRIMARY KEY,
    version       TEXT NOT NULL,
    git_revision  TEXT NOT NULL,
    features      TEXT NOT NULL,
    backend       TEXT NOT NULL,
    device        TEXT NOT NULL,
    first_seen_us INTEGER NOT NULL,
    UNIQUE (version, git_revision, features, backend, device)
);

-- A multi-turn conversation. `source` says how its requests were stitched together.
CREATE TABLE sessions (
    id          TEXT PRIMARY KEY,
    source      TEXT NOT NULL CHECK (source IN ('header', 'content', 'import', 'synth')),
    client_hint TEXT,
    created_us  INTEGER NOT NULL
);

CREATE TABLE requests (
    id                  TEXT PRIMARY KEY,                -- UUID, hyphenated lower case
    session_id          TEXT REFERENCES sessions (id),   -- NULL: not part of a session
    turn_index          INTEGER,                         -- 0-based position in the session
    parent_id           TEXT,                            -- the request this one continues
    stitch              TEXT CHECK (stitch IN ('header', 'prefix', 'compaction', 'new', 'import')),
    kind                TEXT NOT NULL CHECK (kind IN ('agent', 'title', 'compaction', 'other')),
    endpoint            TEXT NOT NULL,                   -- e.g. /v1/chat/completions
    arrival_us          INTEGER NOT NULL,
    first_token_us      INTEGER,
    end_us              INTEGER NOT NULL,
    status_code         INTEGER NOT NULL,
    error               TEXT,
    request_json        TEXT NOT NULL,                   -- the body as received (lossy UTF-8)
    headers_json        TEXT NOT NULL,                   -- selected request headers
    model               TEXT,
    toggles             TEXT NOT NULL,                   -- canonical text ('' = defaults)
    toggles_json        TEXT NOT NULL,                   -- every toggle with its value
    encoding_report_json TEXT,
    prompt_ids          BLOB,                            -- token-ID blob
    output_ids          BLOB,                            -- token-ID blob
    output_text         TEXT,                            -- raw generated text
    content_text        TEXT,                            -- visible answer (markup removed)
    reasoning_text      TEXT,
    tool_calls_json     TEXT,
    finish_reason       TEXT,
    token_times         BLOB,                            -- time-offset blob, µs from arrival
    logits              BLOB,                            -- logits-summary blob, one per output token
    prompt_logits       BLOB,                            -- scored prompt positions (echo + logprobs)
    prompt_logits_from  INTEGER,                         -- first prompt position scored
    prompt_tokens       INTEGER,
    completion_tokens   INTEGER,
    build_id            INTEGER REFERENCES builds (id),
    client_disconnected INTEGER NOT NULL DEFAULT 0 CHECK (client_disconnected IN (0, 1)),
    continuation_hash   TEXT                             -- stitch key: messages + this answer
);

CREATE INDEX requests_by_session ON requests (session_id, turn_index);
CREATE INDEX requests_by_arrival ON requests (arrival_us);
CREATE INDEX requests_by_continuation ON requests (continuation_hash)
    WHERE continuation_hash IS NOT NULL;
CREATE INDEX requests_compactions ON requests (kind) WHERE kind = 'compaction';

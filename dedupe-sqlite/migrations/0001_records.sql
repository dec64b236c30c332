-- 0001: the records table. Times are milliseconds since the Unix epoch.
-- `expires_at` is a lease's deadline, or once done the retention's.
CREATE TABLE IF NOT EXISTS "{table}" (
    namespace    TEXT    NOT NULL,
    id           TEXT    NOT NULL,
    state        INTEGER NOT NULL,  -- 0 in flight, 1 done
    token        TEXT    NOT NULL,
    claim_id     TEXT,
    fingerprint  BLOB,
    expires_at   INTEGER NOT NULL,
    completed_at INTEGER,
    outcome      BLOB,
    attempts     INTEGER NOT NULL,
    first_seen   INTEGER NOT NULL,
    PRIMARY KEY (namespace, id)
) WITHOUT ROWID;

//! The statement text of the store, built once per table name.

use dedupe_core::backend::check_identifier;
use dedupe_core::Result;

/// The statements for one table, built once.
#[derive(Debug)]
pub(crate) struct Statements {
    table: String,
    pub(crate) create: String,
    pub(crate) claim: String,
    pub(crate) select_live: String,
    pub(crate) complete: String,
    pub(crate) release: String,
    pub(crate) any_live: String,
    pub(crate) extend: String,
    pub(crate) expire_batch: String,
    pub(crate) forget: String,
}

/// Rows deleted per `expire()` batch (one write of the writer thread, committed
/// with the claims queued beside it), so a large purge never holds the write
/// lock for long: claims' p99 during a purge of 10^5 records 1.7-2.0x of a
/// quiet run with 64 rows, 3.2-3.7x with 250.
pub(crate) const EXPIRE_BATCH: i64 = 64;

/// The record columns every read returns, in the order `read_row` expects.
pub(crate) const COLUMNS: &str =
    "state, token, claim_id, fingerprint, expires_at, completed_at, outcome, attempts, first_seen";

impl Statements {
    pub(crate) fn new(table: &str) -> Result<Self> {
        check_identifier("table", table)?;
        let t = format!("\"{table}\"");
        Ok(Self {
            table: table.to_string(),
            create: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    namespace    TEXT    NOT NULL,
                    id           TEXT    NOT NULL,
                    state        INTEGER NOT NULL,  -- 0 in flight, 1 done
                    token        TEXT    NOT NULL,
                    claim_id     TEXT,
                    fingerprint  BLOB,
                    expires_at   INTEGER NOT NULL,  -- ms since epoch: lease deadline, or retention deadline once done
                    completed_at INTEGER,
                    outcome      BLOB,
                    attempts     INTEGER NOT NULL,
                    first_seen   INTEGER NOT NULL,
                    PRIMARY KEY (namespace, id)
                ) WITHOUT ROWID;
                CREATE INDEX IF NOT EXISTS \"{table}_expires_at\" ON {t} (expires_at);"
            ),
            // Inserts a fresh record, or takes over one whose deadline has passed, in one
            // statement. A live record is left alone and no row comes back.
            claim: format!(
                "INSERT INTO {t} AS r (namespace, id, state, token, claim_id, fingerprint,
                                       expires_at, completed_at, outcome, attempts, first_seen)
                 VALUES (:ns, :id, 0, :token, :claim_id, :fingerprint, :deadline, NULL, NULL, 1, :now)
                 ON CONFLICT (namespace, id) DO UPDATE SET
                    state = 0,
                    token = excluded.token,
                    claim_id = excluded.claim_id,
                    fingerprint = excluded.fingerprint,
                    expires_at = excluded.expires_at,
                    completed_at = NULL,
                    outcome = NULL,
                    attempts = CASE WHEN r.state = 0 THEN r.attempts + 1 ELSE 1 END,
                    first_seen = CASE WHEN r.state = 0 THEN r.first_seen ELSE excluded.first_seen END
                 WHERE r.expires_at <= :now
                 RETURNING token, attempts"
            ),
            select_live: format!(
                "SELECT {COLUMNS} FROM {t} WHERE namespace = :ns AND id = :id AND expires_at > :now"
            ),
            // In flight under this token: done. Already done by this token with
            // this outcome (a complete asked again): the row is written back as
            // it is, so the answer is the first one's.
            complete: format!(
                "UPDATE {t} SET state = 1,
                        expires_at = CASE WHEN state = 0 THEN :until ELSE expires_at END,
                        completed_at = CASE WHEN state = 0 THEN :now ELSE completed_at END,
                        outcome = :outcome
                 WHERE namespace = :ns AND id = :id AND token = :token AND expires_at > :now
                   AND (state = 0 OR outcome = :outcome)"
            ),
            release: format!(
                "DELETE FROM {t}
                 WHERE namespace = :ns AND id = :id AND token = :token AND state = 0 AND expires_at > :now"
            ),
            // After a release removed nothing: whether a live record (another
            // lease's, or done) is under the key.
            any_live: format!(
                "SELECT EXISTS (SELECT 1 FROM {t}
                                 WHERE namespace = :ns AND id = :id AND expires_at > :now)"
            ),
            extend: format!(
                "UPDATE {t} SET expires_at = :until
                 WHERE namespace = :ns AND id = :id AND token = :token AND state = 0 AND expires_at > :now"
            ),
            expire_batch: format!(
                "DELETE FROM {t} WHERE (namespace, id) IN
                    (SELECT namespace, id FROM {t} WHERE expires_at <= :now LIMIT :batch)"
            ),
            forget: format!(
                "DELETE FROM {t} WHERE namespace = :ns AND id = :id RETURNING expires_at > :now"
            ),
        })
    }
}

impl Statements {
    pub(crate) fn table(&self) -> &str {
        &self.table
    }
}

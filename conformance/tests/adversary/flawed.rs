// Deliberately flawed dedupe stores, written by an adversary who has not read the
// conformance checks, to measure whether the suite rejects them.
//
// `FlawedStore` keeps rows the way a backend does (one row per key, columns
// state / token / claim_id / fingerprint / expires_at / completed_at / outcome /
// attempts / first_seen, deadlines in epoch milliseconds like the SQL stores).
// With `flaw == None` it obeys CONTRACT.md (modelled on `MemoryStore`); each
// `AFlaw` flips exactly one detail.
//
// Use: `FlawedFactory(None)` is the correct store; `FlawedFactory(Some(f))` for
// each `f` in `all_flaws()` must be rejected by the suite. The two flaws that
// need a connection fault (`FailOpenClaim`, `CompleteSwallowsWriteError`) only
// show after `FlawedStore::set_broken(true)`; the Fixture trait has no way to do
// that, so a test has to build `FlawedStore::new(Some(flaw))` itself.
//
// The variants after `CompleteSwallowsWriteError` were added by a second,
// independent adversary (same rules: one detail each, no knowledge of the
// checks). None of them needs a connection fault.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use dedupe_conformance::{FaultSwitch, FaultyHandle, Fixture, StoreFactory};
use dedupe_core::backend::{
    self, check_ttl, duration_millis, from_millis, stored_token, to_millis, StoredRecord,
};
use dedupe_core::{
    Capabilities, ClaimId, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key, Lease, Record,
    RecordStateKind, Result,
};

/// One plausible mistake of a backend author. Each variant flips exactly one
/// detail of an otherwise correct store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AFlaw {
    // ---------------------------------------------------------------- takeover
    /// Takeover keeps the previous holder's claim id when the new claim carries
    /// none. Postgres/SQLite: `claim_id = COALESCE(excluded.claim_id, r.claim_id)`
    /// in the upsert; Redis: `HSET` only the fields the new claim has. The dead
    /// worker, retrying its claim with its claim id, is answered Claimed with the
    /// new holder's lease: two workers process the event.
    TakeoverKeepsClaimId,
    /// Takeover does not replace the fingerprint (the column is missing from the
    /// `ON CONFLICT DO UPDATE SET` list / the DynamoDB `UpdateExpression`). The
    /// record then carries the dead holder's payload digest: the new payload is
    /// answered Mismatch, the old one InFlight.
    TakeoverKeepsFingerprint,
    /// Takeover sets `attempts = 1` (`attempts = excluded.attempts` instead of
    /// `r.attempts + 1`): the new holder never learns it took over a dead worker
    /// and `get` shows one attempt after several.
    TakeoverResetsAttempts,
    /// Takeover sets `first_seen = now()` (`first_seen = excluded.first_seen`
    /// unconditionally): the record forgets when the event first arrived.
    TakeoverResetsFirstSeen,
    /// The row is updated correctly, but the lease hands back the attempt count
    /// read before the update (DynamoDB `ReturnValues: ALL_OLD`, Postgres
    /// `RETURNING` from a CTE reading the old row): a takeover's lease says
    /// attempt 1 / is_takeover() == false while `get` says 2.
    TakeoverReturnsOldAttempt,
    /// Claiming a done record whose retention passed counts as a takeover:
    /// `attempts = r.attempts + 1` and `first_seen` kept without the
    /// `CASE WHEN r.state = 0` guard. The new lease says is_takeover() for an
    /// event whose earlier processing finished fine.
    DoneExpiryCountsAsTakeover,
    /// Takeover writes only the lease fields (Redis `HSET token .. deadline ..`)
    /// and leaves `state`, `completed_at` and `outcome` of an expired done record
    /// in place. After retention passes, the winner's record still reads as done:
    /// the next claim answers Duplicate with the old outcome while the winner is
    /// still working, and the winner's complete fails with LeaseLost.
    TakeoverKeepsDoneState,

    // ------------------------------------------- operations on a passed lease
    /// complete checks token and state but not the deadline (`UPDATE .. WHERE
    /// token = $3 AND state = 0`, no `AND expires_at > now()`): a worker whose
    /// lease passed, with nobody having taken over yet, still completes.
    CompleteIgnoresDeadline,
    /// extend checks token and state but not the deadline: a stalled worker's
    /// late heartbeat resurrects a lease that had passed (the event was already
    /// claimable by anyone).
    ExtendIgnoresDeadline,

    // ------------------------------------------------- done vs in-flight state
    /// complete checks the token but not `state = 0`: a second complete by the
    /// same lease (a retried call, a second code path) overwrites the stored
    /// outcome and restarts retention.
    CompleteTwiceOverwrites,
    /// release checks the token but not `state = 0`: releasing after a complete
    /// (an error path whose complete answer was lost, a `finally` block) deletes
    /// the done record, and the next delivery processes the event again.
    ReleaseRemovesDone,
    /// extend checks the token but not `state = 0`: a heartbeat task still running
    /// after complete sets `expires_at = now + lease_ttl` on the done record,
    /// cutting a 35-day retention to 30 s; the event is processed again after.
    ExtendShortensDone,

    // ------------------------------------------------------- logical expiry
    /// get returns the row whatever its deadline (DynamoDB `GetItem` returns
    /// items past their TTL until the sweeper deletes them; SQL without
    /// `AND expires_at > now()`).
    GetIgnoresExpiry,
    /// get "touches" an in-flight record: sliding expiry like a cache (Redis
    /// `GETEX .. PX`, memcached touch). An operator dashboard polling a dead
    /// worker's record keeps its lease alive forever: the event is never
    /// processed.
    GetSlidesExpiry,
    /// forget answers whether a row was deleted, not whether a live one was
    /// (`DELETE .. RETURNING 1`, Redis `DEL` count): true for an expired record.
    ForgetCountsExpired,
    /// claim's condition is only "no row" (DynamoDB `attribute_not_exists(pk)`,
    /// Redis `SET NX` on a key whose expiry is left to a sweeper, SQL
    /// `ON CONFLICT DO NOTHING`): an expired row keeps answering InFlight /
    /// Duplicate until expire() physically removes it.
    ClaimIgnoresLogicalExpiry,
    /// expire() judges every row by its lease deadline (a DynamoDB item with
    /// separate `lease_until` and `ttl` attributes, cleanup scan filtering on
    /// `lease_until < now`): done records are purged once their old lease passes,
    /// long before retention, and their events are processed again.
    ExpireJudgesDoneByLease,

    // ----------------------------------------------------------- time, retention
    /// Retention is counted from when the record was created
    /// (`expires_at = first_seen + retention`) instead of from the completion: a
    /// slow job or a takeover leaves a done record that expires early.
    RetentionFromFirstSeen,
    /// Duplicate answers `completed_at = now()` instead of the stored completion
    /// time (copied from a "tiny store" example that had no such column).
    DuplicateCompletedAtNow,
    /// Deadlines kept in epoch seconds (DynamoDB TTL attribute, Redis `EXPIRE`
    /// instead of `PEXPIRE`): `deadline = (now_s + ttl.as_secs()) * 1000`. A
    /// sub-second lease or retention is already passed when written, and every
    /// deadline is up to 1 s early.
    DeadlineInSeconds,
    /// The row keeps milliseconds but the lease handed back carries the caller's
    /// exact `SystemTime::now() + ttl` (nanoseconds): the Claimed / extended lease
    /// differs from what InFlight, get and a re-entrant claim answer.
    LeaseDeadlineUnrounded,
    /// complete does not check the retention bounds (`check_ttl` forgotten):
    /// a retention of zero is accepted and the done record is dead on arrival,
    /// so the next delivery processes the event again.
    CompleteSkipsRetentionCheck,

    // --------------------------------------------------------------- extend
    /// extend pushes the deadline to `old deadline + ttl` (`SET expires_at =
    /// expires_at + $ttl`, Redis `PEXPIRE` computed from the stored deadline)
    /// instead of `now + ttl`: every heartbeat lengthens the lease further.
    ExtendFromOldDeadline,

    // ------------------------------------------------ claim answers, re-entry
    /// A re-entrant claim (same claim id) is handled as a heartbeat: the stored
    /// deadline is pushed to `now + lease_ttl` and the new deadline handed back,
    /// instead of the same lease as stored.
    ReentrantRefreshesDeadline,
    /// Every claim increments `attempts` before deciding (Redis `HINCRBY attempts
    /// 1` at the top of the script, DynamoDB `ADD attempts :one` in the same
    /// update): losing claims are counted, InFlight answers and later takeovers
    /// report the wrong attempt, and a re-entrant claim another attempt.
    AttemptsCountLosingClaims,
    /// InFlight answers `now + opts.lease_ttl` (the deadline the script computed
    /// for the caller) instead of the stored lease deadline.
    InFlightDeadlineIsCallerTtl,

    // -------------------------------------------------------- narrow columns
    /// The outcome column silently keeps at most 65,535 bytes (MySQL `BLOB` in
    /// non-strict mode) while capabilities() still advertise 256 KiB: a large
    /// outcome comes back truncated in Duplicate and get.
    OutcomeTruncated64K,
    /// Claim ids are cut to 64 bytes to fit a `VARCHAR(64)` column, on write and
    /// on compare: two workers whose long claim ids share a 64-byte prefix are
    /// both answered Claimed (the second as a "re-entrant" retry).
    ClaimIdTruncated,

    // ---------------------------------------------------------------- keys
    /// The storage key is `namespace + "_" + id` (Redis/DynamoDB key built with
    /// `format!("{ns}_{id}")`): `_` is allowed in namespaces, so ("a_b", "c")
    /// and ("a", "b_c") are one record. (`:` would be safe, `_`, `.`, `-` not.)
    KeyJoinedWithUnderscore,
    /// Trailing spaces of the id are ignored (MySQL PAD SPACE collations,
    /// Postgres `char(n)`): "evt_1" and "evt_1 " are one record.
    IdTrailingSpaceInsensitive,
    /// Ids compare case-insensitively (MySQL's default `utf8mb4_0900_ai_ci`,
    /// SQL Server's default collation, a `lower(id)` unique index): Stripe's
    /// "evt_1Ab" and "evt_1aB" are one record.
    IdCaseInsensitive,
    /// The id column keeps 255 bytes (`VARCHAR(255)` truncating, DynamoDB sort
    /// key built from a cut id) while keys accept 512: long ids that share their
    /// first 255 bytes are one record, and the second event is lost as a
    /// duplicate.
    IdTruncated255,

    // -------------------------------------------------- check-then-write races
    /// claim reads the row, decides, then writes unconditionally one round trip
    /// later (Redis `GET` then `SET` without `NX`/`WATCH`, DynamoDB `GetItem` then
    /// `PutItem` without a condition): concurrent claims of a fresh key all win.
    ClaimCheckThenInsert,
    /// The fresh insert is atomic (`SET NX`, conditional put) but the takeover
    /// of an expired row is read-check-overwrite without comparing the old token:
    /// racers on an expired lease all win.
    TakeoverCheckThenWrite,
    /// release checks the token with one round trip and deletes with another
    /// (the classic Redis lock bug: `GET` compare then `DEL`, no Lua): if the
    /// lease passes and another worker takes over in between, its claim is
    /// deleted.
    ReleaseCheckThenDelete,
    /// complete checks the lease with one round trip and writes the whole row
    /// back with another (`GetItem` then unconditional `PutItem`): a takeover in
    /// between is overwritten by the stale holder's outcome.
    CompleteCheckThenWrite,

    // ------------------------------------------------------------ claim_many
    /// claim_many sends each distinct key once and answers a repeated key with a
    /// copy of the first answer (the Postgres batch's `repeat_answer` without its
    /// claim-id guard): the same key twice in one batch is Claimed twice.
    ClaimManyRepeatClonesFirst,
    /// claim_many decides every key against the state before the batch (one
    /// `BatchGetItem`, then one `BatchWriteItem`): a key twice in one batch is
    /// won twice with two tokens, the first lease silently overwritten.
    ClaimManySnapshot,
    /// The batch statement does not bind the fingerprint (`$5` forgotten in the
    /// `unnest` insert): batch claims neither store nor compare fingerprints, so
    /// a forged payload in a batch is answered InFlight/Duplicate, not Mismatch.
    ClaimManyDropsFingerprint,

    // ------------------------------------------------------------ fingerprint
    /// Fingerprints are compared only on done records (the check lives in the
    /// "duplicate" branch): a different payload while in flight gets InFlight.
    FingerprintOnlyOnDone,
    /// The re-entrant branch (same claim id) runs before the fingerprint check:
    /// a retried claim with the same claim id but another payload is Claimed.
    MismatchLosesToClaimId,
    /// `Option` compared as a whole (`opts.fingerprint != row.fingerprint`):
    /// a record stored without a fingerprint answers Mismatch to a claim that
    /// carries one (and vice versa) instead of Duplicate / InFlight.
    FingerprintOneSidedMismatch,

    // -------------------------------------------------------------- errors
    /// When the store is unreachable (`set_broken(true)`), claim "fails open"
    /// and answers Claimed with a lease it never stored (a team's "never drop a
    /// webhook" policy, or `get().ok().flatten()` treating an error as absent).
    FailOpenClaim,
    /// When the store is unreachable (`set_broken(true)`), complete answers Ok:
    /// the write's result is never checked (fire-and-forget Redis pipeline,
    /// `let _ = client.put_item(..)`); the outcome is lost and the event is
    /// processed again once the lease passes.
    CompleteSwallowsWriteError,

    // =================================================================
    // Second adversary: flaws not covered above, written from CONTRACT.md and
    // dedupe-core's public API only.
    // =================================================================

    // ------------------------------------------------- release, passed lease
    /// Breaks `release` ("only if ... its deadline has not passed ... otherwise
    /// LeaseLost and change nothing"). release checks token and state but not
    /// the deadline: `DELETE FROM r WHERE key = $1 AND token = $2 AND state = 0`
    /// with no `AND expires_at > now()`, or the classic Redis unlock script
    /// (`if GET == token then DEL`) run against a hash whose PTTL is managed by
    /// the app. A worker whose lease passed (nobody has taken over yet) gets Ok
    /// instead of LeaseLost and deletes the record, so the takeover that should
    /// follow is a fresh attempt 1 and the stalled worker never learns it lost.
    ReleaseIgnoresDeadline,

    // ----------------------------------------------------------------- extend
    /// Breaks `extend` ("set the lease deadline to now + ttl"). The author
    /// assumed a heartbeat must never shorten a lease and wrote
    /// `SET expires_at = GREATEST(expires_at, $now + $ttl)` (Postgres),
    /// `MAX(expires_at, ?)` (SQLite), or Redis `PEXPIRE key ttl GT`. An extend
    /// with a ttl shorter than what is left keeps (and answers) the old, later
    /// deadline; a worker that wants to hand the event over sooner cannot.
    ExtendNeverShortens,
    /// Breaks `extend`'s atomicity and rule 4 (fencing). extend reads the row,
    /// checks the token in the application, and writes the whole row back with
    /// the new deadline one round trip later (DynamoDB `GetItem` then an
    /// unconditional `PutItem`; Redis `HGETALL` then `HSET` of every field, no
    /// `WATCH`). A heartbeat racing its own worker's `complete` writes the
    /// in-flight row back over the done one (the outcome is lost and the event
    /// is processed again once the lease passes); one racing a takeover restores
    /// the old token over the new holder's.
    ExtendCheckThenWrite,

    // ----------------------------------------------------------------- expire
    /// Breaks `expire` ("live records are untouched") and rule 1. expire finds
    /// expired keys with one request and deletes them by key with another, not
    /// re-checking the deadline (DynamoDB `Scan` with a filter then
    /// `BatchWriteItem` `DeleteRequest`s, which take no condition; Redis `SCAN` +
    /// `HGET expires_at` then `DEL`; SQL `SELECT key .. WHERE expires_at <= now()`
    /// then `DELETE .. WHERE key = ANY($1)`). A record taken over between the
    /// scan and the delete is the new holder's live claim, and it is deleted:
    /// the next delivery wins as well.
    ExpireScanThenDelete,
    /// Breaks `expire` ("answer how many were removed"). Expiry runs two
    /// statements, done records then in-flight ones (they sit in two partial
    /// indexes), and the count of the first is shadowed:
    /// `let n = tx.execute(DONE)?; let n = tx.execute(IN_FLIGHT)?; Ok(n)`.
    /// Removal is right; the answer counts only expired in-flight records.
    ExpireCountsOnlyLastStatement,

    // ------------------------------------------------------------- re-entrant
    /// Breaks the claim table ("done record inside its retention: Duplicate")
    /// and rule 9. The re-entrant branch tests `claim_id` before `state`: the
    /// Redis Lua script starts with `if stored.claim_id == ARGV.claim_id then
    /// return {'claimed', token, expires_at, attempts}`; the SQL `RETURNING` of
    /// the losing path is matched on claim id first. A client that retries its
    /// claim (same claim id) after its own complete, e.g. a redelivery handled
    /// by the same request id, is answered Claimed with the old token and the
    /// retention deadline, and processes a done event again. (The fingerprint
    /// check still comes first.)
    ReentrantOnDoneRecord,

    // ------------------------------------------------ fingerprint vs. expiry
    /// Breaks rule 5 (expiry is logical) on the fingerprint path: "Mismatch"
    /// is for a *live* record. The upsert's conflict arm checks the payload
    /// before the deadline (`ON CONFLICT DO UPDATE .. WHERE r.fingerprint =
    /// excluded.fingerprint AND r.expires_at <= now()`, and the losing path maps
    /// "fingerprint differs" to Mismatch without looking at `expires_at`; in
    /// DynamoDB, the `ConditionalCheckFailed` item is compared on fingerprint
    /// first). A record whose lease or retention passed answers Mismatch to a
    /// claim with another payload instead of letting it claim afresh.
    MismatchOnExpiredRecord,

    // ----------------------------------------------------------- answer fields
    /// Breaks the claim table ("Live in-flight record: answer InFlight (with
    /// its deadline)" and which attempt holds it). The Lua script / SQL losing
    /// path returns only the deadline and the Rust side fills `attempt: 1`
    /// (`InFlight { deadline, attempt: 1 }`, a placeholder never revisited).
    /// Only visible once a record has been taken over.
    InFlightAttemptOne,

    // --------------------------------------------------------------- outcomes
    /// Breaks `complete` ("store the outcome bytes") and the Duplicate answer.
    /// An empty outcome is not written: DynamoDB once refused empty binary
    /// attributes and the author skips `outcome` when it is empty; Oracle-style
    /// `'' IS NULL`; a Redis `HSET` builder that drops empty values. The done
    /// record then reads back without an outcome and every later claim or get
    /// fails with CorruptRecord instead of answering Duplicate with `b""`.
    EmptyOutcomeDropped,
    /// Breaks rule 8 at its boundary ("an outcome *over* the store's limit").
    /// The size check is `len >= limit` (off by one, or a column sized
    /// `limit - 1` to leave room for a length prefix): an outcome of exactly
    /// `capabilities().max_outcome_bytes` is refused with OutcomeTooLarge, and
    /// the worker that did the work cannot complete.
    OutcomeLimitOffByOne,

    // ------------------------------------------------------------ claim_many
    /// Breaks `claim_many` ("the same answer, key by key, as calling claim for
    /// each") and rule 2 (distinct keys never interfere). The batch folds
    /// repeated keys by event id alone: a `HashMap<&str, usize>` keyed by
    /// `key.id()`, or `SELECT DISTINCT ON (id)` over the `unnest` of the batch.
    /// `stripe:evt_1` and `github:evt_1` in one batch: the second is answered as
    /// a repeat of the first (InFlight) and never claimed. Single claims are
    /// right.
    ClaimManyDedupByIdOnly,

    // ------------------------------------------------------------------- keys
    /// Breaks rule 2 and the key rules (ids compared byte for byte, unicode kept
    /// as given). The id column has a single-byte charset (MySQL `latin1`
    /// table default in non-strict mode, a legacy `WIN1252` Postgres database
    /// with a lossy client conversion): every character above U+00FF is stored
    /// as `?`. `evt_é` stays distinct, but `evt_日本` and `evt_中国`, or two
    /// emoji ids, are one record and the second event is lost as a duplicate.
    IdLatin1Column,

    // =================================================================
    // Requests asked twice (rule 10): what every network store did before
    // it recognised its own writes. Each shows only through a driver that
    // sends a request again after its answer was lost (`Breaker`'s
    // `lose_next_answer`), or a caller that asks again.
    // =================================================================
    /// A claim sent again after its answer was lost meets the record its
    /// first sending wrote and judges it as another claim's: InFlight about
    /// its own fresh record (the Redis script and the DynamoDB conditional
    /// put before they compared the record's token with the one they sent).
    ResentClaimAnswersInFlight,
    /// A complete asked again with the same lease and outcome finds the record
    /// done and answers LeaseLost although its outcome is stored.
    CompleteAgainIsLeaseLost,
    /// A release asked again finds nothing under the key and answers
    /// LeaseLost although the key is free, as asked.
    ReleaseAgainIsLeaseLost,
    /// forget is one delete of whatever is under the key: sent again after
    /// its answer was lost, it finds nothing and answers false although it
    /// removed a live record (and, had a claim come in between, would have
    /// removed that newer claim).
    ForgetUnfenced,

    // The third adversary's (rule 10, release, complete, forget, fencing,
    // expiry), written against the suite as it stood after rule 10.
    /// complete asked again by the same lease on its live done record answers
    /// Ok whatever the outcome (nothing changes).
    CompleteAgainOtherOutcomeOk,
    /// complete asked again with the same outcome rewrites completed_at and
    /// the retention deadline (now + retention).
    CompleteAgainRewritesTimes,
    /// complete asked again with the same outcome re-derives the retention
    /// deadline as `completed_at + retention` (the retention of the request
    /// asked again): unchanged when the retention is the same, moved when not.
    CompleteAgainRetentionFromCompletedAt,
    /// complete asked again answers Ok for a done record of this token with
    /// this outcome even once its retention passed (record expired).
    CompleteAgainIgnoresExpiry,
    /// complete asked again compares only the first 64 bytes of the outcomes.
    CompleteAgainComparesPrefix64,
    /// complete asked again compares only the lengths of the outcomes.
    CompleteAgainComparesLength,
    /// complete answers Ok for a live done record holding the same outcome,
    /// whatever its token (a taken-over lease whose bytes happen to match).
    CompleteOkForOtherTokenSameOutcome,
    /// release of a record whose lease passed (nothing live) deletes it.
    ReleaseExpiredDeletes,
    /// release of a live done record answers Ok (removes nothing).
    ReleaseDoneOk,
    /// release of a live done record of ANOTHER lease answers Ok (removes
    /// nothing); of its own done record, LeaseLost.
    ReleaseOtherDoneOk,
    /// complete and release fence by (token, deadline): a copy of the lease
    /// taken before an extend answers LeaseLost though the lease holds.
    FenceByTokenAndDeadline,
    /// A claim sent again that meets its own live record answers Claimed with
    /// attempt 1 (the script assumes its own record is a fresh insert).
    ResentClaimAttemptOne,
    /// A claim sent again that meets its own live record answers Claimed with
    /// deadline now + lease_ttl computed at the resend, not the stored one.
    ResentClaimFreshDeadline,
    /// After a request was sent again, every later request of the fixture's
    /// handles carries the replayed token (the driver pins its retry token).
    TokenPinnedAfterResend,
    /// forget reads the record (token, live) and then deletes whatever is
    /// under the key, not "the record with the token it read".
    ForgetReadThenDelete,
    /// extend accepts a lease up to 100 ms past its deadline (nobody took over).
    ExtendGrace100ms,
    /// release of its own live record does not delete it but leaves a
    /// tombstone (expired, attempts 0) that expire() removes without counting:
    /// the next claim is attempt 1 but keeps the released record's first_seen.
    ReleaseTombstone,
    /// forget leaves the same tombstone instead of removing the record.
    ForgetTombstone,
    /// complete, release and extend accept a lease whose claim id is the
    /// record's claim id (both set), whatever the token.
    AuthorizeByClaimId,
    /// extend judges its deadline with `>=` (the lease still holds in the
    /// very millisecond of its deadline, when a claim already takes over).
    ExtendInclusiveDeadline,
    /// complete judges its deadline with `>=`, likewise.
    CompleteInclusiveDeadline,
}

/// Every flaw, in declaration order.
pub fn all_flaws() -> Vec<AFlaw> {
    use AFlaw::*;
    vec![
        TakeoverKeepsClaimId,
        TakeoverKeepsFingerprint,
        TakeoverResetsAttempts,
        TakeoverResetsFirstSeen,
        TakeoverReturnsOldAttempt,
        DoneExpiryCountsAsTakeover,
        TakeoverKeepsDoneState,
        CompleteIgnoresDeadline,
        ExtendIgnoresDeadline,
        CompleteTwiceOverwrites,
        ReleaseRemovesDone,
        ExtendShortensDone,
        GetIgnoresExpiry,
        GetSlidesExpiry,
        ForgetCountsExpired,
        ClaimIgnoresLogicalExpiry,
        ExpireJudgesDoneByLease,
        RetentionFromFirstSeen,
        DuplicateCompletedAtNow,
        DeadlineInSeconds,
        LeaseDeadlineUnrounded,
        CompleteSkipsRetentionCheck,
        ExtendFromOldDeadline,
        ReentrantRefreshesDeadline,
        AttemptsCountLosingClaims,
        InFlightDeadlineIsCallerTtl,
        OutcomeTruncated64K,
        ClaimIdTruncated,
        KeyJoinedWithUnderscore,
        IdTrailingSpaceInsensitive,
        IdCaseInsensitive,
        IdTruncated255,
        ClaimCheckThenInsert,
        TakeoverCheckThenWrite,
        ReleaseCheckThenDelete,
        CompleteCheckThenWrite,
        ClaimManyRepeatClonesFirst,
        ClaimManySnapshot,
        ClaimManyDropsFingerprint,
        FingerprintOnlyOnDone,
        MismatchLosesToClaimId,
        FingerprintOneSidedMismatch,
        FailOpenClaim,
        CompleteSwallowsWriteError,
        ReleaseIgnoresDeadline,
        ExtendNeverShortens,
        ExtendCheckThenWrite,
        ExpireScanThenDelete,
        ExpireCountsOnlyLastStatement,
        ReentrantOnDoneRecord,
        MismatchOnExpiredRecord,
        InFlightAttemptOne,
        EmptyOutcomeDropped,
        OutcomeLimitOffByOne,
        ClaimManyDedupByIdOnly,
        IdLatin1Column,
        ResentClaimAnswersInFlight,
        CompleteAgainIsLeaseLost,
        ReleaseAgainIsLeaseLost,
        ForgetUnfenced,
        CompleteAgainOtherOutcomeOk,
        CompleteAgainRewritesTimes,
        CompleteAgainRetentionFromCompletedAt,
        CompleteAgainIgnoresExpiry,
        CompleteAgainComparesPrefix64,
        CompleteAgainComparesLength,
        CompleteOkForOtherTokenSameOutcome,
        ReleaseExpiredDeletes,
        ReleaseDoneOk,
        ReleaseOtherDoneOk,
        FenceByTokenAndDeadline,
        ResentClaimAttemptOne,
        ResentClaimFreshDeadline,
        TokenPinnedAfterResend,
        ForgetReadThenDelete,
        ExtendGrace100ms,
        ReleaseTombstone,
        ForgetTombstone,
        AuthorizeByClaimId,
        ExtendInclusiveDeadline,
        CompleteInclusiveDeadline,
    ]
}

/// Flaws that only show when the store is broken with `set_broken(true)`.
pub fn flaws_needing_faults() -> Vec<AFlaw> {
    vec![AFlaw::FailOpenClaim, AFlaw::CompleteSwallowsWriteError]
}

const IN_FLIGHT: i64 = StoredRecord::IN_FLIGHT;
const DONE: i64 = StoredRecord::DONE;
/// Width of the outcome column under `OutcomeTruncated64K`.
const OUTCOME_COLUMN_BYTES: usize = 65_535;
/// Width of the claim id column under `ClaimIdTruncated`.
const CLAIM_ID_COLUMN_BYTES: usize = 64;
/// Width of the id column under `IdTruncated255`.
const ID_COLUMN_BYTES: usize = 255;
/// The gap a "second round trip" leaves in the check-then-write flaws of
/// complete, release and takeover.
const ROUND_TRIP: Duration = Duration::from_millis(2);

/// One row, as a backend keeps it. Times in epoch milliseconds.
#[derive(Debug, Clone)]
struct Row {
    /// 0 in flight, 1 done.
    state: i64,
    token: String,
    claim_id: Option<String>,
    fingerprint: Option<Vec<u8>>,
    /// Lease deadline while in flight, retention deadline once done.
    expires_at: i64,
    completed_at: Option<i64>,
    outcome: Option<Vec<u8>>,
    attempts: i64,
    first_seen: i64,
    /// The last lease deadline, kept after completion (a second attribute some
    /// backends keep; only `ExpireJudgesDoneByLease` decides by it).
    lease_until: i64,
    /// The TTL of the last claim or extend (only `GetSlidesExpiry` uses it).
    lease_ttl_ms: i64,
    /// Left by `ReleaseTombstone` / `ForgetTombstone` instead of a removal.
    tombstone: bool,
}

impl Row {
    /// Whether this row is held by `lease`: same token, and (unless a flaw skips
    /// the check) in flight and not past its deadline.
    fn holds(&self, lease: &Lease, now: i64, check_state: bool, check_deadline: bool) -> bool {
        self.token == lease.token.as_str()
            && (!check_state || self.state == IN_FLIGHT)
            && (!check_deadline || self.expires_at > now)
    }
}

type Rows = HashMap<(String, String), Row>;

#[derive(Debug, Default)]
struct Shared {
    rows: Mutex<Rows>,
    broken: AtomicBool,
    /// The next request is sent twice (its first answer lost), as a driver
    /// does after a dropped connection.
    resend: AtomicBool,
    /// The tokens a request carries: recorded on its first sending, replayed
    /// on the second, so both carry the same ones.
    tape: Mutex<Tape>,
    /// `TokenPinnedAfterResend`: the token the driver pinned.
    pinned: Mutex<Option<String>>,
}

/// The round trip between forget's read and its delete.
pub const FORGET_ROUND_TRIP: Duration = Duration::from_millis(5);

/// How long the simulated driver waits before sending a request again.
const RESEND_BACKOFF: Duration = Duration::from_millis(10);

#[derive(Debug, Default)]
enum Tape {
    #[default]
    Off,
    Record(Vec<String>),
    Replay(std::collections::VecDeque<String>),
}

/// A small row store, correct unless `flaw` is set. Clones (handles) share rows.
#[derive(Debug, Clone)]
pub struct FlawedStore {
    shared: Arc<Shared>,
    flaw: Option<AFlaw>,
}

fn truncate_bytes(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl FlawedStore {
    /// An empty store with the given flaw (`None`: the correct store).
    pub fn new(flaw: Option<AFlaw>) -> Self {
        Self {
            shared: Arc::new(Shared::default()),
            flaw,
        }
    }

    /// Another handle onto the same rows.
    pub fn handle(&self) -> Self {
        self.clone()
    }

    /// The flaw this store carries.
    pub fn flaw(&self) -> Option<AFlaw> {
        self.flaw
    }

    /// Simulates an unreachable backend for every handle of these rows: each
    /// operation then fails with `Error::Unavailable` (a correct store), except
    /// where `FailOpenClaim` / `CompleteSwallowsWriteError` answer instead.
    pub fn set_broken(&self, on: bool) {
        self.shared.broken.store(on, Ordering::SeqCst);
    }

    /// Makes the next operation run twice and answer the second time, as a
    /// request whose answer was lost and that the driver sent again.
    pub fn lose_next_answer(&self) {
        self.shared.resend.store(true, Ordering::SeqCst);
    }

    /// Whether the answer [`lose_next_answer`](Self::lose_next_answer) asked
    /// for was lost (disarms it either way).
    pub fn answer_was_lost(&self) -> bool {
        !self.shared.resend.swap(false, Ordering::SeqCst)
    }

    fn take_resend(&self) -> bool {
        self.shared.resend.swap(false, Ordering::SeqCst)
    }

    fn tape(&self) -> MutexGuard<'_, Tape> {
        self.shared.tape.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A token a request carries (the same on a second sending).
    fn request_token(&self) -> String {
        let pinned = self
            .shared
            .pinned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let fresh = || {
            pinned
                .clone()
                .unwrap_or_else(|| backend::new_token().to_string())
        };
        let mut tape = self.tape();
        let t = match &mut *tape {
            Tape::Replay(tokens) => {
                if let Some(t) = tokens.pop_front() {
                    t
                } else {
                    fresh()
                }
            }
            Tape::Record(tokens) => {
                let t = fresh();
                tokens.push(t.clone());
                t
            }
            Tape::Off => fresh(),
        };
        if matches!(&*tape, Tape::Replay(_)) && self.has(AFlaw::TokenPinnedAfterResend) {
            *self.shared.pinned.lock().unwrap_or_else(|e| e.into_inner()) = Some(t.clone());
        }
        t
    }

    /// Runs `op` twice when a lost answer is armed (the first answer dropped,
    /// the request sent again with the same tokens), else once.
    async fn sent<T, F, Fut>(&self, op: F) -> Result<T>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        if !self.take_resend() {
            return op().await;
        }
        *self.tape() = Tape::Record(Vec::new());
        let _lost = op().await;
        let recorded = std::mem::take(&mut *self.tape());
        if let Tape::Record(tokens) = recorded {
            *self.tape() = Tape::Replay(tokens.into());
        }
        tokio::time::sleep(RESEND_BACKOFF).await;
        let answer = op().await;
        *self.tape() = Tape::Off;
        answer
    }

    fn has(&self, flaw: AFlaw) -> bool {
        self.flaw == Some(flaw)
    }

    /// `Row::holds`, with the fencing flaws of the third adversary.
    fn row_holds(
        &self,
        row: &Row,
        lease: &Lease,
        now: i64,
        check_state: bool,
        check_deadline: bool,
    ) -> bool {
        let by_claim_id = self.has(AFlaw::AuthorizeByClaimId)
            && lease.claim_id.is_some()
            && lease.claim_id.as_ref().map(ClaimId::as_str) == row.claim_id.as_deref();
        let mut l = lease.clone();
        if by_claim_id {
            l.token = stored_token(row.token.clone());
        }
        row.holds(&l, now, check_state, check_deadline)
            && (!self.has(AFlaw::FenceByTokenAndDeadline)
                || row.expires_at == to_millis(lease.deadline))
    }

    fn is_broken(&self) -> bool {
        self.shared.broken.load(Ordering::SeqCst)
    }

    fn unavailable() -> Error {
        Error::unavailable("flawed store: connection refused (simulated)", None)
    }

    fn check_broken(&self) -> Result<()> {
        if self.is_broken() {
            return Err(Self::unavailable());
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Rows> {
        self.shared.rows.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The row's primary key for `key`.
    fn row_key(&self, key: &Key) -> (String, String) {
        let ns = key.namespace().to_string();
        let id = key.id();
        match self.flaw {
            Some(AFlaw::KeyJoinedWithUnderscore) => (format!("{ns}_{id}"), String::new()),
            Some(AFlaw::IdTrailingSpaceInsensitive) => (ns, id.trim_end_matches(' ').to_string()),
            Some(AFlaw::IdCaseInsensitive) => (ns, id.to_lowercase()),
            Some(AFlaw::IdTruncated255) => (ns, truncate_bytes(id, ID_COLUMN_BYTES)),
            Some(AFlaw::IdLatin1Column) => (
                ns,
                id.chars()
                    .map(|c| if u32::from(c) > 0xFF { '?' } else { c })
                    .collect(),
            ),
            _ => (ns, id.to_string()),
        }
    }

    /// `now + ttl` in epoch milliseconds, as this store writes deadlines.
    fn deadline(&self, now: i64, ttl: Duration) -> i64 {
        if self.has(AFlaw::DeadlineInSeconds) {
            let secs = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX / 2000);
            (now / 1000).saturating_add(secs).saturating_mul(1000)
        } else {
            now.saturating_add(duration_millis(ttl))
        }
    }

    /// The options as the store sees them (claim id cut to the column width
    /// under `ClaimIdTruncated`).
    fn effective_opts(&self, opts: &ClaimOptions) -> ClaimOptions {
        let mut o = opts.clone();
        if self.has(AFlaw::ClaimIdTruncated) {
            if let Some(c) = &opts.claim_id {
                let cut = truncate_bytes(c.as_str(), CLAIM_ID_COLUMN_BYTES);
                o.claim_id = ClaimId::new(cut).ok().or_else(|| opts.claim_id.clone());
            }
        }
        o
    }

    fn decode(key: &Key, row: &Row) -> Result<Record> {
        StoredRecord {
            state: row.state,
            token: row.token.clone(),
            claim_id: row.claim_id.clone(),
            fingerprint: row.fingerprint.clone(),
            expires_ms: row.expires_at,
            completed_ms: row.completed_at,
            outcome: row.outcome.clone(),
            attempts: row.attempts,
            first_seen_ms: row.first_seen,
        }
        .decode(key)
    }

    /// The row a winning claim writes, given the (expired) row it replaces.
    fn new_row(&self, prev: Option<&Row>, opts: &ClaimOptions, now: i64, token: String) -> Row {
        let until = self.deadline(now, opts.lease_ttl);
        let (mut attempts, mut first_seen) = match prev {
            Some(p) if p.state == IN_FLIGHT || self.has(AFlaw::DoneExpiryCountsAsTakeover) => {
                (p.attempts.saturating_add(1), p.first_seen)
            }
            _ => (1, now),
        };
        if prev.is_some() && self.has(AFlaw::TakeoverResetsAttempts) {
            attempts = 1;
        }
        if prev.is_some() && self.has(AFlaw::TakeoverResetsFirstSeen) {
            first_seen = now;
        }
        let mut row = Row {
            state: IN_FLIGHT,
            token,
            claim_id: opts.claim_id.as_ref().map(|c| c.as_str().to_string()),
            fingerprint: opts.fingerprint.as_ref().map(|f| f.as_bytes().to_vec()),
            expires_at: until,
            completed_at: None,
            outcome: None,
            attempts,
            first_seen,
            lease_until: until,
            lease_ttl_ms: duration_millis(opts.lease_ttl),
            tombstone: false,
        };
        if let Some(p) = prev {
            if self.has(AFlaw::TakeoverKeepsClaimId) && row.claim_id.is_none() {
                row.claim_id = p.claim_id.clone();
            }
            if self.has(AFlaw::TakeoverKeepsFingerprint) {
                row.fingerprint = p.fingerprint.clone();
            }
            if self.has(AFlaw::TakeoverKeepsDoneState) {
                row.state = p.state;
                row.completed_at = p.completed_at;
                row.outcome = p.outcome.clone();
            }
        }
        row
    }

    /// The lease a winning claim hands back for the row it wrote.
    fn winning_lease(
        &self,
        key: &Key,
        row: &Row,
        prev: Option<&Row>,
        opts: &ClaimOptions,
        now_sys: SystemTime,
    ) -> Result<Lease> {
        let attempts = match prev {
            Some(p) if self.has(AFlaw::TakeoverReturnsOldAttempt) => p.attempts,
            _ => row.attempts,
        };
        let attempt = u32::try_from(attempts)
            .map_err(|_| Error::corrupt(key, format!("attempt count {attempts}")))?;
        let deadline = if self.has(AFlaw::LeaseDeadlineUnrounded) {
            now_sys + opts.lease_ttl
        } else {
            from_millis(row.expires_at)
        };
        Ok(Lease {
            key: key.clone(),
            token: stored_token(row.token.clone()),
            deadline,
            attempt,
            claim_id: opts.claim_id.clone(),
        })
    }

    /// The answer of a claim that found a live row (`opts` already effective).
    fn answer_live(
        &self,
        row: &mut Row,
        key: &Key,
        opts: &ClaimOptions,
        now: i64,
    ) -> Result<ClaimOutcome> {
        if self.has(AFlaw::AttemptsCountLosingClaims) {
            row.attempts = row.attempts.saturating_add(1);
        }
        let given: Option<Vec<u8>> = opts.fingerprint.as_ref().map(|f| f.as_bytes().to_vec());
        if self.has(AFlaw::FingerprintOneSidedMismatch) && given != row.fingerprint {
            let state = if row.state == DONE {
                RecordStateKind::Done
            } else {
                RecordStateKind::InFlight
            };
            return Ok(ClaimOutcome::Mismatch { state });
        }
        let in_flight = row.state == IN_FLIGHT;
        let same_claim = opts.claim_id.is_some()
            && opts.claim_id.as_ref().map(ClaimId::as_str) == row.claim_id.as_deref();
        let mut o = opts.clone();
        if in_flight
            && (self.has(AFlaw::FingerprintOnlyOnDone)
                || (self.has(AFlaw::MismatchLosesToClaimId) && same_claim))
        {
            o.fingerprint = None;
        }
        if self.has(AFlaw::ReentrantOnDoneRecord) && row.state == DONE && same_claim {
            let differs = matches!(
                (&given, &row.fingerprint),
                (Some(g), Some(r)) if g != r
            );
            if !differs {
                // The script's first branch: "our own claim id: hand our lease
                // back", read from the row whatever its state.
                let attempt = u32::try_from(row.attempts)
                    .map_err(|_| Error::corrupt(key, format!("attempt count {}", row.attempts)))?;
                return Ok(ClaimOutcome::Claimed(Lease {
                    key: key.clone(),
                    token: stored_token(row.token.clone()),
                    deadline: from_millis(row.expires_at),
                    attempt,
                    claim_id: opts.claim_id.clone(),
                }));
            }
        }
        let answer = backend::losing_claim(Self::decode(key, row)?, &o);
        Ok(match answer {
            ClaimOutcome::InFlight { deadline, .. } if self.has(AFlaw::InFlightAttemptOne) => {
                ClaimOutcome::InFlight {
                    deadline,
                    attempt: 1,
                }
            }
            ClaimOutcome::Claimed(lease) if self.has(AFlaw::ReentrantRefreshesDeadline) => {
                let until = self.deadline(now, opts.lease_ttl);
                row.expires_at = until;
                row.lease_until = until;
                row.lease_ttl_ms = duration_millis(opts.lease_ttl);
                ClaimOutcome::Claimed(Lease {
                    deadline: from_millis(until),
                    ..lease
                })
            }
            ClaimOutcome::InFlight { attempt, .. }
                if self.has(AFlaw::InFlightDeadlineIsCallerTtl) =>
            {
                ClaimOutcome::InFlight {
                    deadline: from_millis(self.deadline(now, opts.lease_ttl)),
                    attempt,
                }
            }
            ClaimOutcome::Duplicate { outcome, .. } if self.has(AFlaw::DuplicateCompletedAtNow) => {
                ClaimOutcome::Duplicate {
                    outcome,
                    completed_at: SystemTime::now(),
                }
            }
            other => other,
        })
    }

    /// The whole claim, under the lock (atomic).
    fn claim_locked(
        &self,
        map: &mut Rows,
        key: &Key,
        opts: &ClaimOptions,
        now_sys: SystemTime,
        token: String,
    ) -> Result<ClaimOutcome> {
        let opts = self.effective_opts(opts);
        let now = to_millis(now_sys);
        let rk = self.row_key(key);
        if let Some(row) = map.get_mut(&rk) {
            let own = row.token == token && row.state == IN_FLIGHT && row.expires_at > now;
            if own && !self.has(AFlaw::ResentClaimAnswersInFlight) {
                // This request's own record, from its first sending.
                let mut lease = self.winning_lease(key, row, None, &opts, now_sys)?;
                if self.has(AFlaw::ResentClaimAttemptOne) {
                    lease.attempt = 1;
                }
                if self.has(AFlaw::ResentClaimFreshDeadline) {
                    lease.deadline = from_millis(self.deadline(now, opts.lease_ttl));
                }
                return Ok(ClaimOutcome::Claimed(lease));
            }
            if self.has(AFlaw::ClaimIgnoresLogicalExpiry) || row.expires_at > now {
                return self.answer_live(row, key, &opts, now);
            }
            if self.has(AFlaw::MismatchOnExpiredRecord) {
                let given = opts.fingerprint.as_ref().map(|f| f.as_bytes());
                if let (Some(g), Some(r)) = (given, row.fingerprint.as_deref()) {
                    if g != r {
                        let state = if row.state == DONE {
                            RecordStateKind::Done
                        } else {
                            RecordStateKind::InFlight
                        };
                        return Ok(ClaimOutcome::Mismatch { state });
                    }
                }
            }
        }
        let prev = map.get(&rk).cloned();
        let row = self.new_row(prev.as_ref(), &opts, now, token);
        let lease = self.winning_lease(key, &row, prev.as_ref(), &opts, now_sys)?;
        map.insert(rk, row);
        Ok(ClaimOutcome::Claimed(lease))
    }

    /// The claim of `ClaimCheckThenInsert` / `TakeoverCheckThenWrite`: read,
    /// decide, and write one round trip later without re-checking.
    async fn claim_racy(
        &self,
        key: &Key,
        opts: &ClaimOptions,
        now_sys: SystemTime,
        token: String,
    ) -> Result<ClaimOutcome> {
        let now = to_millis(now_sys);
        let rk = self.row_key(key);
        let snapshot: Option<Row> = {
            let map = self.lock();
            let found = map.get(&rk).cloned();
            found
        };
        let racy = match &snapshot {
            None => self.has(AFlaw::ClaimCheckThenInsert),
            Some(row) => row.expires_at <= now,
        };
        if !racy {
            let mut map = self.lock();
            return self.claim_locked(&mut map, key, opts, now_sys, token);
        }
        if snapshot.is_some() {
            tokio::time::sleep(ROUND_TRIP).await;
        } else {
            tokio::task::yield_now().await;
        }
        let opts = self.effective_opts(opts);
        let row = self.new_row(snapshot.as_ref(), &opts, now, token);
        let lease = self.winning_lease(key, &row, snapshot.as_ref(), &opts, now_sys)?;
        self.lock().insert(rk, row);
        Ok(ClaimOutcome::Claimed(lease))
    }

    /// The lease a fail-open claim invents without storing anything.
    fn fail_open_lease(&self, key: &Key, opts: &ClaimOptions, now_sys: SystemTime) -> Lease {
        Lease {
            key: key.clone(),
            token: backend::new_token(),
            deadline: from_millis(self.deadline(to_millis(now_sys), opts.lease_ttl)),
            attempt: 1,
            claim_id: opts.claim_id.clone(),
        }
    }

    /// Whether a complete asked again carries the stored outcome.
    fn same_outcome(&self, stored: Option<&[u8]>, given: &[u8]) -> bool {
        let Some(stored) = stored else {
            return false;
        };
        if self.has(AFlaw::CompleteAgainOtherOutcomeOk) {
            return true;
        }
        if self.has(AFlaw::CompleteAgainComparesLength) {
            return stored.len() == given.len();
        }
        if self.has(AFlaw::CompleteAgainComparesPrefix64) {
            return stored[..stored.len().min(64)] == given[..given.len().min(64)];
        }
        stored == given
    }

    fn mark_done(&self, row: &mut Row, outcome: Vec<u8>, retention: Duration, now: i64) {
        row.state = DONE;
        row.completed_at = Some(now);
        row.outcome = if self.has(AFlaw::EmptyOutcomeDropped) && outcome.is_empty() {
            None
        } else {
            Some(outcome)
        };
        row.expires_at = if self.has(AFlaw::RetentionFromFirstSeen) {
            row.first_seen.saturating_add(duration_millis(retention))
        } else {
            self.deadline(now, retention)
        };
    }
}

/// The operations, each as one sending of its request.
impl FlawedStore {
    async fn claim_once(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        opts.validate()?;
        let now_sys = SystemTime::now();
        if self.is_broken() {
            if self.has(AFlaw::FailOpenClaim) {
                return Ok(ClaimOutcome::Claimed(
                    self.fail_open_lease(key, opts, now_sys),
                ));
            }
            return Err(Self::unavailable());
        }
        let token = self.request_token();
        if self.has(AFlaw::ClaimCheckThenInsert) || self.has(AFlaw::TakeoverCheckThenWrite) {
            return self.claim_racy(key, opts, now_sys, token).await;
        }
        let mut map = self.lock();
        self.claim_locked(&mut map, key, opts, now_sys, token)
    }

    async fn complete_once(
        &self,
        lease: &Lease,
        outcome: &[u8],
        retention: Duration,
    ) -> Result<()> {
        if !self.has(AFlaw::CompleteSkipsRetentionCheck) {
            check_ttl("retention", retention)?;
        }
        self.capabilities().check_outcome(outcome)?;
        if self.has(AFlaw::OutcomeLimitOffByOne) {
            let limit = self.capabilities().max_outcome_bytes;
            if outcome.len() >= limit {
                return Err(Error::OutcomeTooLarge {
                    size: outcome.len(),
                    limit,
                });
            }
        }
        if self.is_broken() {
            if self.has(AFlaw::CompleteSwallowsWriteError) {
                return Ok(());
            }
            return Err(Self::unavailable());
        }
        let now = to_millis(SystemTime::now());
        let rk = self.row_key(&lease.key);
        let kept: Vec<u8> = if self.has(AFlaw::OutcomeTruncated64K) {
            outcome[..outcome.len().min(OUTCOME_COLUMN_BYTES)].to_vec()
        } else {
            outcome.to_vec()
        };
        let check_state = !self.has(AFlaw::CompleteTwiceOverwrites);
        let check_deadline = !self.has(AFlaw::CompleteIgnoresDeadline);
        // `CompleteInclusiveDeadline`: the deadline is judged with `>=`.
        let now_judged = if self.has(AFlaw::CompleteInclusiveDeadline) {
            now - 1
        } else {
            now
        };
        if self.has(AFlaw::CompleteCheckThenWrite) {
            let snapshot: Option<Row> = {
                let map = self.lock();
                let found = map
                    .get(&rk)
                    .filter(|row| self.row_holds(row, lease, now, check_state, check_deadline))
                    .cloned();
                found
            };
            let Some(mut row) = snapshot else {
                return Err(Error::lease_lost(&lease.key));
            };
            tokio::time::sleep(ROUND_TRIP).await;
            self.mark_done(&mut row, kept, retention, now);
            self.lock().insert(rk, row);
            return Ok(());
        }
        let mut map = self.lock();
        match map.get_mut(&rk) {
            Some(row) if self.row_holds(row, lease, now_judged, check_state, check_deadline) => {
                self.mark_done(row, kept, retention, now);
                Ok(())
            }
            // Done already by this lease with this outcome: asked again.
            Some(row)
                if !self.has(AFlaw::CompleteAgainIsLeaseLost)
                    && (row.token == lease.token.as_str()
                        || self.has(AFlaw::CompleteOkForOtherTokenSameOutcome))
                    && row.state == DONE
                    && (row.expires_at > now || self.has(AFlaw::CompleteAgainIgnoresExpiry))
                    && self.same_outcome(row.outcome.as_deref(), &kept) =>
            {
                if self.has(AFlaw::CompleteAgainRewritesTimes) {
                    self.mark_done(row, kept, retention, now);
                }
                if self.has(AFlaw::CompleteAgainRetentionFromCompletedAt) {
                    if let Some(at) = row.completed_at {
                        row.expires_at = at.saturating_add(duration_millis(retention));
                    }
                }
                Ok(())
            }
            _ => Err(Error::lease_lost(&lease.key)),
        }
    }

    async fn release_once(&self, lease: &Lease) -> Result<()> {
        self.check_broken()?;
        let now = to_millis(SystemTime::now());
        let rk = self.row_key(&lease.key);
        let check_state = !self.has(AFlaw::ReleaseRemovesDone);
        let check_deadline = !self.has(AFlaw::ReleaseIgnoresDeadline);
        if self.has(AFlaw::ReleaseCheckThenDelete) {
            let held = {
                let map = self.lock();
                let found = map.get(&rk).is_some_and(|row| {
                    self.row_holds(row, lease, now, check_state, check_deadline)
                });
                found
            };
            if !held {
                return Err(Error::lease_lost(&lease.key));
            }
            tokio::time::sleep(ROUND_TRIP).await;
            self.lock().remove(&rk);
            return Ok(());
        }
        let mut map = self.lock();
        match map.get_mut(&rk) {
            Some(row) if self.row_holds(row, lease, now, check_state, check_deadline) => {
                if self.has(AFlaw::ReleaseTombstone) {
                    row.expires_at = now;
                    row.attempts = 0;
                    row.tombstone = true;
                } else {
                    map.remove(&rk);
                }
                Ok(())
            }
            // Nothing live under the key: free, as asked.
            Some(row) if row.expires_at <= now && !self.has(AFlaw::ReleaseAgainIsLeaseLost) => {
                if self.has(AFlaw::ReleaseExpiredDeletes) {
                    map.remove(&rk);
                }
                Ok(())
            }
            Some(row) if row.state == DONE && self.has(AFlaw::ReleaseDoneOk) => Ok(()),
            Some(row)
                if row.state == DONE
                    && row.token != lease.token.as_str()
                    && self.has(AFlaw::ReleaseOtherDoneOk) =>
            {
                Ok(())
            }
            None if !self.has(AFlaw::ReleaseAgainIsLeaseLost) => Ok(()),
            _ => Err(Error::lease_lost(&lease.key)),
        }
    }

    async fn extend_once(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_ttl("lease ttl", ttl)?;
        self.check_broken()?;
        let now_sys = SystemTime::now();
        let now = to_millis(now_sys);
        let rk = self.row_key(&lease.key);
        let check_state = !self.has(AFlaw::ExtendShortensDone);
        let check_deadline = !self.has(AFlaw::ExtendIgnoresDeadline);
        // `ExtendGrace100ms`: the deadline is judged 100 ms late.
        let now_judged = if self.has(AFlaw::ExtendGrace100ms) {
            now - 100
        } else if self.has(AFlaw::ExtendInclusiveDeadline) {
            now - 1
        } else {
            now
        };
        if self.has(AFlaw::ExtendCheckThenWrite) {
            // Read the row, check the token here, write the whole row back one
            // round trip later without a condition.
            let snapshot: Option<Row> = {
                let map = self.lock();
                let found = map
                    .get(&rk)
                    .filter(|row| self.row_holds(row, lease, now, check_state, check_deadline))
                    .cloned();
                found
            };
            let Some(mut row) = snapshot else {
                return Err(Error::lease_lost(&lease.key));
            };
            tokio::time::sleep(ROUND_TRIP).await;
            let until = self.deadline(now, ttl);
            row.expires_at = until;
            row.lease_until = until;
            row.lease_ttl_ms = duration_millis(ttl);
            self.lock().insert(rk, row);
            return Ok(Lease {
                deadline: from_millis(until),
                ..lease.clone()
            });
        }
        let mut map = self.lock();
        match map.get_mut(&rk) {
            Some(row) if self.row_holds(row, lease, now_judged, check_state, check_deadline) => {
                let until = if self.has(AFlaw::ExtendFromOldDeadline) {
                    row.expires_at.saturating_add(duration_millis(ttl))
                } else if self.has(AFlaw::ExtendNeverShortens) {
                    row.expires_at.max(self.deadline(now, ttl))
                } else {
                    self.deadline(now, ttl)
                };
                row.expires_at = until;
                row.lease_until = until;
                row.lease_ttl_ms = duration_millis(ttl);
                let deadline = if self.has(AFlaw::LeaseDeadlineUnrounded) {
                    now_sys + ttl
                } else {
                    from_millis(until)
                };
                Ok(Lease {
                    deadline,
                    ..lease.clone()
                })
            }
            _ => Err(Error::lease_lost(&lease.key)),
        }
    }

    async fn expire_once(&self) -> Result<u64> {
        self.check_broken()?;
        let now = to_millis(SystemTime::now());
        let by_lease = self.has(AFlaw::ExpireJudgesDoneByLease);
        if self.has(AFlaw::ExpireScanThenDelete) {
            // Request 1: find the expired keys.
            let expired: Vec<(String, String)> = {
                let map = self.lock();
                let found = map
                    .iter()
                    .filter(|(_, row)| row.expires_at <= now)
                    .map(|(rk, _)| rk.clone())
                    .collect();
                found
            };
            if expired.is_empty() {
                return Ok(0);
            }
            tokio::time::sleep(ROUND_TRIP).await;
            // Request 2: delete them by key, no condition.
            let mut map = self.lock();
            let removed = expired
                .iter()
                .filter(|rk| map.remove(*rk).is_some())
                .count();
            return Ok(removed as u64);
        }
        if self.has(AFlaw::ExpireCountsOnlyLastStatement) {
            let mut map = self.lock();
            let before = map.len();
            map.retain(|_, row| !(row.state == DONE && row.expires_at <= now));
            let removed_done = (before - map.len()) as u64;
            let before = map.len();
            map.retain(|_, row| !(row.state == IN_FLIGHT && row.expires_at <= now));
            let removed_in_flight = (before - map.len()) as u64;
            // The flaw: the first statement's count is shadowed, not added.
            let _ = removed_done;
            return Ok(removed_in_flight);
        }
        let mut map = self.lock();
        let before = map.len();
        let mut tombstones = 0;
        map.retain(|_, row| {
            let keep = if by_lease {
                row.lease_until > now
            } else {
                row.expires_at > now
            };
            if !keep && row.tombstone {
                tombstones += 1;
            }
            keep
        });
        Ok((before - map.len() - tombstones) as u64)
    }

    async fn get_once(&self, key: &Key) -> Result<Option<Record>> {
        self.check_broken()?;
        let now = to_millis(SystemTime::now());
        let rk = self.row_key(key);
        let mut map = self.lock();
        let Some(row) = map.get_mut(&rk) else {
            return Ok(None);
        };
        if !(self.has(AFlaw::GetIgnoresExpiry) || row.expires_at > now) {
            return Ok(None);
        }
        if self.has(AFlaw::GetSlidesExpiry) && row.state == IN_FLIGHT {
            let slid = now.saturating_add(row.lease_ttl_ms);
            if slid > row.expires_at {
                row.expires_at = slid;
                row.lease_until = slid;
            }
        }
        Self::decode(key, row).map(Some)
    }

    /// `ForgetUnfenced`'s forget: one delete of whatever is there.
    async fn forget_once(&self, key: &Key) -> Result<bool> {
        self.check_broken()?;
        let now = to_millis(SystemTime::now());
        let rk = self.row_key(key);
        let removed = self.lock().remove(&rk);
        Ok(match removed {
            Some(row) => self.has(AFlaw::ForgetCountsExpired) || row.expires_at > now,
            None => false,
        })
    }

    /// The first request of a fenced forget: the row's token, and whether it
    /// is live.
    async fn peek_once(&self, key: &Key) -> Result<Option<(String, bool)>> {
        self.check_broken()?;
        let now = to_millis(SystemTime::now());
        let rk = self.row_key(key);
        Ok(self.lock().get(&rk).map(|row| {
            let live = self.has(AFlaw::ForgetCountsExpired) || row.expires_at > now;
            (row.token.clone(), live)
        }))
    }

    /// The second: removes the row while it holds `token`; `false` when
    /// another row is there now.
    async fn forget_if_once(&self, key: &Key, token: &str) -> Result<bool> {
        self.check_broken()?;
        let rk = self.row_key(key);
        let mut map = self.lock();
        match map.get_mut(&rk) {
            Some(row) if row.token != token && !self.has(AFlaw::ForgetReadThenDelete) => Ok(false),
            Some(row) if self.has(AFlaw::ForgetTombstone) => {
                row.expires_at = to_millis(SystemTime::now());
                row.attempts = 0;
                row.state = IN_FLIGHT;
                row.completed_at = None;
                row.outcome = None;
                row.tombstone = true;
                Ok(true)
            }
            Some(_) => {
                map.remove(&rk);
                Ok(true)
            }
            None => Ok(true),
        }
    }

    async fn claim_many_once(
        &self,
        keys: &[Key],
        opts: &ClaimOptions,
    ) -> Result<Vec<ClaimOutcome>> {
        opts.validate()?;
        dedupe_core::backend::check_batch(keys)?;
        let now_sys = SystemTime::now();
        if self.is_broken() {
            if self.has(AFlaw::FailOpenClaim) {
                return Ok(keys
                    .iter()
                    .map(|k| ClaimOutcome::Claimed(self.fail_open_lease(k, opts, now_sys)))
                    .collect());
            }
            return Err(Self::unavailable());
        }
        let mut batch_opts = opts.clone();
        if self.has(AFlaw::ClaimManyDropsFingerprint) {
            batch_opts.fingerprint = None;
        }
        let mut map = self.lock();
        let mut answers: Vec<ClaimOutcome> = Vec::with_capacity(keys.len());

        if self.has(AFlaw::ClaimManySnapshot) {
            // Every key decided against the rows as they were before the batch;
            // the writes are applied afterwards.
            let mut writes: Vec<((String, String), Row)> = Vec::new();
            for key in keys {
                let rk = self.row_key(key);
                let mut scratch: Rows = HashMap::new();
                if let Some(row) = map.get(&rk) {
                    scratch.insert(rk.clone(), row.clone());
                }
                answers.push(self.claim_locked(
                    &mut scratch,
                    key,
                    &batch_opts,
                    now_sys,
                    self.request_token(),
                )?);
                if let Some(row) = scratch.remove(&rk) {
                    writes.push((rk, row));
                }
            }
            for (rk, row) in writes {
                map.insert(rk, row);
            }
            return Ok(answers);
        }

        if self.has(AFlaw::ClaimManyRepeatClonesFirst) {
            let mut first: HashMap<Key, usize> = HashMap::new();
            for key in keys {
                if let Some(&i) = first.get(key) {
                    let copy = answers[i].clone();
                    answers.push(copy);
                    continue;
                }
                first.insert(key.clone(), answers.len());
                answers.push(self.claim_locked(
                    &mut map,
                    key,
                    &batch_opts,
                    now_sys,
                    self.request_token(),
                )?);
            }
            return Ok(answers);
        }

        if self.has(AFlaw::ClaimManyDedupByIdOnly) {
            // Repeats folded by event id alone; a repeat answers what a claim
            // right after the first would (InFlight on the lease just won, or
            // the same answer again), without touching storage.
            let mut first: HashMap<String, usize> = HashMap::new();
            for key in keys {
                if let Some(&i) = first.get(key.id()) {
                    let repeat = match &answers[i] {
                        ClaimOutcome::Claimed(lease) if batch_opts.claim_id.is_none() => {
                            ClaimOutcome::InFlight {
                                deadline: lease.deadline,
                                attempt: lease.attempt,
                            }
                        }
                        other => other.clone(),
                    };
                    answers.push(repeat);
                    continue;
                }
                first.insert(key.id().to_string(), answers.len());
                answers.push(self.claim_locked(
                    &mut map,
                    key,
                    &batch_opts,
                    now_sys,
                    self.request_token(),
                )?);
            }
            return Ok(answers);
        }

        for key in keys {
            answers.push(self.claim_locked(
                &mut map,
                key,
                &batch_opts,
                now_sys,
                self.request_token(),
            )?);
        }
        Ok(answers)
    }

    fn caps(&self) -> Capabilities {
        Capabilities::new()
    }
}

#[async_trait]
impl DedupeStore for FlawedStore {
    async fn claim(&self, key: &Key, opts: &ClaimOptions) -> Result<ClaimOutcome> {
        self.sent(|| self.claim_once(key, opts)).await
    }

    async fn complete(&self, lease: &Lease, outcome: &[u8], retention: Duration) -> Result<()> {
        self.sent(|| self.complete_once(lease, outcome, retention))
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.sent(|| self.release_once(lease)).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.sent(|| self.extend_once(lease, ttl)).await
    }

    async fn expire(&self) -> Result<u64> {
        self.sent(|| self.expire_once()).await
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.sent(|| self.get_once(key)).await
    }

    async fn forget(&self, key: &Key) -> Result<bool> {
        if self.has(AFlaw::ForgetUnfenced) {
            return self.sent(|| self.forget_once(key)).await;
        }
        loop {
            let Some((token, live)) = self.sent(|| self.peek_once(key)).await? else {
                return Ok(false);
            };
            // Two requests: a round trip between the read and the delete.
            tokio::time::sleep(FORGET_ROUND_TRIP).await;
            if self.sent(|| self.forget_if_once(key, &token)).await? {
                return Ok(live);
            }
        }
    }

    async fn claim_many(&self, keys: &[Key], opts: &ClaimOptions) -> Result<Vec<ClaimOutcome>> {
        self.sent(|| self.claim_many_once(keys, opts)).await
    }

    fn capabilities(&self) -> Capabilities {
        self.caps()
    }
}

/// Makes one fresh `FlawedStore` per fixture; `None` is the correct store.
#[derive(Debug, Clone, Copy, Default)]
pub struct FlawedFactory(pub Option<AFlaw>);

#[derive(Debug)]
struct FlawedFixture(FlawedStore);

#[async_trait]
impl StoreFactory for FlawedFactory {
    async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
        Ok(Box::new(FlawedFixture(FlawedStore::new(self.0))))
    }
}

#[async_trait]
impl Fixture for FlawedFixture {
    fn store(&self) -> Arc<dyn DedupeStore> {
        Arc::new(self.0.handle())
    }

    async fn open_handle(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        Ok(Arc::new(self.0.handle()))
    }

    async fn faulty_handle(&self) -> Result<Option<FaultyHandle>, Error> {
        Ok(Some(FaultyHandle {
            store: Arc::new(self.0.handle()),
            switch: Box::new(Breaker(self.0.handle())),
            bound: Duration::from_secs(1),
        }))
    }
}

/// Breaks every handle of a flawed store's rows (the connection is shared).
struct Breaker(FlawedStore);

#[async_trait]
impl FaultSwitch for Breaker {
    async fn set_broken(&self, broken: bool) -> Result<(), Error> {
        self.0.set_broken(broken);
        Ok(())
    }

    async fn lose_next_answer(&self) -> Result<bool, Error> {
        self.0.lose_next_answer();
        Ok(true)
    }

    async fn answer_was_lost(&self) -> Result<bool, Error> {
        Ok(self.0.answer_was_lost())
    }
}

-- 0001: the records table, one row per key.
--
-- `PgStore::migrate()` applies every file of this folder in the order of
-- their numbers, each time it runs, under an advisory lock on the table's
-- name: each file must be safe to apply again (`IF NOT EXISTS`, or a check
-- of the catalog first), so an up-to-date table is left as it is and no
-- second table has to record which have run. A schema change is a new file
-- with the next number, listed in CHANGELOG.md; a file that has been
-- released never changes. `{schema}` and `{table}` are the store's names,
-- checked to be plain identifiers before they are put in.
--
-- The table is kept as cheap to write as the contract allows; each point was
-- measured with pgbench (server time per statement, see the crate README):
-- - one key column, `namespace:id`: against two columns (namespace, id), a
--   new key's insert takes about 10% less server time, and a batch of 16
--   about 14% less (the unique index compares and stores one string instead
--   of two);
-- - the key compares bytes (`COLLATE "C"`): a key is an opaque string, the
--   primary key needs no locale rules, and its order can never change under
--   an operating-system upgrade;
-- - no index on `expires_at`: a completion rewrites the deadline, and with
--   that index no completion could be a HOT update and every claim would
--   write two index entries; `expire()` walks the table instead;
-- - no CHECK on `state`: the decoder refuses any state it does not know
--   (CorruptRecord), and a CHECK is evaluated anew on every insert and
--   update.
CREATE SCHEMA IF NOT EXISTS "{schema}";
CREATE TABLE IF NOT EXISTS "{schema}"."{table}" (
    key          text COLLATE "C" NOT NULL PRIMARY KEY, -- namespace:id
    state        smallint    NOT NULL, -- 0 in flight, 1 done
    token        text        NOT NULL,
    claim_id     text,
    fingerprint  bytea,
    expires_at   timestamptz NOT NULL, -- lease deadline, or retention deadline once done
    completed_at timestamptz,
    outcome      bytea,
    attempts     integer     NOT NULL,
    first_seen   timestamptz NOT NULL
);

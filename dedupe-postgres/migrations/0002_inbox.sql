-- 0002: the inbox (dedupe_core::Inbox, CONTRACT.md I1 to I8) in the records
-- table. An item is a row with a payload, a `wait` state (0 held by a worker,
-- 1 due, 2 dead), its last error, and `due_at`: when a take may hand it out
-- (its due time, or its worker's lease deadline; NULL once dead). Every other
-- row keeps all four NULL, and no statement of a claim, a completion or an
-- extension of a record changes them: the partial index below covers
-- `due_at` and the key only, so a record's completion, whose `expires_at`
-- changes, stays a HOT update (an index on `expires_at` would end that, see
-- 0001).
--
-- The index is `take`'s: the takeable items of a namespace (the key's part
-- before its first `:`), soonest due first. Records are not in it.
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS payload bytea;
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS wait smallint;
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS last_error text;
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS due_at timestamptz;
CREATE INDEX IF NOT EXISTS "{table}_due"
    ON "{schema}"."{table}" ((split_part(key, ':', 1)), due_at)
    WHERE due_at IS NOT NULL;

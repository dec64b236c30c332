-- 0002: the inbox's columns (dedupe_core::Inbox, CONTRACT.md I1 to I8). An
-- item is a row with a payload and a `wait` state (0 held by a worker, 1 due
-- at `expires_at`, 2 dead) and its last failure; a record keeps all three
-- NULL. SQLite's ALTER TABLE has no IF NOT EXISTS: `migrate()` applies this
-- file only to a table without the `wait` column, in the same transaction
-- as its look at the columns.
ALTER TABLE "{table}" ADD COLUMN payload BLOB;
ALTER TABLE "{table}" ADD COLUMN wait INTEGER;
ALTER TABLE "{table}" ADD COLUMN last_error TEXT;

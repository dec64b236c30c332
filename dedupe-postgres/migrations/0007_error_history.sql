-- 0007: an item's failure history (CONTRACT.md I5): `errors` is a jsonb
-- array of `[attempt, ms since the epoch, error]`, its last five failures,
-- oldest first, written by the fail statement. Items that failed before read
-- as no history.
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS errors jsonb;

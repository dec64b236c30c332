-- 0007: a dead item's retention (CONTRACT.md I16): `dead_until` is when
-- `expire()` may remove it (ms since the epoch; NULL while not dead, or dead
-- and kept until forgotten), with an index of the dead items that have one,
-- so that `expire()` reads only those. Dead items from before read as kept
-- until forgotten. Applied, like 0004, only to a table without the
-- `dead_until` column, in the transaction that looked.
ALTER TABLE "{table}" ADD COLUMN dead_until INTEGER;
CREATE INDEX IF NOT EXISTS "{table}_dead" ON "{table}" (dead_until)
    WHERE wait = 2 AND dead_until IS NOT NULL;

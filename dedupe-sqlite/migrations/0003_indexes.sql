-- 0003: `take`'s index of due items, items only, and `expire()`'s of
-- records, items left out, so that a purge never walks the dead and waiting
-- items it may not remove. The first index over every row's `expires_at`
-- goes.
CREATE INDEX IF NOT EXISTS "{table}_due" ON "{table}" (namespace, expires_at)
    WHERE wait IN (0, 1);
CREATE INDEX IF NOT EXISTS "{table}_expiry" ON "{table}" (expires_at)
    WHERE wait IS NULL;
DROP INDEX IF EXISTS "{table}_expires_at";

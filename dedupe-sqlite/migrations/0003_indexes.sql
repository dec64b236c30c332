-- 0003: `expire()`'s index of records, items left out, so that a purge
-- never walks the dead and waiting items it may not remove. The first index
-- over every row's `expires_at` goes. (This file also made `take`'s index of
-- due items, `_due`, until 0009 replaced it with `_waiting`; run on every
-- migrate, it no longer makes one that 0009 drops.)
CREATE INDEX IF NOT EXISTS "{table}_expiry" ON "{table}" (expires_at)
    WHERE wait IS NULL;
DROP INDEX IF EXISTS "{table}_expires_at";

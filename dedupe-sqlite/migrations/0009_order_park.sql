-- 0009: parked items (CONTRACT.md I15). A take that meets an item of an
-- ordering key that an earlier item of its key holds back parks it
-- (`order_parked` 1): it leaves the take's index, which replaces 0003's
-- `_due`, so no later take reads it. The write that takes an item out of its
-- key's queue (done, dead and skipped, forgotten, expired) makes the key's
-- next waiting item its head (`order_head` 1, never parked) and unparks it,
-- in the same transaction. Applied, like 0004, only to a table without the
-- `order_head` column, in the transaction that looked.
ALTER TABLE "{table}" ADD COLUMN order_parked INTEGER NOT NULL DEFAULT 0;
ALTER TABLE "{table}" ADD COLUMN order_head INTEGER NOT NULL DEFAULT 0;
DROP INDEX IF EXISTS "{table}_due";
CREATE INDEX IF NOT EXISTS "{table}_waiting" ON "{table}" (namespace, expires_at)
    WHERE wait IN (0, 1) AND order_parked = 0;

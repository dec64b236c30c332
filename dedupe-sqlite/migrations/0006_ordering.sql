-- 0006: an item's ordering key (CONTRACT.md I15), its place in the key's
-- accept order, and whether it is skipped when dead (1) or holds the later
-- items back (0); an index of the items that have one (not done records:
-- an item leaves it as it completes), for the take's look at the other items
-- of a key. Applied, like 0004, only to a table without
-- the `order_key` column, in the transaction that looked.
ALTER TABLE "{table}" ADD COLUMN order_key TEXT;
ALTER TABLE "{table}" ADD COLUMN order_seq INTEGER;
ALTER TABLE "{table}" ADD COLUMN order_skip INTEGER NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS "{table}_order" ON "{table}" (namespace, order_key, wait, order_seq)
    WHERE order_key IS NOT NULL AND wait IS NOT NULL;

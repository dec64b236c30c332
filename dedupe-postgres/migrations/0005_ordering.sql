-- 0005: an item's ordering key (CONTRACT.md I15), its place in the key's
-- accept order, and whether it is skipped when dead (true) or holds the
-- later items back; an index of the items that have one (not done records:
-- an item leaves it as it completes), for the take's look at the other items
-- of a key. Records keep NULLs and never read them.
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS order_key text;
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS order_seq int8;
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS order_skip bool NOT NULL DEFAULT false;
CREATE INDEX IF NOT EXISTS "{table}_order" ON "{schema}"."{table}"
    ((split_part(key, ':', 1)), order_key, order_seq)
    WHERE order_key IS NOT NULL AND wait IS NOT NULL;

-- 0008: parked items (CONTRACT.md I15). A take that meets an item of an
-- ordering key that an earlier item of its key holds back parks it: its
-- `due_at` goes to NULL (its due time stays in `expires_at`), so it leaves
-- the take's index and no later take reads it again. When an item of the key
-- leaves the queue (done, dead and skipped, forgotten, expired), the same
-- statement makes the key's first waiting item its head: `order_head`, due
-- again. A head is never parked, so a take racing the statement that made it
-- the head cannot park it behind that statement's back.
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS order_head bool NOT NULL DEFAULT false;

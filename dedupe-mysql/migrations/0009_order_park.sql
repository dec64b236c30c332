-- 0009: parked items (CONTRACT.md I15). A take that meets an item of an
-- ordering key that an earlier item of its key holds back parks it: its
-- `due_at` goes to NULL (its due time stays in `expires_at`), so the take's
-- range on the `due` index passes it by and no later take reads it again.
-- When an item leaves its key's queue (done, dead and skipped, forgotten,
-- expired), the same transaction makes the key's first waiting item its
-- head: `order_head` 1, due again. A head is never parked, so a take racing
-- that transaction cannot park it behind its back. As for 0002,
-- `migrate()` applies this file only to a table without the column, and a
-- concurrent migrate that applied it first counts as done.
ALTER TABLE `{table}`
    ADD COLUMN order_head TINYINT NOT NULL DEFAULT 0 COMMENT '1: made its ordering key''s head; never parked'

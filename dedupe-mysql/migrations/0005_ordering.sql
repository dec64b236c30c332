-- 0005: an item's ordering key (CONTRACT.md I15), its place in the key's
-- accept order, and whether it is skipped when dead (1) or holds the later
-- items back (0), with an index for the take's look at the other items of a
-- key (`wait` in it, so that look skips the key's done records). Records keep NULLs and never read them. As for 0002 and 0003,
-- `migrate()` applies this file only to a table without the `order_key`
-- column, and a concurrent migrate that applied it first counts as done.
ALTER TABLE `{table}`
    ADD COLUMN order_key  VARBINARY(256) NULL COMMENT 'the item''s ordering key; NULL: none',
    ADD COLUMN order_seq  BIGINT NULL COMMENT 'its place in the key''s accept order',
    ADD COLUMN order_skip TINYINT NOT NULL DEFAULT 0 COMMENT '1: skipped when dead',
    ADD INDEX `order` (namespace, order_key, wait, order_seq)

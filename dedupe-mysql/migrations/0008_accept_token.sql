-- 0008: the token of the accept that stored an item, kept as takes change
-- `token`: the accept's read-back tells its own item by it even when a
-- worker took the item between the upsert and the read (the read compared
-- `token`, and answered "item, running" to the accept that stored it).
-- Items from before read as stored by another accept. As for 0002,
-- `migrate()` applies this file only to a table without the column, and a
-- concurrent migrate that applied it first counts as done.
ALTER TABLE `{table}`
    ADD COLUMN accept_token VARBINARY(64) NULL COMMENT 'the token of the accept that stored the item'

-- 0007: an item's failure history (CONTRACT.md I5): `errors` is a JSON array
-- of `[attempt, ms since the epoch, error]`, its last five failures, oldest
-- first, written by the fail statement. Items that failed before read as no
-- history. As for 0002, `migrate()` applies this file only to a table
-- without the `errors` column, and a concurrent migrate that applied it
-- first counts as done.
ALTER TABLE `{table}`
    ADD COLUMN errors JSON NULL COMMENT 'the item''s last failures: [[attempt, ms, error], ...]'

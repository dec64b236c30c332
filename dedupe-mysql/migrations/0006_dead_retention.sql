-- 0006: a dead item's retention (CONTRACT.md I16): `dead_until` is when
-- `expire()` may remove it (ms since the epoch; NULL while not dead, or dead
-- and kept until forgotten), with an index `expire()` reads them by (every
-- other row holds NULL, which its range never reads). Dead items from
-- before read as kept until forgotten. As for 0002, `migrate()` applies this
-- file only to a table without the `dead_until` column, and a concurrent
-- migrate that applied it first counts as done.
ALTER TABLE `{table}`
    ADD COLUMN dead_until BIGINT NULL COMMENT 'a dead item''s retention deadline, ms; NULL: none',
    ADD INDEX `dead` (dead_until)

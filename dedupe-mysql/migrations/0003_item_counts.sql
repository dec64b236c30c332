-- 0003: an item's takeovers (workers that died holding it, CONTRACT.md I10)
-- and its own attempt limit, set at accept (I11). Items from before read as
-- no takeovers and the worker's limit; records keep the defaults and never
-- read them. As for 0002, `migrate()` applies this file only to a table
-- without the `takeovers` column, and a concurrent migrate that applied it
-- first (error 1060) counts as done.
ALTER TABLE `{table}`
    ADD COLUMN takeovers    INT NOT NULL DEFAULT 0 COMMENT 'takeovers of workers that died holding the item',
    ADD COLUMN max_attempts INT NULL COMMENT 'the item''s own attempt limit; NULL: the worker''s';

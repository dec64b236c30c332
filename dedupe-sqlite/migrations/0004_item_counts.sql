-- 0004: an item's takeovers (workers that died holding it, CONTRACT.md I10)
-- and its own attempt limit, set at accept (I11). Items from before read as
-- no takeovers and the worker's limit. SQLite's ALTER TABLE has no IF NOT
-- EXISTS: `migrate()` applies this file only to a table without the
-- `takeovers` column, in the same transaction as its look at the columns.
ALTER TABLE "{table}" ADD COLUMN takeovers INTEGER NOT NULL DEFAULT 0;
ALTER TABLE "{table}" ADD COLUMN max_attempts INTEGER;

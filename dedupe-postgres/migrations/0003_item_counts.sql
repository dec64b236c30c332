-- 0003: an item's takeovers (workers that died holding it, CONTRACT.md I10)
-- and its own attempt limit, set at accept (I11). Items from before read as
-- no takeovers and the worker's limit; records keep the defaults and never
-- read them. A constant default adds no rewrite of the table.
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS takeovers int4 NOT NULL DEFAULT 0;
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS max_attempts int4;

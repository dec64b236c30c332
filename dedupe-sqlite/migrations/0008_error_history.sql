-- 0008: an item's failure history (CONTRACT.md I5): `errors` is a JSON array
-- of `[attempt, ms since the epoch, error]`, its last five failures, oldest
-- first, written by the fail statement with SQLite's JSON functions. Items
-- that failed before read as no history. Applied, like 0004, only to a table
-- without the `errors` column, in the transaction that looked.
ALTER TABLE "{table}" ADD COLUMN errors TEXT;

-- 0005: the paused namespaces of the inbox (CONTRACT.md I13), one row each,
-- kept beside the records so that every process on the file sees a pause:
-- `take` hands out nothing of a namespace listed here. Applied on every
-- `migrate()` (it changes nothing once the table is there).
CREATE TABLE IF NOT EXISTS "{table}_paused" (
    namespace TEXT    NOT NULL PRIMARY KEY,
    paused_at INTEGER NOT NULL
) WITHOUT ROWID;

-- 0004: the paused namespaces of the inbox (CONTRACT.md I13), one row each,
-- beside the records so that every worker of every process sees a pause:
-- `take` hands out nothing of a namespace listed here.
CREATE TABLE IF NOT EXISTS "{schema}"."{table}_paused" (
    namespace text        PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now()
);

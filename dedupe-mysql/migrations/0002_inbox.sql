-- 0002: the inbox (dedupe_core::Inbox, CONTRACT.md I1 to I8) in the records
-- table. An item is a row with a payload, a `wait` state (0 held by a worker,
-- 1 due, 2 dead), its last error (UTF-8), and `due_at`: when a take may hand
-- it out (its due time, or its worker's lease deadline; NULL once dead), in
-- ms since the epoch. Every other row keeps all four NULL, and no claim,
-- completion or extension of a record writes them.
--
-- `due` is `take`'s index: the due items of a namespace, soonest first, read
-- in order and locked only as far as the take's LIMIT. Records sit in it
-- with a NULL `due_at`, before every item, and no take reads them.
--
-- MySQL has no `ADD COLUMN IF NOT EXISTS`: `migrate()` applies this file
-- only to a table without the `due_at` column (one statement, which InnoDB
-- applies whole or not at all), and a concurrent migrate that applied it
-- first (error 1060, duplicate column) counts as done.
ALTER TABLE `{table}`
    ADD COLUMN payload    LONGBLOB       NULL,
    ADD COLUMN wait       TINYINT        NULL COMMENT '0 held by a worker, 1 due, 2 dead',
    ADD COLUMN last_error VARBINARY(1024) NULL,
    ADD COLUMN due_at     BIGINT         NULL COMMENT 'ms since epoch: when a take may hand it out',
    ADD KEY due (namespace, due_at)

-- 0001: the records table. VARBINARY keys compare byte for byte: no
-- collation folds case, accents or trailing spaces (CONTRACT.md rule 2).
-- Times are milliseconds since the Unix epoch from the server's clock.
-- InnoDB: row locks, crash recovery from the redo log. `expires_at` is
-- `expire()`'s index.
CREATE TABLE IF NOT EXISTS `{table}` (
    namespace    VARBINARY(64)  NOT NULL,
    id           VARBINARY(512) NOT NULL,
    state        TINYINT        NOT NULL COMMENT '0 in flight, 1 done',
    token        VARBINARY(64)  NOT NULL,
    claim_id     VARBINARY(128) NULL,
    fingerprint  VARBINARY(64)  NULL,
    expires_at   BIGINT         NOT NULL COMMENT 'ms since epoch: lease, or retention once done',
    completed_at BIGINT         NULL,
    outcome      LONGBLOB       NULL,
    attempts     INT            NOT NULL,
    first_seen   BIGINT         NOT NULL,
    PRIMARY KEY (namespace, id),
    KEY expires_at (expires_at)
) ENGINE=InnoDB

-- 0004: the paused namespaces of the inbox (CONTRACT.md I13), one row each,
-- beside the records so that every worker of every process sees a pause:
-- `take`'s pick hands out nothing of a namespace listed here. `CREATE TABLE
-- IF NOT EXISTS` changes nothing once the table is there, so `migrate()`
-- applies this file every time.
CREATE TABLE IF NOT EXISTS `{table}_paused` (
    namespace VARBINARY(64) NOT NULL,
    paused_at BIGINT        NOT NULL COMMENT 'ms since epoch',
    PRIMARY KEY (namespace)
) ENGINE=InnoDB

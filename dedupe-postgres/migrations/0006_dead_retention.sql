-- 0006: a dead item's retention (CONTRACT.md I16): `dead_until` is when
-- `expire()` may remove it (NULL while not dead, or dead and kept until
-- forgotten). `expire()` walks the table's pages as it does for records, so
-- no index: dead items from before read as kept until forgotten.
ALTER TABLE "{schema}"."{table}" ADD COLUMN IF NOT EXISTS dead_until timestamptz;

-- A token bound to an order follows `tokens.retention` like every other
-- token (docs/operations.md, "Retention by partition"): the order's record
-- of payment is its `order_events` row (token id and text, amount, request
-- id, time, and from now on the fingerprint) and its audit events, which
-- stay. Until now such tokens were never purged, so with orders in use
-- nearly every day partition of `tokens` held one and none was dropped.
--
-- The event keeps the fingerprint its token was consumed with, so that a
-- repeat of the event after its token's row is gone is still told apart
-- from another request (422 `fingerprint_mismatch`). Adding a nullable
-- column rewrites nothing; events written before it fall back to their
-- token's row while it lasts.
ALTER TABLE order_events ADD COLUMN IF NOT EXISTS fingerprint text;

-- The purge of consumed tokens now takes order-bound ones too, so its index
-- no longer leaves them out. On a large database this build (one read of
-- the consumed rows of every partition, under a SHARE lock on `tokens`:
-- consumes wait) can be done ahead without blocking: for each partition P,
--   CREATE INDEX CONCURRENTLY P_consumed_purge_idx ON P (consumed_at) WHERE state = 'consumed';
-- then
--   CREATE INDEX tokens_consumed_purge_idx ON ONLY tokens (consumed_at) WHERE state = 'consumed';
--   ALTER INDEX tokens_consumed_purge_idx ATTACH PARTITION P_consumed_purge_idx;  -- for each P
-- and this migration's IF NOT EXISTS finds it.
CREATE INDEX IF NOT EXISTS tokens_consumed_purge_idx ON tokens (consumed_at) WHERE state = 'consumed';
DROP INDEX IF EXISTS tokens_purgeable_idx;

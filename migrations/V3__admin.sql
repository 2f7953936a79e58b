-- Admin and reconciliation.
--
-- Audit queries filter by any of subject, biz_type, order_id, kind and a time
-- window, newest first by (at, id), one keyset page at a time. V1 has one
-- (column, at DESC, id DESC) index per filter. Measured on 1M events (README,
-- "Audit queries"): every single filter, and every combination with subject
-- or order_id, answers in well under a millisecond; but biz_type AND kind
-- together walked one of the two indexes filtering by the other: 400 ms when
-- no event matches. This index serves that combination (and a time window or
-- cursor under it).
--
-- On a large existing table, build it by hand first, without blocking writes:
--   CREATE INDEX CONCURRENTLY audit_biz_kind_idx ON audit_events (biz_type, kind, at DESC, id DESC);
-- and this migration finds it there.
CREATE INDEX IF NOT EXISTS audit_biz_kind_idx ON audit_events (biz_type, kind, at DESC, id DESC);

-- Reconciliation walks the live issued tokens in keyset pages ordered by
-- (expires_at, id): the V1 index on expires_at alone made every page sort all
-- live tokens (quadratic over a run). The same index serves the purge of
-- never-consumed tokens (expires_at < now() - retention).
CREATE INDEX IF NOT EXISTS tokens_issued_expiry_idx ON tokens (expires_at, id) WHERE state = 'issued';
DROP INDEX IF EXISTS tokens_expires_at_idx;

-- The purge of consumed tokens skips those bound to an order (kept as proof
-- of payment); with them in the index every purge batch would walk past all
-- of them again.
CREATE INDEX IF NOT EXISTS tokens_purgeable_idx ON tokens (consumed_at)
    WHERE state = 'consumed' AND order_id IS NULL;
DROP INDEX IF EXISTS tokens_consumed_at_idx;

-- Processing leases (biz.<name>.processing_lease): when a consumed token or
-- key with neither result nor release outlived its lease, the sweep marks
-- it uncertain (policy `uncertain`) with Postgres's clock.
ALTER TABLE tokens ADD COLUMN IF NOT EXISTS uncertain_since timestamptz;
ALTER TABLE tokens ADD CONSTRAINT tokens_uncertain_needs_consume
    CHECK (uncertain_since IS NULL OR state = 'consumed');

-- A release (any state change) ends the uncertainty of the consume it undid.
CREATE FUNCTION tokens_uncertain_follows_state() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.uncertain_since := NULL;
    RETURN NEW;
END
$$;
CREATE TRIGGER tokens_uncertain_on_update BEFORE UPDATE ON tokens FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION tokens_uncertain_follows_state();

-- The sweep's candidates: consumes still in flight (small: only those
-- without a result or order event).
CREATE INDEX IF NOT EXISTS tokens_in_flight_idx ON tokens (biz_type, consumed_at)
    WHERE state = 'consumed' AND result IS NULL AND order_id IS NULL AND uncertain_since IS NULL;
-- The uncertain queue, oldest first.
CREATE INDEX IF NOT EXISTS tokens_uncertain_idx ON tokens (uncertain_since, id)
    WHERE uncertain_since IS NOT NULL AND result IS NULL;

-- Generations: every token carries a version that each state change bumps.
--
-- `tokens.gen` starts at 0 when a token is issued and goes up by one with
-- every consume (issued -> consumed) and every release (consumed -> issued),
-- so an odd generation means consumed and an even one issued. Every write
-- between the tiers (a journal entry, a write back to Redis, a reconcile
-- repair) carries the generation it was decided at and applies only over an
-- older one: the order in which such writes arrive, and how often, no longer
-- decides a token's state. A result does not change the generation: it
-- belongs to the consumed generation it was recorded for.
--
-- Runs on a populated table: the column is added with a constant default (no
-- table rewrite), then the consumed rows are set to generation 1 (one row
-- version each; retention bounds how many there are).
ALTER TABLE tokens ADD COLUMN gen bigint NOT NULL DEFAULT 0;
UPDATE tokens SET gen = 1 WHERE state = 'consumed';
ALTER TABLE tokens ADD CONSTRAINT tokens_gen_parity
    CHECK (gen >= 0 AND (gen % 2 = 1) = (state = 'consumed'));

-- While a deploy rolls over a running fleet, instances built before this
-- migration still change states without touching `gen`. These triggers keep
-- the parity for them: a state change that left `gen` alone bumps it, and a
-- row inserted consumed at generation 0 gets generation 1. Current statements
-- always write `gen` themselves, so the WHEN conditions are false for them and
-- the function never runs on their path.
CREATE FUNCTION tokens_gen_follows_state() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.gen := NEW.gen + 1;
    RETURN NEW;
END
$$;
CREATE TRIGGER tokens_gen_on_update BEFORE UPDATE ON tokens FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state AND OLD.gen = NEW.gen)
    EXECUTE FUNCTION tokens_gen_follows_state();
CREATE TRIGGER tokens_gen_on_insert BEFORE INSERT ON tokens FOR EACH ROW
    WHEN (NEW.state = 'consumed' AND NEW.gen = 0)
    EXECUTE FUNCTION tokens_gen_follows_state();

-- Audit rows of a token's state changes name the generation they recorded
-- (`token.consumed`, `token.released`: the new one; `token.result`: the
-- consumed one). One row per (token, kind, generation): the journal writes the
-- audit row of every entry it reads, in any order and however often an entry
-- is delivered, and this index keeps exactly one of each. Rows written before
-- this migration have no generation and are not indexed.
--
-- On a large existing table, build it by hand first, without blocking writes:
--   CREATE UNIQUE INDEX CONCURRENTLY audit_token_gen_once
--       ON audit_events (token_id, kind, gen) WHERE gen IS NOT NULL;
-- (after `ALTER TABLE audit_events ADD COLUMN gen bigint`), and this migration
-- finds both there.
ALTER TABLE audit_events ADD COLUMN IF NOT EXISTS gen bigint;
CREATE UNIQUE INDEX IF NOT EXISTS audit_token_gen_once
    ON audit_events (token_id, kind, gen) WHERE gen IS NOT NULL;

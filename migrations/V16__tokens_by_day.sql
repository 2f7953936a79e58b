-- Retention by partition (docs/operations.md "Retention by partition").
--
-- `tokens` becomes a table partitioned BY RANGE (id). A snowflake id carries
-- its millisecond in its high bits (src/token/snowflake.rs: milliseconds
-- since 2024-01-01 shifted left by 22), so a range of ids is a range of issue
-- times: one partition per UTC day, `tokens_pYYYYMMDD`. Retention (the
-- reconcile run's purge, src/reconcile/purge.rs) drops a day's partition
-- whole once every row in it is past retention, instead of deleting its rows
-- one by one.
--
-- The partitions:
--   tokens_base     the table as it was before this migration, attached as
--                   the partition of every id below the cutoff: every client
--                   key (their ids are negative, V6) and every token issued
--                   before the first day partition. Never dropped; the
--                   row-by-row purge keeps working on it.
--   tokens_pYYYYMMDD one per UTC day from the cutoff on, made ahead by
--                   tokens_ensure_partitions (the service calls it at start
--                   and at every reconcile run).
--   tokens_default  catches any id no other partition covers (a day not
--                   made yet, a day already dropped), so an insert never
--                   fails for want of a partition. Purged row by row.
--
-- Uniqueness: the primary key stays `id`, which is the partition key, so it
-- is enforced across partitions: every statement that decides a token keys
-- on `id` (`ON CONFLICT (id)`). A partitioned table's unique indexes must
-- include the partition key, so the client keys' index becomes
-- (client, biz_type, key, id): a key's id is derived from
-- (client, biz_type, key) alone (V6), so two rows of one key have one id and
-- meet on it. The old (client, biz_type, key) index stays on tokens_base,
-- which holds every key (tokens_key_shape: a key's id is negative), so the
-- key stays unique on its own columns too.
--
-- Locks and time: the whole migration holds ACCESS EXCLUSIVE on `tokens`
-- (no consume runs meanwhile). Attaching the old table scans it once to
-- check that every id is below the cutoff (a sequential read, no rewrite,
-- no WAL for the rows); its indexes are attached as they are, not rebuilt,
-- except the new (client, biz_type, key, id) index, built over the key rows.

LOCK TABLE tokens IN ACCESS EXCLUSIVE MODE;

-- The old table, its constraints and indexes under names of their own.
ALTER TABLE tokens RENAME TO tokens_base;
ALTER TABLE tokens_base RENAME CONSTRAINT tokens_pkey TO tokens_base_pkey;
ALTER INDEX tokens_subject_idx RENAME TO tokens_base_subject_idx;
ALTER INDEX tokens_issued_expiry_idx RENAME TO tokens_base_issued_expiry_idx;
ALTER INDEX tokens_purgeable_idx RENAME TO tokens_base_purgeable_idx;
ALTER INDEX tokens_in_flight_idx RENAME TO tokens_base_in_flight_idx;
ALTER INDEX tokens_uncertain_idx RENAME TO tokens_base_uncertain_idx;
ALTER INDEX tokens_client_key_idx RENAME TO tokens_base_client_key_idx;
-- Made again on the partitioned table below, which gives them to every
-- partition (tokens_base included).
DROP TRIGGER tokens_gen_on_update ON tokens_base;
DROP TRIGGER tokens_gen_on_insert ON tokens_base;
DROP TRIGGER tokens_uncertain_on_update ON tokens_base;

-- The same columns, defaults, NOT NULLs and CHECK constraints (by the same
-- names: V1's, V4's tokens_gen_parity, V6's tokens_key_shape, V14's
-- tokens_uncertain_needs_consume).
CREATE TABLE tokens (
    LIKE tokens_base INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE,
    PRIMARY KEY (id)
) PARTITION BY RANGE (id);

CREATE TABLE tokens_default PARTITION OF tokens DEFAULT;

-- The first id of a UTC day.
CREATE FUNCTION tokens_day_first_id(day date) RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT ((extract(epoch FROM day::timestamp) * 1000)::bigint - 1704067200000) << 22
$$;

-- The old table covers every id below the first day after both the
-- migration and its highest id.
DO $$
DECLARE
    top_ms bigint := greatest(
        (extract(epoch FROM now()) * 1000)::bigint,
        coalesce(((SELECT max(id) FROM tokens_base) >> 22) + 1704067200000, 0));
    cutoff_day date := (to_timestamp(top_ms / 1000.0) AT TIME ZONE 'UTC')::date + 1;
BEGIN
    EXECUTE format('ALTER TABLE tokens ATTACH PARTITION tokens_base FOR VALUES FROM (MINVALUE) TO (%s)',
                   tokens_day_first_id(cutoff_day));
END
$$;

-- V1, V3 and V14's indexes: each finds its match on tokens_base and takes it
-- as is.
CREATE INDEX tokens_subject_idx ON tokens (subject, issued_at);
CREATE INDEX tokens_issued_expiry_idx ON tokens (expires_at, id) WHERE state = 'issued';
CREATE INDEX tokens_purgeable_idx ON tokens (consumed_at)
    WHERE state = 'consumed' AND order_id IS NULL;
CREATE INDEX tokens_in_flight_idx ON tokens (biz_type, consumed_at)
    WHERE state = 'consumed' AND result IS NULL AND order_id IS NULL AND uncertain_since IS NULL;
CREATE INDEX tokens_uncertain_idx ON tokens (uncertain_since, id)
    WHERE uncertain_since IS NOT NULL AND result IS NULL;
-- V6's, with the partition key: the arbiter of a key's first consume
-- (src/durable/keys.rs: ON CONFLICT (client, biz_type, key, id)).
CREATE UNIQUE INDEX tokens_client_key_idx ON tokens (client, biz_type, key, id)
    WHERE key IS NOT NULL;

-- V4's and V14's triggers, on every partition.
CREATE TRIGGER tokens_gen_on_update BEFORE UPDATE ON tokens FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state AND OLD.gen = NEW.gen)
    EXECUTE FUNCTION tokens_gen_follows_state();
CREATE TRIGGER tokens_gen_on_insert BEFORE INSERT ON tokens FOR EACH ROW
    WHEN (NEW.state = 'consumed' AND NEW.gen = 0)
    EXECUTE FUNCTION tokens_gen_follows_state();
CREATE TRIGGER tokens_uncertain_on_update BEFORE UPDATE ON tokens FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION tokens_uncertain_follows_state();

-- Makes the partition of one UTC day unless it exists; true when it made it.
-- A standalone table attached (SHARE UPDATE EXCLUSIVE on `tokens`: consumes
-- go on) rather than CREATE TABLE ... PARTITION OF (ACCESS EXCLUSIVE). A day
-- below the cutoff overlaps tokens_base: already covered, nothing made. A day
-- whose ids tokens_default already holds (the day was not made in time) is
-- left to tokens_default: nothing made.
CREATE FUNCTION tokens_add_day_partition(day date) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    name text := 'tokens_p' || to_char(day, 'YYYYMMDD');
BEGIN
    IF to_regclass(name) IS NOT NULL THEN
        RETURN false;
    END IF;
    BEGIN
        EXECUTE format('CREATE TABLE %I (LIKE tokens INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE)',
                       name);
        EXECUTE format('ALTER TABLE tokens ATTACH PARTITION %I FOR VALUES FROM (%s) TO (%s)',
                       name, tokens_day_first_id(day), tokens_day_first_id(day + 1));
    EXCEPTION
        WHEN invalid_object_definition THEN -- "would overlap partition tokens_base"
            RETURN false;
        WHEN check_violation THEN -- "... for default partition would be violated"
            RETURN false;
    END;
    RETURN true;
END
$$;

-- Today's partition (by Postgres's clock, UTC) and the next `days_ahead`
-- days'; how many it made. One caller at a time (a transaction-level
-- advisory lock): instances starting together and a reconcile run do not
-- race to make the same table.
CREATE FUNCTION tokens_ensure_partitions(days_ahead integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    made integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(33908347371524); -- 0x1ed6_e700_0004
    FOR d IN 0..days_ahead LOOP
        IF tokens_add_day_partition(today + d) THEN
            made := made + 1;
        END IF;
    END LOOP;
    RETURN made;
END
$$;

SELECT tokens_ensure_partitions(7);

-- Audit events by token day (docs/audit.md "Partitions").
--
-- `audit_events` becomes a table partitioned BY RANGE (token_id), with the
-- day bounds of `tokens` (V16: a snowflake id carries its millisecond, so a
-- range of token ids is a range of issue times). A token's events, from its
-- issue to its last result, live in the partition of the day it was issued:
-- `audit_events_pYYYYMMDD`, a table that can be detached or dropped whole
-- when the audit of that day's tokens is no longer kept.
--
-- Why token_id and not the event's time: the writers deduplicate through two
-- unique indexes, (token_id) WHERE kind = 'token.issued' (V1) and
-- (token_id, kind, gen) WHERE gen IS NOT NULL (V4): a journal entry applied
-- twice, an issuance batch retried, write their event once. A partitioned
-- table's unique indexes must include the partition key; token_id is in both,
-- so both stay unique across partitions as they are. Partitioning by `at`
-- or by the event id would put each retry in a partition of its own and open
-- a second event for one transition.
--
-- The partitions:
--   audit_events_base     the table as it was before this migration, attached
--                         for every token id below the cutoff: the events of
--                         client keys (negative ids, V6) and of tokens issued
--                         before the first day partition.
--   audit_events_pYYYYMMDD one per UTC day of issue from the cutoff on, made
--                         ahead with the token partitions (tokens_ensure_partitions
--                         makes both from this migration on).
--   audit_events_default  the events without a token (admin actions, reconcile
--                         runs, fleet records: token_id is NULL, which no range
--                         holds) and any token id no other partition covers.
--
-- Ids: `id` stays an identity column, now the partitioned table's, with
-- CACHE 1 (the sealer's settle rule, src/audit_seal.rs, needs ids handed out
-- in time order) and continuing after the last id the old sequence handed
-- out. It is no longer a primary key (a partitioned table's primary key must
-- hold the partition key, and token_id may be NULL); every id still comes
-- from that one sequence, and `audit_events_id_idx` serves the sealer's
-- reads by id range. Sealed checkpoints (V13) chain events by id, whatever
-- partition holds them: nothing about them changes.
--
-- Locks and time: the whole migration holds ACCESS EXCLUSIVE on
-- `audit_events` (no event is written meanwhile, so no consume commits).
-- The events without a token are moved to audit_events_default (deleted from
-- the old table and inserted there, unchanged: same ids and columns, so their
-- sealed digests still hold). Attaching the old table scans it once; its
-- indexes are attached as they are, except the id index, built anew.

LOCK TABLE audit_events IN ACCESS EXCLUSIVE MODE;

ALTER TABLE audit_events RENAME TO audit_events_base;
ALTER INDEX audit_at_idx RENAME TO audit_base_at_idx;
ALTER INDEX audit_subject_idx RENAME TO audit_base_subject_idx;
ALTER INDEX audit_token_idx RENAME TO audit_base_token_idx;
ALTER INDEX audit_order_idx RENAME TO audit_base_order_idx;
ALTER INDEX audit_biz_idx RENAME TO audit_base_biz_idx;
ALTER INDEX audit_kind_idx RENAME TO audit_base_kind_idx;
ALTER INDEX audit_biz_kind_idx RENAME TO audit_base_biz_kind_idx;
ALTER INDEX audit_issued_once RENAME TO audit_base_issued_once;
ALTER INDEX audit_token_gen_once RENAME TO audit_base_token_gen_once;

-- The same columns, defaults and identity (a sequence of its own, CACHE 1).
CREATE TABLE audit_events (
    LIKE audit_events_base INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING CONSTRAINTS INCLUDING STORAGE
) PARTITION BY RANGE (token_id);
ALTER TABLE audit_events ALTER COLUMN id SET CACHE 1;

-- Ids go on after the last one handed out (not only the highest kept: an id
-- lost to a rolled-back insert is never handed out twice either).
DO $$
DECLARE
    last_id bigint;
    was_called boolean;
BEGIN
    EXECUTE format('SELECT last_value, is_called FROM %s',
                   pg_get_serial_sequence('audit_events_base', 'id'))
        INTO last_id, was_called;
    last_id := greatest(CASE WHEN was_called THEN last_id ELSE last_id - 1 END,
                        coalesce((SELECT max(id) FROM audit_events_base), 0));
    IF last_id > 0 THEN
        PERFORM setval(pg_get_serial_sequence('audit_events', 'id'), last_id, true);
    END IF;
END
$$;
ALTER TABLE audit_events_base ALTER COLUMN id DROP IDENTITY;
-- The new sequence takes the old one's name, now free.
DO $$
BEGIN
    EXECUTE format('ALTER SEQUENCE %s RENAME TO audit_events_id_seq',
                   pg_get_serial_sequence('audit_events', 'id'));
END
$$;
ALTER TABLE audit_events_base DROP CONSTRAINT audit_events_pkey;

CREATE TABLE audit_events_default PARTITION OF audit_events DEFAULT;
INSERT INTO audit_events_default SELECT * FROM audit_events_base WHERE token_id IS NULL;
DELETE FROM audit_events_base WHERE token_id IS NULL;

-- The old table covers every token id below the first day after both the
-- migration and its highest token id (as V16 did for tokens).
DO $$
DECLARE
    top_ms bigint := greatest(
        (extract(epoch FROM now()) * 1000)::bigint,
        coalesce(((SELECT max(token_id) FROM audit_events_base) >> 22) + 1704067200000, 0));
    cutoff_day date := (to_timestamp(top_ms / 1000.0) AT TIME ZONE 'UTC')::date + 1;
BEGIN
    EXECUTE format('ALTER TABLE audit_events ATTACH PARTITION audit_events_base FOR VALUES FROM (MINVALUE) TO (%s)',
                   tokens_day_first_id(cutoff_day));
END
$$;

-- V1, V3 and V4's indexes: each finds its match on audit_events_base and
-- takes it as is.
CREATE INDEX audit_at_idx ON audit_events (at DESC, id DESC);
CREATE INDEX audit_subject_idx ON audit_events (subject, at DESC, id DESC);
CREATE INDEX audit_token_idx ON audit_events (token_id, at DESC, id DESC);
CREATE INDEX audit_order_idx ON audit_events (order_id, at DESC, id DESC) WHERE order_id IS NOT NULL;
CREATE INDEX audit_biz_idx ON audit_events (biz_type, at DESC, id DESC);
CREATE INDEX audit_kind_idx ON audit_events (kind, at DESC, id DESC);
CREATE INDEX audit_biz_kind_idx ON audit_events (biz_type, kind, at DESC, id DESC);
CREATE UNIQUE INDEX audit_issued_once ON audit_events (token_id) WHERE kind = 'token.issued';
CREATE UNIQUE INDEX audit_token_gen_once ON audit_events (token_id, kind, gen) WHERE gen IS NOT NULL;
-- The sealer reads events by id range (src/durable/seal.rs).
CREATE INDEX audit_events_id_idx ON audit_events (id);

-- Makes the audit partition of one UTC day unless it exists; true when it
-- made it. As tokens_add_day_partition (V16): a standalone table attached
-- (SHARE UPDATE EXCLUSIVE on audit_events: events go on being written); a day
-- below the cutoff, or whose token ids audit_events_default already holds,
-- is left where it is.
CREATE FUNCTION audit_events_add_day_partition(day date) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    name text := 'audit_events_p' || to_char(day, 'YYYYMMDD');
BEGIN
    IF to_regclass(name) IS NOT NULL THEN
        RETURN false;
    END IF;
    BEGIN
        EXECUTE format('CREATE TABLE %I (LIKE audit_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE)',
                       name);
        EXECUTE format('ALTER TABLE audit_events ATTACH PARTITION %I FOR VALUES FROM (%s) TO (%s)',
                       name, tokens_day_first_id(day), tokens_day_first_id(day + 1));
    EXCEPTION
        WHEN invalid_object_definition THEN -- "would overlap partition audit_events_base"
            RETURN false;
        WHEN check_violation THEN -- "... for default partition would be violated"
            RETURN false;
    END;
    RETURN true;
END
$$;

-- V16's function, now making each day's audit partition with its token
-- partition: every caller (the service at start, each reconcile run, an
-- instance of an older version still running) makes both.
CREATE OR REPLACE FUNCTION tokens_ensure_partitions(days_ahead integer) RETURNS integer
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
        PERFORM audit_events_add_day_partition(today + d);
    END LOOP;
    RETURN made;
END
$$;

SELECT tokens_ensure_partitions(7);

-- Checkpoints sealed from now on chain each partition's events apart
-- (version 2, src/audit_seal/chain.rs): a day partition dropped under
-- `audit.retention` then leaves the rest of every checkpoint verifiable.
-- Checkpoints sealed before stay version 1 (one chain over the range) and
-- verify as before; a partition holding events a version 1 checkpoint seals
-- is never dropped.
ALTER TABLE audit_checkpoints
    ADD COLUMN version smallint NOT NULL DEFAULT 1,
    ADD COLUMN parts jsonb,
    ADD CONSTRAINT audit_checkpoints_version CHECK (
        (version = 1 AND parts IS NULL) OR (version = 2 AND jsonb_typeof(parts) = 'array'));

-- One row per partition of audit_events dropped under `audit.retention`
-- (src/audit_seal/retire.rs), written in the transaction that drops it, once
-- the partition's events verified against every checkpoint part that seals
-- them. `audit verify` takes a retired partition's parts as sealed. The mac
-- (HMAC-SHA256 under the seal key `key_id`) covers the other columns: a
-- retirement cannot be made up without the seal key. Append-only.
CREATE TABLE audit_retirements (
    partition   text        PRIMARY KEY CHECK (partition ~ '^audit_events_p[0-9]{8}$'),
    retired_at  timestamptz NOT NULL,
    events      bigint      NOT NULL CHECK (events >= 0),
    checkpoints bigint      NOT NULL CHECK (checkpoints >= 0),
    key_id      text        NOT NULL CHECK (key_id ~ '^[A-Za-z0-9-]{1,16}$'),
    mac         text        NOT NULL CHECK (mac ~ '^[0-9a-f]{64}$')
);

-- The trail's own record of a retirement (no token: audit_events_default).
ALTER TYPE audit_kind ADD VALUE IF NOT EXISTS 'audit.retired';

-- The token ledger.
--
-- `tokens` holds one row per token that Postgres has heard of: issuance
-- records arrive in batches a few milliseconds after issue; a consume inserts
-- the row itself when it gets there first (the signed token carries every
-- column a consume needs). The primary key on the snowflake id is the unique
-- index that decides first use versus duplicate for durable biz types.

CREATE TYPE token_state AS ENUM ('issued', 'consumed');
CREATE TYPE durability AS ENUM ('durable', 'fast');

CREATE TABLE tokens (
    id                 bigint      PRIMARY KEY,          -- snowflake id from the token text
    token              text        NOT NULL,             -- the full token text
    biz_type           text        NOT NULL,
    durability         durability  NOT NULL,
    subject            text        NOT NULL,
    client             text        NOT NULL,             -- the client it was issued to (and may be consumed by)
    issued_at          timestamptz NOT NULL,
    expires_at         timestamptz NOT NULL,
    state              token_state NOT NULL DEFAULT 'issued',
    consumed_at        timestamptz,
    fingerprint        text,                             -- of the consume that won
    request_id         text,                             -- of the consume that won: its retries replay `consumed`
    result             jsonb,                            -- the business result, once recorded
    result_at          timestamptz,
    order_id           text,                             -- set when an order event consumed the token
    duplicate_attempts bigint      NOT NULL DEFAULT 0,   -- flushed in batches, approximate under crashes
    CONSTRAINT tokens_consumed_has_time CHECK ((state = 'consumed') = (consumed_at IS NOT NULL)),
    CONSTRAINT tokens_result_needs_consume CHECK (result IS NULL OR state = 'consumed'),
    CONSTRAINT tokens_order_needs_consume CHECK (order_id IS NULL OR state = 'consumed')
);

-- Retention purge and reconciliation walk these.
CREATE INDEX tokens_consumed_at_idx ON tokens (consumed_at) WHERE state = 'consumed';
CREATE INDEX tokens_expires_at_idx ON tokens (expires_at) WHERE state = 'issued';
CREATE INDEX tokens_subject_idx ON tokens (subject, issued_at);

-- The audit trail: append-only, one row per change, written in the same
-- statement or transaction as the change it records.
CREATE TYPE audit_kind AS ENUM (
    'token.issued', 'token.consumed', 'token.released', 'token.result',
    'order.created', 'order.paid', 'order.refunded', 'order.closed',
    'reconcile.repaired'
);

CREATE TABLE audit_events (
    id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    kind     audit_kind  NOT NULL,
    token_id bigint,                                   -- tokens.id (no FK: audit outlives retention)
    token    text,
    subject  text,
    biz_type text,
    order_id text,
    client   text,
    detail   jsonb       NOT NULL DEFAULT '{}'::jsonb
);

-- Newest first by (at, id), alone or under one equality filter.
CREATE INDEX audit_at_idx ON audit_events (at DESC, id DESC);
CREATE INDEX audit_subject_idx ON audit_events (subject, at DESC, id DESC);
CREATE INDEX audit_token_idx ON audit_events (token_id, at DESC, id DESC);
CREATE INDEX audit_order_idx ON audit_events (order_id, at DESC, id DESC) WHERE order_id IS NOT NULL;
CREATE INDEX audit_biz_idx ON audit_events (biz_type, at DESC, id DESC);
CREATE INDEX audit_kind_idx ON audit_events (kind, at DESC, id DESC);
-- One `token.issued` per token, however often an issuance batch is retried.
CREATE UNIQUE INDEX audit_issued_once ON audit_events (token_id) WHERE kind = 'token.issued';

-- Snowflake worker ids are leased so that two running instances never share
-- one. `high_water_ms` is the last millisecond the holder promised not to pass
-- before its next renewal: the next holder starts its ids above it.
CREATE TABLE worker_leases (
    worker_id     integer     PRIMARY KEY CHECK (worker_id BETWEEN 0 AND 1023),
    holder        uuid        NOT NULL,
    expires_at    timestamptz NOT NULL,
    high_water_ms bigint      NOT NULL DEFAULT 0
);

-- Fleet-wide counters for /v1/admin/stats: each instance adds its deltas
-- every few seconds, one row per (minute, biz type).
CREATE TABLE stats_minutely (
    minute     timestamptz NOT NULL,
    biz_type   text        NOT NULL,
    issued     bigint      NOT NULL DEFAULT 0,
    consumed   bigint      NOT NULL DEFAULT 0,
    duplicates bigint      NOT NULL DEFAULT 0,
    expired    bigint      NOT NULL DEFAULT 0,
    invalid    bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, biz_type)
);

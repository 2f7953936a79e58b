-- Sealed audit checkpoints (src/audit_seal.rs, docs/audit.md "Sealed checkpoints").
--
-- A background job seals the audit events written since the last checkpoint
-- into a new one, one transaction per checkpoint, under an advisory lock (one
-- instance seals at a time). Checkpoint N covers the event ids in
-- (checkpoint N-1's last_event_id, last_event_id] (the first one: every id up
-- to its last_event_id), and chains them:
--
--   digest = SHA-256(prev_digest || event_1 || ... || event_n)
--
-- over the events of its range in id order, each as its canonical bytes
-- (every column of `audit_events`, length-prefixed; `detail` as canonical
-- JSON). `prev_digest` is the previous checkpoint's digest (64 zeros for the
-- first). `mac` is HMAC-SHA256 under the seal key named by `key_id`
-- (`audit.seal_keys`) over the checkpoint's own fields and both digests: a
-- checkpoint cannot be rewritten without the key, and an event edited,
-- deleted or inserted into a sealed range no longer hashes to its
-- checkpoint's digest (`idempotency-ledger audit verify`).
--
-- Only events that can no longer change under the sealer are sealed: an id
-- is taken at insert, so a transaction still in progress may commit an id
-- lower than one already visible. The job seals up to the highest visible id
-- only once every transaction that held a write lock on audit_events at that
-- moment has ended (src/audit_seal.rs, "What holds, and why").
--
-- Append-only like audit_events: nothing updates or deletes a checkpoint.
CREATE TABLE audit_checkpoints (
    id             bigserial   PRIMARY KEY,         -- covered by the mac: a checkpoint names itself
    sealed_at      timestamptz NOT NULL,            -- Postgres now() of the sealing transaction
    first_event_id bigint      NOT NULL,            -- the lowest event id in its range
    last_event_id  bigint      NOT NULL,            -- the highest: the next checkpoint starts above it
    events         bigint      NOT NULL,            -- how many events it seals (at least one)
    prev_digest    text        NOT NULL,            -- hex SHA-256: the previous checkpoint's digest, 64 zeros for the first
    digest         text        NOT NULL,            -- hex SHA-256 chained over prev_digest and the events
    key_id         text        NOT NULL,            -- the audit.seal_keys entry whose secret made the mac
    mac            text        NOT NULL,            -- hex HMAC-SHA256 over the fields above
    CONSTRAINT audit_checkpoints_range CHECK (first_event_id <= last_event_id AND events >= 1),
    CONSTRAINT audit_checkpoints_hex CHECK (
        prev_digest ~ '^[0-9a-f]{64}$' AND digest ~ '^[0-9a-f]{64}$' AND mac ~ '^[0-9a-f]{64}$'),
    CONSTRAINT audit_checkpoints_key_id CHECK (key_id ~ '^[A-Za-z0-9-]{1,16}$')
);

-- The sealer reads the last checkpoint (highest last_event_id); ranges never
-- overlap, so no two checkpoints end at the same event.
CREATE UNIQUE INDEX audit_checkpoints_last_event_idx ON audit_checkpoints (last_event_id);
-- `audit verify --since T` starts at the first checkpoint sealed at or after T.
CREATE INDEX audit_checkpoints_sealed_at_idx ON audit_checkpoints (sealed_at);

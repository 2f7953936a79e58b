-- How the instances agree that Redis is down (src/fleet.rs, docs/operations.md "Fleet").
--
-- Each instance reports its view of Redis here every fleet.heartbeat, under a
-- lock on the single fleet_state row. The fleet is `redis_down` only when
-- every member seen recently reports Redis down; only then do instances
-- decide fast consumes in Postgres, each under FOR SHARE of that row and at
-- its epoch, and each such decision leaves a redis_resync row in the same
-- transaction. The fleet goes back to `normal` only in the transaction that
-- has written every one of those decisions to Redis.

CREATE TABLE fleet_members (
    instance   uuid        PRIMARY KEY,
    redis_up   boolean     NOT NULL,
    seen_at    timestamptz NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE fleet_state (
    id    int         PRIMARY KEY CHECK (id = 1),
    state text        NOT NULL CHECK (state IN ('normal', 'redis_down')),
    epoch bigint      NOT NULL,
    since timestamptz NOT NULL
);

INSERT INTO fleet_state (id, state, epoch, since) VALUES (1, 'normal', 1, now());

CREATE TABLE redis_resync (
    token_id bigint PRIMARY KEY,       -- a token's id, or a client key's (negative) id
    handle   text   NOT NULL,          -- the token text or the key's handle: its Redis key
    epoch    bigint NOT NULL           -- the fleet_state epoch it was decided in
);

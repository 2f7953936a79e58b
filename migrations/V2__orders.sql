-- Orders: the payment state machine.
--
--   CREATED -> PAID -> PARTIALLY_REFUNDED -> REFUNDED
--   CREATED -> CLOSED
--
-- Every event (pay, refund, close) consumes a token of the order's subject in
-- the same statement that changes the order and writes its event and audit
-- rows, so a state change never exists without its token and its record.
-- The database enforces what it can: amounts positive, refunds never beyond
-- the paid amount, one event per token.

CREATE TYPE order_state AS ENUM ('CREATED', 'PAID', 'PARTIALLY_REFUNDED', 'REFUNDED', 'CLOSED');
CREATE TYPE order_event_kind AS ENUM ('order.created', 'order.paid', 'order.refunded', 'order.closed');

CREATE TABLE orders (
    order_id       text        PRIMARY KEY CHECK (order_id ~ '^[A-Za-z0-9_-]{1,64}$'),
    client         text        NOT NULL,            -- the client that created it (and may act on it)
    subject        text        NOT NULL,            -- the customer; event tokens must be bound to it
    state          order_state NOT NULL DEFAULT 'CREATED',
    amount_minor   bigint      NOT NULL CHECK (amount_minor BETWEEN 1 AND 1000000000000000),
    refunded_minor bigint      NOT NULL DEFAULT 0,
    currency       text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT orders_refund_within_amount CHECK (refunded_minor BETWEEN 0 AND amount_minor),
    CONSTRAINT orders_refunded_means_all CHECK (state <> 'REFUNDED' OR refunded_minor = amount_minor),
    CONSTRAINT orders_partial_means_some CHECK (
        state <> 'PARTIALLY_REFUNDED' OR (refunded_minor > 0 AND refunded_minor < amount_minor)),
    CONSTRAINT orders_unpaid_means_no_refund CHECK (
        state IN ('PARTIALLY_REFUNDED', 'REFUNDED') OR refunded_minor = 0)
);

CREATE TABLE order_events (
    id           bigint           GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id     text             NOT NULL REFERENCES orders (order_id),
    kind         order_event_kind NOT NULL,
    token_id     bigint,                              -- tokens.id; NULL for order.created
    token        text,
    amount_minor bigint           NOT NULL CHECK (amount_minor >= 0),
    request_id   text,                                -- of the attempt that applied it
    reason       text,                                -- refunds
    at           timestamptz      NOT NULL DEFAULT now(),
    CONSTRAINT order_events_one_per_token UNIQUE (token_id),
    CONSTRAINT order_events_token_unless_created CHECK ((kind = 'order.created') = (token_id IS NULL))
);

CREATE INDEX order_events_order_idx ON order_events (order_id, id);
CREATE INDEX orders_subject_idx ON orders (subject);

-- Issuance marks: how far each lease's tokens are known to Postgres.
--
-- A lease is one holding of a worker id (`worker_leases`): its snowflake ids
-- carry the worker id and a millisecond above `from_ms`, so the leases of one
-- worker id split its ids by time. `mark_ms` says: every token this lease
-- made with a millisecond at or below it has its issuance record (and its
-- audit row) committed, and its id notified on `ledger_issued`. A peer's
-- filter refuses an unknown id only at or below the mark of its lease; above
-- it, the record may still be on its way and the tiers decide.
--
--   written by  the lease's acquire (mark_ms = from_ms: nothing made yet),
--               the issuance batch statement (in the same statement as the
--               records), the issuer's idle tick (its mark follows the clock),
--               and a clean stop with nothing owed (mark_ms = 9223372036854775807:
--               every token of the lease is recorded);
--   notified on `ledger_marks` as `worker_id:from_ms:mark_ms`, after the ids
--               of the same statement;
--   kept        while the lease may hold live tokens: a lease's acquire
--               deletes rows not updated for twice the filter's horizon.
-- A holder killed before its records were flushed leaves its row below its
-- last tokens: they stay accepted, and the next holder of the worker id
-- writes a row of its own, starting above them.
CREATE TABLE issuance_marks (
    worker_id  integer     NOT NULL CHECK (worker_id BETWEEN 0 AND 1023),
    from_ms    bigint      NOT NULL,   -- the lease's ids carry later milliseconds
    holder     uuid        NOT NULL,   -- worker_leases.holder when it was taken
    mark_ms    bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (worker_id, from_ms),
    CONSTRAINT issuance_marks_after_start CHECK (mark_ms >= from_ms)
);

CREATE INDEX issuance_marks_updated_idx ON issuance_marks (updated_at);

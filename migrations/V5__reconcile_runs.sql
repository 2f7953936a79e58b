-- Reconcile runs, one row per run that took the lock (the CLI's and
-- POST /v1/admin/reconcile's alike), so that every instance can export the
-- last run's finish time and findings (`ledger_reconcile_last_*`), whichever
-- process ran it. A row is written at the end of the run, under the lock.
--
-- `complete`: not a dry run, not interrupted, and every phase finished: the
-- runs that the "reconcile has not run" alert counts. `found` and `repaired`
-- hold the report's counts by class name, so a new class needs no migration.
CREATE TABLE reconcile_runs (
    id          bigserial   PRIMARY KEY,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    dry_run     boolean     NOT NULL,
    interrupted boolean     NOT NULL,
    errors      jsonb       NOT NULL DEFAULT '[]',
    complete    boolean     NOT NULL,
    found       jsonb       NOT NULL,
    repaired    jsonb       NOT NULL,
    CHECK (finished_at >= started_at),
    CHECK (NOT complete OR (NOT dry_run AND NOT interrupted AND errors = '[]'))
);

CREATE INDEX reconcile_runs_complete_idx ON reconcile_runs (finished_at DESC) WHERE complete;

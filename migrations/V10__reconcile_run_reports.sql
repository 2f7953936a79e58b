-- Each reconcile run's whole report (the orders it found inconsistent and
-- the tokens Redis holds ahead of Postgres included), for auditors:
-- GET /v1/admin/reconcile/runs and `audit reconcile-runs` page through them,
-- newest first by id. Runs recorded before this column hold NULL: they are
-- shown from their counts alone.
ALTER TABLE reconcile_runs ADD COLUMN report jsonb;

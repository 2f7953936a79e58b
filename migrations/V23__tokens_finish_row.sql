-- The result or release of one token, pruned to the partition that holds
-- it: what the results and releases batch (src/durable/batch.rs,
-- `finish_batch`) calls for each of its items, in id order.
--
-- The batch was one statement that locked its rows (`id = ANY(ids)`) and
-- updated them through a join on `tokens`. Neither prunes: Postgres prunes
-- partitions on `id = ANY(<array parameter>)` nowhere, and on a join
-- condition only at each rescan, after setting up a scan of every
-- partition. So the statement scanned the primary key of every partition
-- for its lock and set up two more scans of every partition for its
-- updates, on every run: measured on a batch of 16 key results, 0.34 ms a
-- statement with 17 partitions (a week ahead, eight days behind: the
-- steady state of a 7-day retention) and 0.75 ms with 47 (a 30-day one),
-- growing with the retention. Here each item is one call on its own id,
-- which prunes to the partition that holds it: about 0.1 ms a batch of 16,
-- whatever the number of partitions (docs/operations.md, "The results and
-- releases batch").
--
-- The row is locked first (`FOR UPDATE`: the newest version, waited for
-- if another transaction holds it) and its conditions are checked on what
-- was locked, then the update names the id only, as the batch did: a
-- condition on the row's state in the update would let a cached plan, made
-- on statistics that saw few consumed rows, find the row through an index
-- of every consumed row (tests/api/batch_plans.rs). The caller calls it in
-- id order, so rows are locked in id order as in every other batch, and two
-- batches never deadlock.
--
-- VOLATILE: it writes. ROWS 1: it returns at most the one row, and with
-- that estimate the calling statement's cached (generic) plan is chosen
-- over planning it again on every run.
--
-- Answers nothing when the row is absent or is not to be changed (not
-- consumed, a result already, consumed by another request than
-- `p_of_request` when one is named, and for a release: bound to an order).
CREATE OR REPLACE FUNCTION tokens_finish_row(
    p_id bigint, p_release boolean, p_result jsonb, p_of_request text)
RETURNS SETOF tokens
LANGUAGE plpgsql VOLATILE ROWS 1 AS $$
DECLARE
    cur tokens%ROWTYPE;
BEGIN
    SELECT * INTO cur FROM tokens WHERE id = p_id FOR UPDATE;
    IF NOT FOUND
       OR cur.state <> 'consumed'
       OR cur.result IS NOT NULL
       OR (p_of_request IS NOT NULL AND cur.request_id IS DISTINCT FROM p_of_request)
       OR (p_release AND cur.order_id IS NOT NULL) THEN
        RETURN;
    END IF;
    IF p_release THEN
        RETURN QUERY
        UPDATE tokens t
           SET state = 'issued', gen = t.gen + 1, consumed_at = NULL, fingerprint = NULL,
               request_id = NULL,
               -- A key dates its release here (see V6).
               expires_at = CASE WHEN t.key IS NULL THEN t.expires_at ELSE now() END
         WHERE t.id = p_id
        RETURNING t.*;
    ELSE
        RETURN QUERY
        UPDATE tokens t SET result = p_result, result_at = now()
         WHERE t.id = p_id
        RETURNING t.*;
    END IF;
END
$$;

-- The row of one token as the calling statement sees it: what the consume
-- batches (src/durable/batch.rs, key_batch.rs) read for the items that did
-- not win, in the statement that claims the others.
--
-- Read through a join on `tokens`, the batch statement's cached (generic)
-- plan carried an index scan of every partition of `tokens`, set up on
-- every execution even when every item won and none was read: measured
-- with pgbench on batches of 16 consumes (9 partitions), about a quarter of
-- Postgres's CPU per consume. Behind this function the read is planned and
-- run only when it is called, for the items that did not win, and pruned
-- to the one partition that holds the id.
--
-- STABLE, so it reads with the snapshot of the statement that calls it
-- (as the join did): a row this statement's own claim changed is seen as it
-- was before, and a consume another transaction committed after the
-- statement began is not seen (the batch's fresh read settles those).
CREATE OR REPLACE FUNCTION tokens_row(p_id bigint) RETURNS SETOF tokens
    LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY SELECT * FROM tokens WHERE id = p_id;
END
$$;

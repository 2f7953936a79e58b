-- A member's report to the fleet (src/fleet.rs) as one server-side function,
-- called in one statement: the lock on the fleet_state row is held only
-- while Postgres runs it, never across a client's round trips, so one
-- instance with a slow link to Postgres cannot hold up the others' reports.
-- In READ COMMITTED each statement of a volatile function sees a fresh
-- snapshot: the count below, taken after the lock is granted, includes every
-- report committed before it (reports are serialised by the lock).
CREATE FUNCTION fleet_report(p_instance uuid, p_redis_up boolean, p_member_timeout_ms bigint)
RETURNS TABLE (state text, epoch bigint, members bigint, redis_down_members bigint, flipped boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    s text;
    e bigint;
    n bigint;
    d bigint;
    f boolean := false;
BEGIN
    SELECT fs.state, fs.epoch INTO s, e FROM fleet_state fs WHERE fs.id = 1 FOR UPDATE;
    INSERT INTO fleet_members AS m (instance, redis_up, seen_at)
    VALUES (p_instance, p_redis_up, clock_timestamp())
    ON CONFLICT (instance) DO UPDATE SET redis_up = EXCLUDED.redis_up, seen_at = EXCLUDED.seen_at;
    SELECT count(*), count(*) FILTER (WHERE NOT m.redis_up) INTO n, d
      FROM fleet_members m
     WHERE m.seen_at > clock_timestamp() - p_member_timeout_ms * interval '1 millisecond';
    IF s = 'normal' AND n > 0 AND d = n THEN
        UPDATE fleet_state fs SET state = 'redis_down', epoch = fs.epoch + 1, since = clock_timestamp()
         WHERE fs.id = 1
        RETURNING fs.epoch INTO e;
        s := 'redis_down';
        f := true;
    END IF;
    RETURN QUERY SELECT s, e, n, d, f;
END
$$;

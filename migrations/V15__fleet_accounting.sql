-- Members the fleet cannot account for (src/fleet.rs, "Accounting").
--
-- A member whose last report said "Redis up" may have let Redis decide fast
-- consumes whose only record is the journal in Redis. When it stops
-- reporting (crashed, paused, cut off from Postgres) it is no longer counted
-- after the member timeout, but its decisions are not in Postgres until the
-- journal drains. So the fleet turns `redis_down` only when no such member
-- is left: a member seen within the timeout must report Redis down (it
-- flushed its own decisions first), and a silent one that last said "up"
-- must have been retired by a member that saw the journal empty after the
-- silent one's lease ran out (`unaccounted` below; the retirement is a
-- DELETE by src/durable/fleet.rs).
DROP FUNCTION fleet_report(uuid, boolean, bigint);

CREATE FUNCTION fleet_report(p_instance uuid, p_redis_up boolean, p_member_timeout_ms bigint)
RETURNS TABLE (state text, epoch bigint, members bigint, redis_down_members bigint, flipped boolean,
               unaccounted bigint, at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    s text;
    e bigint;
    n bigint;
    d bigint;
    u bigint;
    t timestamptz;
    f boolean := false;
BEGIN
    SELECT fs.state, fs.epoch INTO s, e FROM fleet_state fs WHERE fs.id = 1 FOR UPDATE;
    t := clock_timestamp();
    INSERT INTO fleet_members AS m (instance, redis_up, seen_at)
    VALUES (p_instance, p_redis_up, t)
    ON CONFLICT (instance) DO UPDATE SET redis_up = EXCLUDED.redis_up, seen_at = EXCLUDED.seen_at;
    SELECT count(*) FILTER (WHERE m.seen_at > t - p_member_timeout_ms * interval '1 millisecond'),
           count(*) FILTER (WHERE m.seen_at > t - p_member_timeout_ms * interval '1 millisecond'
                              AND NOT m.redis_up),
           count(*) FILTER (WHERE m.seen_at <= t - p_member_timeout_ms * interval '1 millisecond'
                              AND m.redis_up)
      INTO n, d, u
      FROM fleet_members m;
    IF s = 'normal' AND n > 0 AND d = n AND u = 0 THEN
        UPDATE fleet_state fs SET state = 'redis_down', epoch = fs.epoch + 1, since = clock_timestamp()
         WHERE fs.id = 1
        RETURNING fs.epoch INTO e;
        s := 'redis_down';
        f := true;
    END IF;
    RETURN QUERY SELECT s, e, n, d, f, u, t;
END
$$;

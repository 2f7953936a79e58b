-- Which Redis dataset the fleet agreed on (src/fleet.rs, "Dataset").
--
-- Redis run without persistence can restart empty between two calls, so
-- quickly that no instance saw it down: its consumed markers and the journal
-- entries Postgres had not received are gone, and an empty journal would
-- look drained. So the fleet records an id here and writes it into Redis
-- (`<prefix>dataset`); every fast decision's script checks it and refuses on
-- another dataset (or none), and the journal counts as drained only on this
-- one. A Redis that lost it is treated as down until the fleet has ended an
-- episode (every member's recent decisions written to Postgres), whose last
-- transaction writes the id back. NULL: none yet (the first member sets it).
ALTER TABLE fleet_state ADD COLUMN redis_dataset uuid;

DROP FUNCTION fleet_report(uuid, boolean, bigint);

CREATE FUNCTION fleet_report(p_instance uuid, p_redis_up boolean, p_member_timeout_ms bigint)
RETURNS TABLE (state text, epoch bigint, members bigint, redis_down_members bigint, flipped boolean,
               unaccounted bigint, at timestamptz, dataset uuid)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    s text;
    e bigint;
    n bigint;
    d bigint;
    u bigint;
    t timestamptz;
    ds uuid;
    f boolean := false;
BEGIN
    SELECT fs.state, fs.epoch, fs.redis_dataset INTO s, e, ds FROM fleet_state fs WHERE fs.id = 1 FOR UPDATE;
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
    RETURN QUERY SELECT s, e, n, d, f, u, t, ds;
END
$$;

-- Read one token's key for reconcile, with the clock of the node that holds
-- it (the clock its provisional deadline was set in).
-- KEYS[1] the token's hash.
-- Returns {TIME, {s, d, g}} (a missing field is nil).
return {redis.call('TIME'), redis.call('HMGET', KEYS[1], 's', 'd', 'g')}

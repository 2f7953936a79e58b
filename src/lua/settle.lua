-- Write Postgres's decision back to the fast tier. Touches one token's key.
--
-- KEYS[1]  the token's hash
-- ARGV[1]  'consumed': mark consumed (Postgres decided so), but only over a
--                      missing key, a consumed marker or our own (ARGV[2])
--                      provisional marker; never over 'issued' (a release may
--                      have just written it) or another attempt's claim
--          'consumed_force': mark consumed whatever the key holds (replaying
--                      what Postgres decided while Redis was down)
--          'unclaim':  our provisional marker goes back to issued (the consume
--                      did not commit), only if we still own it
--          'issued':   set to issued (release), whatever it was
--          'result':   add the result (ARGV[7]) to the key, if it exists
-- ARGV[2]  owner (unclaim, consumed)
-- ARGV[3]  lifetime, ms (consumed: the consumed marker's; unclaim/issued: the
--          token's remaining ttl; <= 0 deletes the key)
-- ARGV[4]  consumed_at ms, ARGV[5] request_id, ARGV[6] fingerprint, ARGV[7] result ('' none)
local key = KEYS[1]
local op = ARGV[1]
local ttl = tonumber(ARGV[3])
if op == 'consumed' or op == 'consumed_force' then
  if op == 'consumed' then
    local h = redis.call('HMGET', key, 's', 'o')
    if h[1] == 'i' then return 0 end
    if h[1] == 'p' and h[2] ~= ARGV[2] then return 0 end
  end
  redis.call('HSET', key, 's', 'c', 'at', ARGV[4], 'rid', ARGV[5], 'fp', ARGV[6])
  if ARGV[7] ~= '' then redis.call('HSET', key, 'res', ARGV[7]) end
  -- No generation known here: the key's state stands for it.
  redis.call('HDEL', key, 'o', 'd', 'g')
  redis.call('PEXPIRE', key, ttl)
  return 1
end
if op == 'result' then
  -- Whatever the state: a consumed marker written later by the winner's own
  -- settle (which never clears `res`) then carries the result too.
  if redis.call('EXISTS', key) == 1 then redis.call('HSET', key, 'res', ARGV[7]) end
  return 1
end
if op == 'unclaim' then
  local h = redis.call('HMGET', key, 's', 'o')
  if h[1] ~= 'p' or h[2] ~= ARGV[2] then return 0 end
end
if ttl <= 0 then
  redis.call('DEL', key)
  return 1
end
redis.call('DEL', key)
redis.call('HSET', key, 's', 'i')
redis.call('PEXPIRE', key, ttl)
return 1

-- Reconciliation repairs. Touches one token's key; never turns a consumed
-- marker back into a live token.
--
-- KEYS[1]  the token's hash  <prefix>tok:{<token>}
-- ARGV[1]  'drop_live':   delete the key if it still says issued (Postgres
--                         consumed the token; Postgres answers from now on)
--          'clear_stale': a provisional marker past its deadline goes back
--                         to issued with ARGV[2] ms to live (<= 0 deletes it),
--                         or, when ARGV[3] = '1' (Postgres consumed the token),
--                         becomes the consumed marker ARGV[4..7] (at, rid, fp,
--                         res) living ARGV[8] ms
-- Returns 1 when repaired, 0 when the key changed meanwhile (nothing done).
local key = KEYS[1]
local op = ARGV[1]
local h = redis.call('HMGET', key, 's', 'd')
if op == 'drop_live' then
  if h[1] ~= 'i' then return 0 end
  redis.call('DEL', key)
  return 1
end
if op ~= 'clear_stale' then return redis.error_reply('unknown op ' .. tostring(op)) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if h[1] ~= 'p' or tonumber(h[2] or '0') > now then return 0 end
if ARGV[3] == '1' then
  redis.call('HSET', key, 's', 'c', 'at', ARGV[4], 'rid', ARGV[5], 'fp', ARGV[6])
  if ARGV[7] ~= '' then redis.call('HSET', key, 'res', ARGV[7]) end
  redis.call('HDEL', key, 'o', 'd')
  redis.call('PEXPIRE', key, ARGV[8])
  return 1
end
local ttl = tonumber(ARGV[2])
redis.call('DEL', key)
if ttl > 0 then
  redis.call('HSET', key, 's', 'i')
  redis.call('PEXPIRE', key, ttl)
end
return 1

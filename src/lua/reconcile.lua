-- Reconciliation repairs. Touches one token's key; never turns a consumed
-- marker back into a live token unless Postgres holds that token live, and
-- never writes a state over a newer generation (generations as in
-- consume.lua: field g, or 1 for a consumed key without it, 0 otherwise).
--
-- KEYS[1]  the token's hash  <prefix>tok:{<token>}
-- ARGV[1]  'drop_live':   delete the key if it still says issued at a
--                         generation older than Postgres's consumed one
--                         (ARGV[9]); Postgres answers from now on
--          'clear_stale': a provisional marker past its deadline becomes,
--                         when ARGV[3] = '1' (Postgres consumed the token at
--                         generation ARGV[9]), the consumed marker ARGV[4..7]
--                         (at, rid, fp, res) living ARGV[8] ms from its `at`;
--                         otherwise it goes back to issued (at the newer of
--                         its own generation and ARGV[9]) with ARGV[2] ms to
--                         live (<= 0 deletes it)
--          'give_way':    a durable token's consumed marker, whose g field
--                         still reads ARGV[10] ('' for none) as reconcile saw
--                         it, while Postgres holds the token issued at
--                         generation ARGV[9]: becomes issued at that
--                         generation with ARGV[2] ms to live (<= 0 deletes)
-- Returns 1 when repaired, 0 when the key changed meanwhile (nothing done).
local key = KEYS[1]
local op = ARGV[1]
local h = redis.call('HMGET', key, 's', 'd', 'g')
local s = h[1]
local g = tonumber(h[3])
-- A generation that contradicts the state (odd means consumed) is not trusted.
if g and ((g % 2 == 1) ~= (s == 'c')) then g = nil end
if not g then
  if s == 'c' then g = 1 elseif s then g = 0 else g = -1 end
end
local pg = tonumber(ARGV[9])
local ttl = tonumber(ARGV[2])
local function issued(gen)
  redis.call('DEL', key)
  if ttl > 0 then
    redis.call('HSET', key, 's', 'i', 'g', gen)
    redis.call('PEXPIRE', key, ttl)
  end
  return 1
end

if op == 'drop_live' then
  if s ~= 'i' or g >= pg then return 0 end
  redis.call('DEL', key)
  return 1
end
if op == 'give_way' then
  if s ~= 'c' or (h[3] or '') ~= ARGV[10] then return 0 end
  return issued(pg)
end
if op ~= 'clear_stale' then return redis.error_reply('unknown op ' .. tostring(op)) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if s ~= 'p' or tonumber(h[2] or '0') > now then return 0 end
if ARGV[3] == '1' and g < pg then
  local life = tonumber(ARGV[8])
  local left = math.min(life, (tonumber(ARGV[4]) or now) + life - now)
  redis.call('DEL', key)
  if left <= 0 then return 1 end
  redis.call('HSET', key, 's', 'c', 'g', pg, 'at', ARGV[4], 'rid', ARGV[5], 'fp', ARGV[6])
  if ARGV[7] ~= '' then redis.call('HSET', key, 'res', ARGV[7]) end
  redis.call('PEXPIRE', key, left)
  return 1
end
return issued(math.max(g, pg))

-- Result and release for fast biz types, where Redis decides. Touches one
-- token's key (and the journal stream on a standalone Redis).
--
-- KEYS[1]  the token's hash, KEYS[2] the journal stream
-- ARGV[1]  'result' | 'release'
-- ARGV[2]  result JSON (result) | remaining ttl ms (release)
-- ARGV[3]  '1' to append to the journal stream
-- ARGV[4..] journal entry fields
--
-- Returns {kind, detail}:
--   result:  recorded | same | conflict (detail: stored result) | not_consumed | miss
--   release: released | not_releasable | miss
local key = KEYS[1]
local h = redis.call('HMGET', key, 's', 'res', 'ord')
local s = h[1]
if not s then return {'miss', ''} end
if ARGV[1] == 'result' then
  if s ~= 'c' then return {'not_consumed', ''} end
  if h[2] then
    if h[2] == ARGV[2] then return {'same', h[2]} end
    return {'conflict', h[2]}
  end
  redis.call('HSET', key, 'res', ARGV[2])
  if ARGV[3] == '1' then
    redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
  end
  return {'recorded', ''}
end
-- release
if s ~= 'c' or h[2] or h[3] then return {'not_releasable', ''} end
local ttl = tonumber(ARGV[2])
redis.call('DEL', key)
if ttl > 0 then
  redis.call('HSET', key, 's', 'i')
  redis.call('PEXPIRE', key, ttl)
end
if ARGV[3] == '1' then
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
end
return {'released', ''}

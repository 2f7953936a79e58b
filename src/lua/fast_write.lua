-- Result and release for fast biz types, where Redis decides. Touches one
-- token's key (and the journal stream on a standalone Redis).
--
-- KEYS[1]  the token's hash, KEYS[2] the journal stream, KEYS[3] the dataset
--          key <prefix>dataset (both on a standalone Redis)
-- ARGV[1]  'result' | 'release' | 'lease_release'
-- ARGV[2]  result JSON (result) | 'ttl_ms' or 'ttl_ms:cool_ms' (release: the
--          remaining ttl; for cool_ms after it, no consume may take the
--          token (consume.lua's `cooling`): a consume script sent before the
--          release, whose caller died or gave up, passes its not-after bound
--          first, and never consumes the released token for nobody) |
--          'ttl_ms:gen:lease_ms[:cool_ms]' (lease_release: a release only of
--          generation `gen`, and only once its consume is lease_ms old by
--          Redis's clock; cool_ms as for a release)
-- ARGV[3]  '1' to append to the journal stream
-- ARGV[4]  the request_id of the consume this result or release belongs to
--          ('' any): another consume's holds it: not_consumed / not_releasable
-- ARGV[5]  not after: Redis's time (ms) past which the caller has given up
--          ('' none): the script then answers `late` and writes nothing
-- ARGV[6]  the dataset id the caller's fleet agreed on ('' not checked): a
--          Redis whose KEYS[3] holds another (or none: it restarted empty)
--          writes nothing and answers `foreign`, as consume.lua
-- ARGV[7..] journal entry fields
--
-- The journal entry gets what only this script knows: `at` (now, ms), `g`
-- (a result: the consumed generation it belongs to; a release: the next,
-- issued, generation) and for a result the consumed state it completes
-- (`cat` consumed at, `rid`, `fp`). Generations as in consume.lua.
--
-- Returns {kind, detail, g, now, cat, rid, fp}:
--   result:  recorded | same | conflict (detail: stored result) | not_consumed | miss
--   release, lease_release: released | not_releasable | miss
--   any: late (it ran after ARGV[5]: nothing written), foreign (ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[5] ~= '' and now > tonumber(ARGV[5]) then return {'late', '', '', tostring(now)} end
if KEYS[3] and ARGV[6] and ARGV[6] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[6] then
  return {'foreign', '', '', tostring(now)}
end
local key = KEYS[1]
local h = redis.call('HMGET', key, 's', 'res', 'ord', 'g', 'at', 'rid', 'fp', 'sub')
local s = h[1]
if not s then return {'miss', ''} end
local g = tonumber(h[4])
-- A generation that contradicts the state (odd means consumed) is not trusted.
if g and ((g % 2 == 1) ~= (s == 'c')) then g = nil end
if not g then
  if s == 'c' then g = 1 else g = 0 end
end
local at, rid, fp = h[5] or '', h[6] or '', h[7] or ''
local other = ARGV[4] ~= '' and rid ~= ARGV[4]
if ARGV[1] == 'result' then
  if s ~= 'c' or other then return {'not_consumed', ''} end
  if h[2] then
    if h[2] == ARGV[2] then return {'same', h[2]} end
    return {'conflict', h[2]}
  end
  redis.call('HSET', key, 'res', ARGV[2])
  if ARGV[3] == '1' then
    redis.call('XADD', KEYS[2], '*', 'at', now, 'g', g, 'cat', at, 'rid', rid, 'fp', fp,
      unpack(ARGV, 7))
  end
  return {'recorded', '', tostring(g), tostring(now), at, rid, fp}
end
-- release
if s ~= 'c' or h[2] or h[3] or other then return {'not_releasable', ''} end
local ttl_arg = ARGV[2]
local cool = nil
if ARGV[1] == 'release' then
  local ttl_s, cool_s = string.match(ARGV[2], '^(%-?%d+):(%d+)$')
  if ttl_s then ttl_arg, cool = ttl_s, tonumber(cool_s) end
end
if ARGV[1] == 'lease_release' then
  local ttl_s, want, lease, cool_s = string.match(ARGV[2], '^(%-?%d+):(%d+):(%d+):?(%d*)$')
  if not ttl_s then return redis.error_reply('lease_release: bad argument') end
  if cool_s ~= '' then cool = tonumber(cool_s) end
  if g ~= tonumber(want) or tonumber(at or '') == nil
     or now - tonumber(at) < tonumber(lease) then
    return {'not_releasable', ''}
  end
  ttl_arg = ttl_s
end
-- The next issued (even) generation.
g = g + 1
if g % 2 == 1 then g = g + 1 end
local ttl = tonumber(ttl_arg)
redis.call('DEL', key)
if ttl > 0 then
  redis.call('HSET', key, 's', 'i', 'g', g)
  if cool then redis.call('HSET', key, 'ca', now + cool) end
  -- A client key stays bound to its subject.
  if h[8] then redis.call('HSET', key, 'sub', h[8]) end
  redis.call('PEXPIRE', key, ttl)
end
if ARGV[3] == '1' then
  redis.call('XADD', KEYS[2], '*', 'at', now, 'g', g, unpack(ARGV, 7))
end
return {'released', '', tostring(g), tostring(now)}

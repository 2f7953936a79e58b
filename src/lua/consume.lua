-- Consume one token in the fast tier, atomically. Touches one token's key
-- (and, for fast biz types on a standalone Redis, the journal stream).
--
-- KEYS[1]  the token's hash  <prefix>tok:{<token>}
-- KEYS[2]  the journal stream (fast mode only)
-- ARGV[1]  mode: 'durable' (claim a provisional marker; Postgres decides),
--                'fast' (decide here, append to the journal), 'peek' (read only)
-- ARGV[2]  attempt owner (random, unique per attempt)
-- ARGV[3]  provisional lifetime, ms
-- ARGV[4]  request_id ('' when absent)
-- ARGV[5]  fingerprint ('' when absent)
-- ARGV[6]  consumed marker lifetime, ms
-- ARGV[7]  '1' to append to the journal stream (fast mode), else '0'
-- ARGV[8..] journal entry fields (field, value pairs), fast mode only
--
-- Hash fields: s state (i issued, p provisional, c consumed), o owner,
-- d provisional deadline (ms), at consumed/claimed at (ms), rid, fp, res.
--
-- Returns {kind, at, rid, fp, res}:
--   won         fast mode: consumed now, journal appended
--   claimed     durable mode: provisional marker set, Postgres decides
--   consumed    consumed before (read only: duplicates are counted by the
--               service, in Postgres's duplicate_attempts)
--   provisional another attempt holds a live provisional marker
--   miss        no key (Redis lost it, it expired, or it was never seeded)
--   issued      peek mode: live and unconsumed
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key = KEYS[1]
local mode = ARGV[1]
local h = redis.call('HMGET', key, 's', 'd', 'at', 'rid', 'fp', 'res')
local s = h[1]

if s == 'c' then
  return {'consumed', h[3] or '', h[4] or '', h[5] or '', h[6] or ''}
end
if s == 'p' and tonumber(h[2] or '0') > now then
  return {'provisional', h[3] or '', h[4] or '', h[5] or '', ''}
end
if mode == 'peek' then
  if s then return {'issued', '', '', '', ''} end
  return {'miss', '', '', '', ''}
end
if mode == 'fast' then
  if not s then return {'miss', '', '', '', ''} end
  redis.call('HSET', key, 's', 'c', 'at', now, 'rid', ARGV[4], 'fp', ARGV[5])
  if s == 'p' then redis.call('HDEL', key, 'o', 'd') end
  redis.call('PEXPIRE', key, ARGV[6])
  if ARGV[7] == '1' then
    redis.call('XADD', KEYS[2], '*', 'at', now, unpack(ARGV, 8))
  end
  return {'won', tostring(now), '', '', ''}
end
-- durable: claim. A missing key is claimed too (Postgres still decides), and
-- lives no longer than the provisional marker unless finalized.
local deadline = now + tonumber(ARGV[3])
redis.call('HSET', key, 's', 'p', 'o', ARGV[2], 'd', deadline, 'at', now, 'rid', ARGV[4], 'fp', ARGV[5])
if not s then
  redis.call('PEXPIRE', key, tonumber(ARGV[3]) + 1000)
elseif redis.call('PTTL', key) < tonumber(ARGV[3]) + 1000 then
  redis.call('PEXPIRE', key, tonumber(ARGV[3]) + 1000)
end
return {'claimed', tostring(now), '', '', ''}

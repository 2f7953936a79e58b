-- Consume one token in the fast tier, atomically. Touches one token's key
-- (and, for fast biz types on a standalone Redis, the journal stream).
--
-- KEYS[1]  the token's hash  <prefix>tok:{<token>}
-- KEYS[2]  the journal stream (fast mode only)
-- KEYS[3]  the dataset key <prefix>dataset (fast mode on a standalone Redis)
-- ARGV[1]  mode: 'durable' (claim a provisional marker; Postgres decides),
--                'fast' (decide here, append to the journal), 'peek' (read only)
-- ARGV[2]  attempt owner (random, unique per attempt)
-- ARGV[3]  provisional lifetime, ms
-- ARGV[4]  request_id ('' when absent)
-- ARGV[5]  fingerprint ('' when absent)
-- ARGV[6]  consumed marker lifetime, ms (never beyond tokens.retention)
-- ARGV[7]  '1' to append to the journal stream (fast mode), else '0'
-- ARGV[8]  client keys, fast mode: the subject the call names ('' none, and
--          always '' for tokens, whose binding is signed)
-- ARGV[9]  client keys, fast mode: '' (tokens: a missing key is a miss) or
--          the generation a missing key is created at (a key's first
--          consume: Postgres's generation for it, 0 when it has no row)
-- ARGV[10] client keys, fast mode: '1' when the service checked ARGV[8]
--          against Postgres, so a key without a recorded subject takes it
-- ARGV[11] not after: Redis's time (ms) past which the caller has given up
--          ('' none): the script then answers `late` and writes nothing
-- ARGV[12] fast mode: the dataset id the caller's fleet agreed on ('': not
--          checked, for replays of decisions already made): a Redis whose
--          KEYS[3] holds another (or none: it restarted empty) decides
--          nothing and answers `foreign`
-- ARGV[13..] journal entry fields (field, value pairs), fast mode only
--
-- Hash fields: s state (i issued, p provisional, c consumed), g generation
-- (bumped by every consume and release: odd while consumed; a key written
-- before generations has none, and its state tells it: c 1, otherwise 0),
-- o owner (the attempt holding a provisional marker, or the one that won a
-- fast consume), d provisional deadline (ms), at consumed/claimed at (ms),
-- ca consumable after (ms: set by a release, see `cooling`),
-- rid, fp, res, sub (a client key's subject, '' for none: kept across
-- every later state; a key's hash that lacks it, written back from
-- Postgres, is `unbound` until the service checks the subject). A claim
-- does not change the generation: it is not a state change.
--
-- Idempotent per attempt owner: sent again by the same attempt (the service
-- resends a consume whose connection dropped before its reply, see
-- `FastTier::consume`), the script answers what it answered the first time
-- and writes nothing more, whether or not that first one ran, and in either
-- order: a fast win answers `won` again (the journal entry is not appended
-- twice), a durable claim answers `claimed` again (while it is live).
--
-- Returns {kind, at, rid, fp, res, g, now}, g the key's generation (after a
-- win, the one it decided; -1 for a missing key), now Redis's clock in ms:
--   won         fast mode: consumed now, journal appended (with `at` and `g`)
--   claimed     durable mode: provisional marker set, Postgres decides
--   consumed    consumed before (read only: duplicates are counted by the
--               service, in Postgres's duplicate_attempts)
--   provisional another attempt holds a live provisional marker
--   miss        no key (Redis lost it, it expired, or it was never seeded)
--   issued      peek mode: live and unconsumed
--   mismatch    client keys, fast mode: bound to another subject than ARGV[8]
--   unbound     client keys, fast mode: ARGV[8] given, and the hash has no
--               recorded subject to compare it with (nothing written)
--   late        it ran after ARGV[11]: nothing read or written
--   foreign     fast mode: Redis holds another dataset than ARGV[12]: nothing
--               written (its journal may have lost decisions Postgres lacks)
--   cooling     fast mode: released less than the releaser's redis.timeout
--               ago (at: until when). A script sent before the release may
--               still arrive until then, for a caller that died or gave up:
--               until then nobody consumes it (nothing written); a caller
--               still waiting sends again after it.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key = KEYS[1]
local mode = ARGV[1]
local h = redis.call('HMGET', key, 's', 'd', 'at', 'rid', 'fp', 'res', 'g', 'o', 'sub', 'ca')
local s = h[1]
local ours = ARGV[2] ~= '' and h[8] == ARGV[2]
local g = tonumber(h[7])
-- A generation that contradicts the state (odd means consumed) is not trusted.
if g and ((g % 2 == 1) ~= (s == 'c')) then g = nil end
if not g then
  if s == 'c' then g = 1 elseif s then g = 0 else g = -1 end
end
local function reply(kind, at, rid, fp, res)
  return {kind, at or '', rid or '', fp or '', res or '', tostring(g), tostring(now)}
end
-- Its caller gave up (503, outcome unknown) and may have retried elsewhere:
-- deciding now would act for nobody.
if ARGV[11] and ARGV[11] ~= '' and now > tonumber(ARGV[11]) then return reply('late') end
-- Decided only on the dataset the fleet agreed on: a Redis that restarted
-- empty lost markers and journal entries that only the fleet can account for.
if mode == 'fast' and KEYS[3] and ARGV[12] and ARGV[12] ~= '' then
  if redis.call('GET', KEYS[3]) ~= ARGV[12] then return reply('foreign') end
end

local subject = ARGV[8] or ''
if mode == 'fast' and not s and ARGV[9] and ARGV[9] ~= '' then
  -- A client key's first consume: created issued at ARGV[9], then won below.
  s = 'i'
  g = tonumber(ARGV[9])
  h[9] = subject
end
if mode == 'fast' and subject ~= '' and s and not ours then
  if not h[9] then
    if ARGV[10] ~= '1' then return reply('unbound') end
    h[9] = subject
    redis.call('HSET', key, 'sub', subject)
  end
  if h[9] ~= subject then return reply('mismatch') end
end

if s == 'c' then
  if ours and mode == 'fast' then return reply('won', h[3]) end
  return reply('consumed', h[3], h[4], h[5], h[6])
end
if s == 'p' and tonumber(h[2] or '0') > now then
  if ours and mode == 'durable' then return reply('claimed', h[3]) end
  return reply('provisional', h[3], h[4], h[5], '')
end
if mode == 'fast' and s == 'i' and h[10] and now <= tonumber(h[10]) then
  return reply('cooling', h[10])
end
if mode == 'peek' then
  if s then return reply('issued') end
  return reply('miss')
end
if mode == 'fast' then
  if not s then return reply('miss') end
  -- The next consumed (odd) generation.
  g = g + 1
  if g % 2 == 0 then g = g + 1 end
  redis.call('HSET', key, 's', 'c', 'g', g, 'at', now, 'rid', ARGV[4], 'fp', ARGV[5], 'o', ARGV[2])
  if h[9] then redis.call('HSET', key, 'sub', h[9]) end
  if s == 'p' then redis.call('HDEL', key, 'd') end
  redis.call('PEXPIRE', key, ARGV[6])
  if ARGV[7] == '1' then
    redis.call('XADD', KEYS[2], '*', 'at', now, 'g', g, unpack(ARGV, 13))
  end
  return reply('won', tostring(now))
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
return reply('claimed', tostring(now))

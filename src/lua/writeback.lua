-- Write a state Postgres decided back to the fast tier, versioned. Touches
-- one token's key. A write applies only over an older generation, so late,
-- repeated or reordered write-backs never move a token backwards.
--
-- KEYS[1]  the token's hash
-- ARGV[1]  'consumed': the consumed state at generation ARGV[2] (odd), with
--                      ARGV[4] at (ms), ARGV[5] request_id, ARGV[6]
--                      fingerprint, ARGV[7] result ('' none), living ARGV[3]
--                      ms (<= 0: deleted instead, its retention is over).
--                      Over the same generation's marker it only adds the
--                      result, if that marker lacks one; with ARGV[9] '1'
--                      (Postgres decided this generation while the fleet
--                      had Redis down) it replaces that marker: Redis's can
--                      only be a script that ran after its caller gave up
--                      on it (see `crate::fleet`), whose caller was never
--                      told it won. A result the replaced marker holds is
--                      kept when ARGV[7] brings none.
--          'issued':   issued at generation ARGV[2] (even), living ARGV[3] ms
--                      (<= 0 deletes the key: the token expired)
--          'unclaim':  our provisional marker (owner ARGV[8]) goes back to
--                      issued at its own generation, living ARGV[3] ms, if we
--                      still own it (the owner is unique per attempt, so it
--                      versions the claim)
--
-- Generations: field g. A key written before generations has none: its
-- generation follows from its state (consumed 1, otherwise 0); a missing key
-- is older than any generation.
--
-- A client key's subject (field sub) is kept across every rewrite.
--
-- Returns 1 when written, 0 when the key holds the same or a newer state.
local key = KEYS[1]
local op = ARGV[1]
local want = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local h = redis.call('HMGET', key, 's', 'g', 'res', 'o', 'sub')
local function keep_subject()
  if h[5] then redis.call('HSET', key, 'sub', h[5]) end
end
local s = h[1]
local g = tonumber(h[2])
-- A generation that contradicts the state (odd means consumed) is not trusted.
if g and ((g % 2 == 1) ~= (s == 'c')) then g = nil end
if not g then
  if s == 'c' then g = 1 elseif s then g = 0 else g = -1 end
end

if op == 'unclaim' then
  if s ~= 'p' or h[4] ~= ARGV[8] then return 0 end
  redis.call('DEL', key)
  if ttl > 0 then
    redis.call('HSET', key, 's', 'i', 'g', g)
    keep_subject()
    redis.call('PEXPIRE', key, ttl)
  end
  return 1
end

if op == 'consumed' then
  local over = ARGV[9] == '1'
  local result = ARGV[7]
  if g == want and s == 'c' then
    if over then
      if result == '' then result = h[3] or '' end
    elseif ARGV[7] ~= '' and not h[3] then
      redis.call('HSET', key, 'res', ARGV[7])
      return 1
    else
      return 0
    end
  elseif g >= want then
    return 0
  end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local left = math.min(ttl, (tonumber(ARGV[4]) or now) + ttl - now)
  redis.call('DEL', key)
  if left <= 0 then return 1 end
  redis.call('HSET', key, 's', 'c', 'g', want, 'at', ARGV[4], 'rid', ARGV[5], 'fp', ARGV[6])
  if result ~= '' then redis.call('HSET', key, 'res', result) end
  keep_subject()
  redis.call('PEXPIRE', key, left)
  return 1
end

if op == 'issued' then
  if g >= want then return 0 end
  redis.call('DEL', key)
  if ttl > 0 then
    redis.call('HSET', key, 's', 'i', 'g', want)
    keep_subject()
    redis.call('PEXPIRE', key, ttl)
  end
  return 1
end

return redis.error_reply('unknown op ' .. tostring(op))

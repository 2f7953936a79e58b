-- Seed a freshly issued token (or re-seed one Redis lost).
-- KEYS[1] the token's hash; ARGV[1] ttl ms; ARGV[2] its generation (0 when
-- just issued; Postgres's when re-seeded).
-- Never overwrites (ids are unique; a consume may already have claimed it).
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 's', 'i', 'g', ARGV[2] or 0)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1

-- Seed a freshly issued token. KEYS[1] the token's hash; ARGV[1] ttl ms.
-- Never overwrites (ids are unique; a consume may already have claimed it).
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 's', 'i')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1

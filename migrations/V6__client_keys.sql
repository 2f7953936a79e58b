-- Client-supplied keys (the Idempotency-Key model, /v1/keys).
--
-- A client key lives in `tokens`, beside the tokens we issue, so that the
-- consume protocol, generations, the fast-type journal, result, release,
-- reconciliation and the retention purge apply to it unchanged. Its row:
--   id        derived from (client, biz_type, key): the first 63 bits of
--             SHA-256 over them, negated (a snowflake id is never negative,
--             so keys and tokens never share an id);
--   token     the key's handle `k.<sha256 hex>`: the hash tag of its Redis
--             key (`<prefix>tok:{k.<hex>}`), derived only from
--             (client, biz_type, key); never shown as a token;
--   key       the key as the client sent it (1 to 255 printable ASCII);
--   subject   the subject named by the consume that created it, '' for none;
--   issued_at when it was first consumed; expires_at: its first consume,
--             then each release (a key never expires unconsumed: this only
--             dates it for the purge of released keys past retention).
--
-- The unique index on (client, biz_type, key) decides first use versus
-- duplicate for durable biz types: the consume statement inserts with
-- ON CONFLICT on it. The primary key on the derived id stays the backstop:
-- two keys whose ids collide make the second one's insert fail (an error
-- answered 500), never a duplicate of the other key.
--
-- On a large table, build the index by hand first, without blocking writes:
--   ALTER TABLE tokens ADD COLUMN key text;
--   CREATE UNIQUE INDEX CONCURRENTLY tokens_client_key_idx
--       ON tokens (client, biz_type, key) WHERE key IS NOT NULL;
-- and this migration finds both there.
ALTER TABLE tokens ADD COLUMN IF NOT EXISTS key text;
ALTER TABLE tokens ADD CONSTRAINT tokens_key_shape
    CHECK (key IS NULL OR (key ~ '^[\x20-\x7e]{1,255}$' AND id < 0));
CREATE UNIQUE INDEX IF NOT EXISTS tokens_client_key_idx
    ON tokens (client, biz_type, key) WHERE key IS NOT NULL;

-- Their audit rows: `token_id` is the key's row id, `token` is NULL and
-- `detail.key` names the key.
ALTER TYPE audit_kind ADD VALUE IF NOT EXISTS 'key.consumed';
ALTER TYPE audit_kind ADD VALUE IF NOT EXISTS 'key.result';
ALTER TYPE audit_kind ADD VALUE IF NOT EXISTS 'key.released';

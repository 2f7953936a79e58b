-- Audit kinds for a second decision of one generation (`token.conflict`:
-- two deciders both answered `consumed`; it is kept, never dropped) and for
-- processing leases that ran out (`token.uncertain`, `key.uncertain`).
ALTER TYPE audit_kind ADD VALUE IF NOT EXISTS 'token.conflict';
ALTER TYPE audit_kind ADD VALUE IF NOT EXISTS 'token.uncertain';
ALTER TYPE audit_kind ADD VALUE IF NOT EXISTS 'key.uncertain';

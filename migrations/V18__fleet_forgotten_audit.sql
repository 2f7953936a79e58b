-- An operator's `fleet forget-silent --accept-lost-decisions` is part of the
-- audit trail: one `fleet.forgotten` event per member it forgot, written in
-- the statement that forgets it (src/durable/fleet.rs, forget_silent).
ALTER TYPE audit_kind ADD VALUE IF NOT EXISTS 'fleet.forgotten';

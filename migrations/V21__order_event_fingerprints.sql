-- Every order event written before V19 takes its fingerprint from its
-- token's row, which until V19 was never purged, so that a repeat of the
-- event is still told apart by fingerprint (422 `fingerprint_mismatch`)
-- once retention takes that row (docs/operations.md, "Orders' tokens").
-- One pass over the events whose token carries a fingerprint; each row is
-- written once (their count: the order events with a fingerprint).
UPDATE order_events e
   SET fingerprint = t.fingerprint
  FROM tokens t
 WHERE t.id = e.token_id AND e.fingerprint IS NULL AND t.fingerprint IS NOT NULL;

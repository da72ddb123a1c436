-- ttlab schema, version 15: a pool member whose hand-over failed is recorded as a pool event.
--
-- A claimed member whose agent could not be re-armed or given its new token is released from
-- the student (who gets the next member, or the cold path, in the same click) and failed; the
-- release writes a `handover_failed` event, which the admin page and the hit rate count.

ALTER TABLE pool_events DROP CONSTRAINT pool_events_kind_check;
ALTER TABLE pool_events ADD CONSTRAINT pool_events_kind_check
    CHECK (kind IN ('claim', 'miss', 'handover_failed'));

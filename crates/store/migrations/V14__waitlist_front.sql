-- ttlab schema, version 14: a start the namespace's quota refused at capacity goes back in
-- the line at the front.
--
-- A requeued entry (front) is served before every entry that joined normally; among
-- themselves, requeued entries keep their own enqueue order, as joiners do. The line is
-- ordered by (NOT front, enqueued_at, seq) everywhere a position is computed.

ALTER TABLE waitlist ADD COLUMN front boolean NOT NULL DEFAULT false;

DROP INDEX waitlist_order;
CREATE INDEX waitlist_order ON waitlist ((NOT front), enqueued_at, seq);

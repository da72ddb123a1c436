-- ttlab schema, version 16: a start the namespace's quota refused at capacity goes back in
-- the line at the front.
--
-- A requeued entry (front) is served before every entry that joined normally; among
-- themselves, requeued entries keep their own enqueue order, as joiners do. The line is
-- ordered by (NOT front, enqueued_at, seq) everywhere a position is computed.

ALTER TABLE waitlist ADD COLUMN front boolean NOT NULL DEFAULT false;

DROP INDEX waitlist_order;
CREATE INDEX waitlist_order ON waitlist ((NOT front), enqueued_at, seq);

-- A session whose start was refused at capacity ends `requeued` (its student is back in the
-- line), told apart from `failed`.
ALTER TABLE sessions DROP CONSTRAINT sessions_status_check;
ALTER TABLE sessions ADD CONSTRAINT sessions_status_check CHECK (status IN
    ('starting', 'running', 'finishing', 'expired', 'finished', 'failed', 'ghost', 'requeued'));
ALTER TABLE sessions DROP CONSTRAINT sessions_finishing_to_check;
ALTER TABLE sessions ADD CONSTRAINT sessions_finishing_to_check CHECK (finishing_to IN
    ('expired', 'finished', 'failed', 'requeued'));

-- Its agent tokens go with it, as with every final status.
DROP TRIGGER sessions_final_forgets_agent_tokens ON sessions;
CREATE TRIGGER sessions_final_forgets_agent_tokens
    AFTER UPDATE OF status ON sessions
    FOR EACH ROW
    WHEN (NEW.status IN ('expired', 'finished', 'failed', 'ghost', 'requeued'))
    EXECUTE FUNCTION agent_tokens_forget_final();

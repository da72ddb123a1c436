-- ttlab schema, version 8: what operators did to sessions.
--
-- An operator may end a student's session or extend it beyond the student's own extensions
-- (a student who lost time to a failure). Every such action is recorded here — who, when, to
-- which session, how much time it added and why — and shown on the admin page. The rows are
-- an audit trail: never updated, removed only with their session.

CREATE TABLE admin_actions (
    id              bigserial PRIMARY KEY,
    session_id      uuid        NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    admin           text        NOT NULL,
    action          text        NOT NULL CHECK (action IN ('end', 'extend')),
    at              timestamptz NOT NULL DEFAULT now(),
    reason          text        NOT NULL CHECK (length(reason) BETWEEN 1 AND 500),
    -- An extension: the expiry before and after, and the seconds it added.
    expires_before  timestamptz,
    expires_after   timestamptz,
    added_seconds   integer CHECK (added_seconds IS NULL OR added_seconds > 0),
    CHECK ((action = 'extend') = (added_seconds IS NOT NULL))
);

CREATE INDEX admin_actions_by_session ON admin_actions (session_id, at);
CREATE INDEX admin_actions_by_time ON admin_actions (at DESC);

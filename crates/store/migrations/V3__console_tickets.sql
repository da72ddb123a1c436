-- ttlab schema, version 3: one-time console tickets, shared by every server replica.
--
-- A browser cannot put its bearer token on a WebSocket request, so it trades the token for a
-- ticket (POST /api/sessions/{id}/console-ticket) and puts the ticket in the WebSocket's URL.
-- Behind a load balancer without sticky sessions the WebSocket may reach another replica than
-- the one that issued the ticket, so tickets live here rather than in one process's memory.
--
-- Only the SHA-256 digest of a ticket is stored, never the ticket: whoever reads this table
-- cannot open anyone's console. A ticket is taken by deleting its row (DELETE … RETURNING,
-- with expires_at compared to the database clock), so it works once, on any replica, and not
-- after it expired. Expired rows are purged whenever a ticket is issued.

CREATE TABLE console_tickets (
    -- SHA-256 of the ticket (32 bytes).
    digest      bytea       PRIMARY KEY CHECK (octet_length(digest) = 32),
    user_id     text        NOT NULL CHECK (length(user_id) BETWEEN 1 AND 256),
    session_id  uuid        NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    -- The node whose console the ticket opens; NULL: the node named when the WebSocket is
    -- opened (`?node=`), else the session's first.
    node        text        CHECK (length(node) BETWEEN 1 AND 63),
    issued_at   timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    CONSTRAINT console_tickets_expire_after_issue CHECK (expires_at > issued_at)
);

-- The purge of expired tickets.
CREATE INDEX console_tickets_expires_at ON console_tickets (expires_at);

-- ttlab schema, version 11: who holds each console.
--
-- One row per (session, node): the current or last console connection — the user who opened
-- it, the server replica relaying it, when it opened and closed (NULL while open) and why it
-- closed when that is known. Any replica may hold a console, so this is the one place an
-- operator learns who does. A newer connection to the same console replaces the row (a
-- takeover); a close applies only while the row is still that connection's.

CREATE TABLE console_connections (
    session_id    uuid        NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    node          text        NOT NULL CHECK (length(node) BETWEEN 1 AND 63),
    connection_id uuid        NOT NULL,
    user_id       text        NOT NULL CHECK (length(user_id) BETWEEN 1 AND 256),
    replica       text        NOT NULL CHECK (length(replica) BETWEEN 1 AND 256),
    opened_at     timestamptz NOT NULL DEFAULT now(),
    closed_at     timestamptz,
    closed_why    text CHECK (closed_why IN
                      ('browser_closed', 'taken_over', 'session_ended', 'lost')),
    PRIMARY KEY (session_id, node),
    CHECK (closed_why IS NULL OR closed_at IS NOT NULL)
);

-- ttlab schema, version 14: console rows of a server replica that is gone.
--
-- The replica relaying a console marks its open rows seen (`seen_at`) every few seconds. A
-- row left open by a replica that stopped doing so (it crashed, or was killed) is closed by
-- another replica with the reason `replica_gone`, so the admin's view does not show a console
-- held open by a server that no longer exists.

ALTER TABLE console_connections ADD COLUMN seen_at timestamptz NOT NULL DEFAULT now();

ALTER TABLE console_connections DROP CONSTRAINT console_connections_closed_why_check;
ALTER TABLE console_connections ADD CONSTRAINT console_connections_closed_why_check
    CHECK (closed_why IN ('browser_closed', 'taken_over', 'session_ended', 'lost', 'replica_gone'));

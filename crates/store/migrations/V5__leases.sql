-- ttlab schema, version 5: leases.
--
-- A lease is the right of one process (the holder) to act on one thing — being the reaper of
-- an environment, provisioning a session — until `expires_at`, on the database clock. The
-- holder renews it on a heartbeat; a process that vanishes (its node died, its connection is
-- half-open) stops renewing, and once `expires_at` has passed anyone may take the lease,
-- whatever the sockets do. Session advisory locks, which these replace, stayed held for as
-- long as PostgreSQL believed the holder's connection alive: about two hours for a half-open
-- one.
--
-- Every change is one conditional statement: take (if free or expired), renew (only by the
-- holder, only before expiry), release (only by the holder).

CREATE TABLE leases (
    kind        text        NOT NULL CHECK (kind IN ('reaper-leader', 'provisioning')),
    key         text        NOT NULL CHECK (key <> ''),
    holder      text        NOT NULL CHECK (holder <> ''),
    acquired_at timestamptz NOT NULL DEFAULT now(),
    renewed_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (kind, key),
    CHECK (expires_at >= renewed_at)
);

COMMENT ON TABLE leases IS
    'Who may act on what until when (database clock); renewed by heartbeat, taken over once expired.';

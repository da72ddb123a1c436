-- The waitlist: students waiting for a place when the VM limit is reached, one entry per
-- user, served in enqueue order. A freed place is held for the first waiting entry until
-- hold_until; only that user can take it meanwhile.
CREATE TABLE waitlist (
    user_id     text        PRIMARY KEY CHECK (length(user_id) BETWEEN 1 AND 256),
    lesson      text        NOT NULL CHECK (length(lesson) BETWEEN 1 AND 40),
    env         text        NOT NULL,
    needed      integer     NOT NULL CHECK (needed >= 1),
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    -- Ties of enqueued_at (one transaction's now()) are broken by insertion order.
    seq         bigserial   NOT NULL,
    hold_until  timestamptz
);

CREATE INDEX waitlist_order ON waitlist (enqueued_at, seq);

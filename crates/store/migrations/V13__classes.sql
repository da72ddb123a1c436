-- ttlab schema, version 13: scheduled classes, and which class a session was made for.
--
-- A class is a lesson, a number of seats and a window an operator booked in one environment;
-- the warm pool prepares members for it ahead of its start. A cancelled class keeps its row
-- (`cancelled_at`), so the sessions that name it keep their history. A join code, when set, is
-- what its students enter; it is shown to operators and compared by the server in constant
-- time, never looked up by value.
--
-- `sessions.class_id`: for an unclaimed pool member, the class it was prepared for (its
-- students claim it first, nobody else takes it from the lead-in to the class's end); for a
-- student's session, the class they started it in (from a member or cold), which is how the
-- seats already started are counted.

CREATE TABLE classes (
    id           uuid        PRIMARY KEY,
    env          text        NOT NULL CHECK (length(env) BETWEEN 1 AND 63),
    lesson       text        NOT NULL CHECK (length(lesson) BETWEEN 1 AND 40),
    title        text        NOT NULL CHECK (length(title) BETWEEN 1 AND 100),
    seats        integer     NOT NULL,
    starts_at    timestamptz NOT NULL,
    ends_at      timestamptz NOT NULL,
    join_code    text        CHECK (join_code IS NULL OR length(join_code) BETWEEN 4 AND 32),
    created_at   timestamptz NOT NULL DEFAULT now(),
    created_by   text        NOT NULL CHECK (length(created_by) BETWEEN 1 AND 256),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    updated_by   text        NOT NULL CHECK (length(updated_by) BETWEEN 1 AND 256),
    cancelled_at timestamptz,
    cancelled_by text        CHECK (length(cancelled_by) BETWEEN 1 AND 256),
    CONSTRAINT classes_seats CHECK (seats BETWEEN 1 AND 500),
    CONSTRAINT classes_window
        CHECK (starts_at < ends_at AND ends_at - starts_at <= interval '12 hours'),
    CONSTRAINT classes_cancelled CHECK ((cancelled_at IS NULL) = (cancelled_by IS NULL))
);

-- Upcoming and running classes of an environment (the planner's and the admin page's read).
CREATE INDEX classes_current ON classes (env, ends_at) WHERE cancelled_at IS NULL;

ALTER TABLE sessions ADD COLUMN class_id uuid REFERENCES classes (id);

-- A class's members and students.
CREATE INDEX sessions_by_class ON sessions (class_id) WHERE class_id IS NOT NULL;

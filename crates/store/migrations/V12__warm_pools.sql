-- ttlab schema, version 12: warm pools of prepared sessions, their settings and their history.
--
-- A pool member is a session row provisioned by the normal path (starting → running) but held
-- by no user: `pool_member` is true and `user_id` NULL until a student claims it, in one
-- statement that sets `user_id` and `claimed_at`. Everything that works on session rows (agent
-- tokens, the reaper's deadlines, ghosts, orphans, gone-confirmation) works on members too; an
-- unclaimed member's `expires_at` is its pool age limit. The one-live-per-user index ignores
-- NULLs, so unclaimed members never collide with each other.

ALTER TABLE sessions ALTER COLUMN user_id DROP NOT NULL;
ALTER TABLE sessions ADD COLUMN pool_member boolean NOT NULL DEFAULT false;
ALTER TABLE sessions ADD COLUMN claimed_at timestamptz;
ALTER TABLE sessions ADD CONSTRAINT sessions_holder
    CHECK (user_id IS NOT NULL OR (pool_member AND claimed_at IS NULL));
ALTER TABLE sessions ADD CONSTRAINT sessions_claimed_member
    CHECK (claimed_at IS NULL OR (pool_member AND user_id IS NOT NULL));

-- The claim: the oldest ready unclaimed member of a lesson in an environment.
CREATE INDEX sessions_pool_ready
    ON sessions (env, lesson, ready_at)
    WHERE pool_member AND claimed_at IS NULL AND status = 'running';
-- Pool counts: unclaimed live members, and members that became ready recently.
CREATE INDEX sessions_pool_members
    ON sessions (env, lesson, status)
    WHERE pool_member AND claimed_at IS NULL AND status IN ('starting', 'running', 'finishing');
CREATE INDEX sessions_pool_by_ready
    ON sessions (env, lesson, ready_at)
    WHERE pool_member AND ready_at IS NOT NULL;
-- Recent starts of a lesson (demand sizing): cold sessions by creation.
CREATE INDEX sessions_by_env_lesson_created
    ON sessions (env, lesson, created_at)
    WHERE NOT pool_member;
CREATE INDEX sessions_by_env_lesson_claimed
    ON sessions (env, lesson, claimed_at)
    WHERE claimed_at IS NOT NULL;

-- An operator's override of a lesson's pool settings (the lesson file gives the defaults;
-- deleting the row goes back to them).
CREATE TABLE lesson_pools (
    env             text        NOT NULL CHECK (length(env) BETWEEN 1 AND 63),
    lesson          text        NOT NULL CHECK (length(lesson) BETWEEN 1 AND 40),
    size            integer     NOT NULL,
    min_size        integer     NOT NULL,
    max_size        integer     NOT NULL,
    paused          boolean     NOT NULL DEFAULT false,
    max_age_seconds integer     NOT NULL,
    demand_driven   boolean     NOT NULL DEFAULT false,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    updated_by      text        NOT NULL CHECK (length(updated_by) BETWEEN 1 AND 256),
    PRIMARY KEY (env, lesson),
    CONSTRAINT lesson_pools_sizes
        CHECK (0 <= min_size AND min_size <= size AND size <= max_size AND max_size <= 200),
    CONSTRAINT lesson_pools_max_age
        CHECK (max_age_seconds BETWEEN 60 AND 604800)
);

-- Claims and misses of pools, for hit rates and metrics; rows older than 8 days are pruned
-- as new ones are written.
CREATE TABLE pool_events (
    id     bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    env    text        NOT NULL,
    lesson text        NOT NULL,
    kind   text        NOT NULL CHECK (kind IN ('claim', 'miss')),
    at     timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX pool_events_by_lesson ON pool_events (env, lesson, at);
CREATE INDEX pool_events_by_at ON pool_events (at);

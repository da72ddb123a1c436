-- ttlab schema, version 1: sessions, reaper cycle reports and "collect now" requests.
--
-- Statuses and other enumerations are stored as lowercase text guarded by CHECK constraints;
-- the Rust enums in ttlab-model are the single source of their spelling.

CREATE TABLE sessions (
    id                 uuid        PRIMARY KEY,
    user_id            text        NOT NULL CHECK (length(user_id) BETWEEN 1 AND 256),
    lesson             text        NOT NULL CHECK (length(lesson) BETWEEN 1 AND 40),
    runtime            text        NOT NULL CHECK (runtime IN ('vm', 'pod')),
    env                text        NOT NULL CHECK (length(env) BETWEEN 1 AND 63),
    status             text        NOT NULL CHECK (status IN
                           ('starting', 'running', 'finishing', 'expired', 'finished', 'failed', 'ghost')),
    -- The final status a finishing row is heading for; set exactly while finishing.
    finishing_to       text        CHECK (finishing_to IN ('expired', 'finished', 'failed')),

    -- Lifespan (computed by ttlab-lifespan from the database clock).
    started_at         timestamptz NOT NULL,
    expires_at         timestamptz NOT NULL,
    max_expires_at     timestamptz NOT NULL,
    extensions_used    integer     NOT NULL DEFAULT 0 CHECK (extensions_used >= 0),
    -- A starting row still not running at this instant is failed by the reaper.
    readiness_deadline timestamptz NOT NULL,

    -- Stage timestamps, database clock.
    created_at         timestamptz NOT NULL DEFAULT now(),
    vm_created_at      timestamptz,
    vmi_running_at     timestamptz,
    agent_up_at        timestamptz,
    ready_at           timestamptz,
    -- When the session stopped being usable (it entered finishing, or became a ghost).
    finished_at        timestamptz,
    -- When every cluster object of the session was confirmed deleted.
    reclaimed_at       timestamptz,

    -- Root disk decision (golden or container disk) and why.
    disk_kind          text        CHECK (disk_kind IN ('golden', 'container')),
    disk_reason        text,
    -- One entry per VM (or pod), node name and object name at the same index.
    node_names         text[]      NOT NULL DEFAULT '{}',
    vm_names           text[]      NOT NULL DEFAULT '{}',
    failure_reason     text,
    updated_at         timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT sessions_finishing_has_target
        CHECK ((status = 'finishing') = (finishing_to IS NOT NULL)),
    CONSTRAINT sessions_expiry_within_max
        CHECK (started_at <= expires_at AND expires_at <= max_expires_at),
    CONSTRAINT sessions_disk_kind_with_reason
        CHECK ((disk_kind IS NULL) = (disk_reason IS NULL)),
    CONSTRAINT sessions_vm_names_match_nodes
        CHECK (cardinality(node_names) = cardinality(vm_names))
);

-- One live session per user: a double click or two server replicas can never make two.
CREATE UNIQUE INDEX sessions_one_live_per_user
    ON sessions (user_id)
    WHERE status IN ('starting', 'running', 'finishing');

-- The reaper: running rows of an environment by expiry, starting rows by readiness deadline,
-- live rows of an environment (paged by id), and recent history for the admin screen.
CREATE INDEX sessions_running_by_expiry
    ON sessions (env, expires_at)
    WHERE status = 'running';
CREATE INDEX sessions_starting_by_deadline
    ON sessions (env, readiness_deadline)
    WHERE status = 'starting';
CREATE INDEX sessions_live_by_env
    ON sessions (env, status, id)
    WHERE status IN ('starting', 'running', 'finishing');
CREATE INDEX sessions_by_env_created
    ON sessions (env, created_at DESC);

CREATE TABLE reaper_cycles (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    env              text        NOT NULL,
    started_at       timestamptz NOT NULL,
    duration_ms      bigint      NOT NULL CHECK (duration_ms >= 0),
    trigger          text        NOT NULL CHECK (trigger IN ('startup', 'timer', 'wakeup', 'collect')),
    dry_run          boolean     NOT NULL DEFAULT false,
    expired_reclaimed integer    NOT NULL DEFAULT 0 CHECK (expired_reclaimed >= 0),
    expired_failed   integer     NOT NULL DEFAULT 0 CHECK (expired_failed >= 0),
    orphans_deleted  integer     NOT NULL DEFAULT 0 CHECK (orphans_deleted >= 0),
    orphans_failed   integer     NOT NULL DEFAULT 0 CHECK (orphans_failed >= 0),
    ghosts_marked    integer     NOT NULL DEFAULT 0 CHECK (ghosts_marked >= 0),
    ghosts_failed    integer     NOT NULL DEFAULT 0 CHECK (ghosts_failed >= 0),
    stuck_reclaimed  integer     NOT NULL DEFAULT 0 CHECK (stuck_reclaimed >= 0),
    stuck_failed     integer     NOT NULL DEFAULT 0 CHECK (stuck_failed >= 0),
    -- A bounded sample of the cycle's errors: [{"direction", "subject", "message"}].
    errors           jsonb       NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(errors) = 'array'),
    -- The "collect now" request that triggered the cycle, if any.
    collect_request_id bigint
);

CREATE INDEX reaper_cycles_by_env_started
    ON reaper_cycles (env, started_at DESC, id DESC);

CREATE TABLE collect_requests (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    env           text        NOT NULL,
    requested_at  timestamptz NOT NULL DEFAULT now(),
    requested_by  text        NOT NULL,
    answered_at   timestamptz,
    cycle_id      bigint      REFERENCES reaper_cycles (id),
    CONSTRAINT collect_requests_answer_complete
        CHECK ((answered_at IS NULL) = (cycle_id IS NULL))
);

CREATE INDEX collect_requests_pending
    ON collect_requests (env, id)
    WHERE answered_at IS NULL;

ALTER TABLE reaper_cycles
    ADD CONSTRAINT reaper_cycles_collect_request_fk
    FOREIGN KEY (collect_request_id) REFERENCES collect_requests (id);

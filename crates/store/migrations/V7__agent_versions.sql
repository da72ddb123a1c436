-- ttlab schema, version 7: the agent versions servers run.
--
-- The grading agent is delivered once per version, as a shared ConfigMap
-- `ttlab-agent-<digest prefix>` that every VM of that version mounts. A server records its
-- version here at start-up, while it runs and each time it makes sure the ConfigMap exists
-- (before it creates a VM referencing it). The reaper removes a version's ConfigMap only
-- when no VM references it AND no server has seen it for the minimum age; it checks and
-- deletes under the advisory lock a server takes to record the version, so a server about to
-- create a VM for that version either records first (the reaper then keeps it) or finds the
-- ConfigMap gone and creates it again.

CREATE TABLE agent_versions (
    env           text        NOT NULL,
    config_map    text        NOT NULL,
    sha256        text        NOT NULL,
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (env, config_map)
);

CREATE INDEX agent_versions_by_config_map ON agent_versions (config_map, last_seen_at);

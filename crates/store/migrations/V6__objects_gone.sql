-- ttlab schema, version 6: "deleted" means gone.
--
-- A deletion the API server accepted is not the end of an object: KubeVirt keeps a
-- VirtualMachine through its guest's shutdown grace (and for ever on a dead node), and any
-- finalizer holds an object. The reaper marks a finishing session final only once it has
-- looked again and found every object of it absent, and records when (`objects_gone_at`).
-- Until then the row stays `finishing` (live: it counts for one-per-user, and its VMs, still
-- listed, for capacity), and names what is still terminating and since when, for the admin
-- page and the operators.

ALTER TABLE sessions
    ADD COLUMN objects_gone_at timestamptz,
    ADD COLUMN terminating_objects text[] NOT NULL DEFAULT '{}',
    ADD COLUMN terminating_since timestamptz;

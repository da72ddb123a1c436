-- ttlab schema, version 4: the reaper reads an environment's live sessions by id.
--
-- Each cycle pages through the live (starting, running, finishing) rows of its environment in
-- id order (`env = $1 AND status = ANY(live) AND id > $after ORDER BY id LIMIT n`), to tell
-- live sessions from orphans and to find ghosts. `sessions_live_by_env` (env, status, id)
-- cannot give that order across three statuses, so the planner walked the primary key and
-- filtered out every finished row on the way: with 100,000 finished rows beside 10,000 live
-- ones a page took tens of milliseconds, and a cycle twenty pages. This index holds only the
-- live rows, in the order the pages are read.

CREATE INDEX sessions_live_by_env_id
    ON sessions (env, id)
    WHERE status IN ('starting', 'running', 'finishing');

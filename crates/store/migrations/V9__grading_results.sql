-- ttlab schema, version 9: every "Check my work" of a session, for the operators.
--
-- The admin page's session view lists a session's grading history: when the student checked,
-- how many checks passed, and which failed. One row per grading request; never updated,
-- removed only with its session.

CREATE TABLE grading_results (
    id          bigserial PRIMARY KEY,
    session_id  uuid        NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    at          timestamptz NOT NULL DEFAULT now(),
    passed      integer     NOT NULL CHECK (passed >= 0),
    total       integer     NOT NULL CHECK (total >= passed),
    -- The names of the checks that did not pass, in the lesson's order.
    failed      text[]      NOT NULL DEFAULT '{}'
);

CREATE INDEX grading_results_by_session ON grading_results (session_id, at);

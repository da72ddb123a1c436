-- ttlab schema, version 2: the guest agent token of every VM of a live session.
--
-- Each VM's agent accepts only its own token, 32 bytes from the server's CSPRNG, generated
-- when the VM is provisioned and written into its cloud-init Secret. The database keeps a
-- copy because the token cannot be derived again: any server replica (and a server restarted
-- after a crash) must be able to reach the agent to check readiness and to grade. Rows are
-- written before the VM's Secret is created and removed as soon as the session is final.
--
-- The tokens are secrets: no API view returns this table and nothing logs it. Whoever can
-- read it can talk to the agents of live sessions (the same reach as reading the cloud-init
-- Secrets in the VM namespace), so grant it only to the server's role.

CREATE TABLE agent_tokens (
    session_id  uuid        NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    -- No CHECK constraints: PostgreSQL puts the whole failing row (the token) in a CHECK
    -- violation's message. The values are typed before they get here (NodeName, AgentToken).
    node        text        NOT NULL,
    token       text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (session_id, node)
);

-- A final session's agents are gone (or going): forget their tokens at once, whoever (the
-- server or the reaper) moved the row.
CREATE FUNCTION agent_tokens_forget_final() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM agent_tokens WHERE session_id = NEW.id;
    RETURN NULL;
END;
$$;

CREATE TRIGGER sessions_final_forgets_agent_tokens
    AFTER UPDATE OF status ON sessions
    FOR EACH ROW
    WHEN (NEW.status IN ('expired', 'finished', 'failed', 'ghost'))
    EXECUTE FUNCTION agent_tokens_forget_final();

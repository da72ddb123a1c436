//! The guest grading agent: the wire protocol between the server and `ttlab-agent`, the
//! fixed paths the agent and cloud-init agree on, and (later in this crate) the token check,
//! the command runner and the typed client the server uses.
//!
//! The agent runs inside the student's VM and answers on TCP port [`protocol::PORT`]. Every
//! request carries `Authorization: Bearer <token>`; the token is written by cloud-init to
//! [`protocol::TOKEN_PATH`], readable only by root.

pub mod protocol;

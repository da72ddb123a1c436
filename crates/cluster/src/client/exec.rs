//! Pod exec with a TTY, for pod labs (kube-rs' `AttachedProcess` over the
//! `v5.channel.k8s.io` / `v4.channel.k8s.io` protocols).

use std::sync::Arc;

use bytes::Bytes;
use futures::{SinkExt as _, StreamExt, TryStreamExt, sink};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams, AttachedProcess};
use tokio::io::AsyncWriteExt;
use tokio_util::io::ReaderStream;

use crate::{ClusterError, Terminal, TtySize};

pub(super) async fn attach(
    api: &Api<Pod>,
    pod: &str,
    container: Option<&str>,
    command: Vec<String>,
) -> Result<AttachedProcess, kube::Error> {
    let mut params = AttachParams::interactive_tty();
    if let Some(container) = container {
        params = params.container(container);
    }
    api.exec(pod, command, &params).await
}

/// Both halves hold the process: it is aborted only when both are dropped.
pub(super) fn terminal(mut process: AttachedProcess) -> Result<Terminal, ClusterError> {
    let missing = |what: &str| ClusterError::Unexpected {
        message: format!("exec: the process has no {what}"),
    };
    let stdout = process.stdout().ok_or_else(|| missing("stdout"))?;
    let stdin = process.stdin().ok_or_else(|| missing("stdin"))?;
    let resize = process.terminal_size().map(|sizes| {
        let sink = sizes
            .sink_map_err(|e| ClusterError::Transient {
                message: format!("exec resize: {e}"),
            })
            .with(|size: TtySize| {
                futures::future::ready(Ok::<_, ClusterError>(kube::api::TerminalSize {
                    width: size.cols,
                    height: size.rows,
                }))
            });
        Box::pin(sink) as crate::ResizeSink
    });
    let process = Arc::new(process);

    let keep = Arc::clone(&process);
    let output = ReaderStream::new(stdout)
        .map_err(|e| ClusterError::Transient {
            message: format!("exec output: {e}"),
        })
        .map(move |item| {
            let _alive = &keep;
            item
        });

    let input = sink::unfold(
        (stdin, process),
        |(mut stdin, process), bytes: Bytes| async move {
            stdin
                .write_all(&bytes)
                .await
                .map_err(|e| ClusterError::Transient {
                    message: format!("exec input: {e}"),
                })?;
            Ok::<_, ClusterError>((stdin, process))
        },
    );
    Ok(Terminal {
        output: output.boxed(),
        input: Box::pin(input),
        resize,
    })
}

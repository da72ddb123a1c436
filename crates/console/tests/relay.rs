//! The relay over in-memory pipes: channels stand in for the browser's WebSocket and for the
//! VM's console, and time is paused wherever timing matters.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc;
use futures::future::BoxFuture;
use futures::{SinkExt as _, StreamExt as _};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use ttlab_console::{
    CloseFrame, CloseReason, Connected, ConsoleError, Controller, Frame, RelayConfig, RelayEnd,
    Upstream, controls, relay,
};

type Keys = mpsc::Receiver<Bytes>;
type Output = mpsc::Sender<Result<Bytes, mpsc::SendError>>;

/// The VM's side of one console connection, as the test sees it.
struct Console {
    /// What the relay typed.
    keys: Keys,
    /// What the VM prints.
    out: Output,
}

/// Scripted connection attempts; each successful one hands its [`Console`] to the test.
struct Scripted {
    attempts: Arc<Mutex<VecDeque<Result<(), ConsoleError>>>>,
    connected: mpsc::UnboundedSender<Console>,
    /// What [`Upstream::ended`] answers.
    on_end: CloseReason,
    /// Capacity of the console's output pipe.
    capacity: usize,
}

impl Upstream for Scripted {
    type Input = mpsc::Sender<Bytes>;
    type Output = mpsc::Receiver<Result<Bytes, mpsc::SendError>>;
    type Error = mpsc::SendError;

    fn connect(&mut self) -> Connected<'_, Self> {
        let next = self.attempts.lock().unwrap().pop_front().unwrap_or(Ok(()));
        let capacity = self.capacity;
        Box::pin(async move {
            next?;
            let (keys_tx, keys_rx) = mpsc::channel(0);
            let (out_tx, out_rx) = mpsc::channel(capacity);
            self.connected
                .unbounded_send(Console {
                    keys: keys_rx,
                    out: out_tx,
                })
                .unwrap();
            Ok((keys_tx, out_rx))
        })
    }

    fn ended(&mut self, _detail: String) -> BoxFuture<'_, CloseReason> {
        let reason = self.on_end.clone();
        Box::pin(async move { reason })
    }
}

/// The browser's side.
struct Browser {
    sees: mpsc::Receiver<Frame>,
    types: mpsc::Sender<Frame>,
}

impl Browser {
    /// The next frame, skipping pings.
    async fn next(&mut self) -> Option<Frame> {
        loop {
            match self.sees.next().await {
                Some(Frame::Ping(_)) => {}
                other => return other,
            }
        }
    }

    /// Terminal text received until (and including) a frame containing `needle`.
    async fn read_until(&mut self, needle: &str) -> String {
        let mut text = String::new();
        while !text.contains(needle) {
            match self.next().await {
                Some(Frame::Binary(b)) => text.push_str(&String::from_utf8_lossy(&b)),
                other => panic!("waiting for {needle:?} after {text:?}, got {other:?}"),
            }
        }
        text
    }

    /// Reads to the Close frame; returns the terminal text before it and the frame.
    async fn read_to_close(&mut self) -> (String, Option<CloseFrame>) {
        let mut text = String::new();
        loop {
            match self.next().await {
                Some(Frame::Binary(b)) => text.push_str(&String::from_utf8_lossy(&b)),
                Some(Frame::Close(close)) => return (text, close),
                other => panic!("expected a Close frame after {text:?}, got {other:?}"),
            }
        }
    }

    async fn type_bytes(&mut self, frame: Frame) {
        self.types.send(frame).await.unwrap();
    }
}

struct Harness {
    browser: Browser,
    consoles: mpsc::UnboundedReceiver<Console>,
    controller: Controller,
    relay: JoinHandle<RelayEnd>,
}

struct Setup {
    attempts: Vec<Result<(), ConsoleError>>,
    deadline: Option<Instant>,
    config: RelayConfig,
    on_end: CloseReason,
    to_browser_capacity: usize,
    output_capacity: usize,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            attempts: Vec::new(),
            deadline: None,
            config: RelayConfig::default(),
            on_end: CloseReason::ConsoleLost("gone".into()),
            to_browser_capacity: 16,
            output_capacity: 16,
        }
    }
}

fn start(setup: Setup) -> Harness {
    let (to_browser, sees) = mpsc::channel(setup.to_browser_capacity);
    let (types, from_browser) = mpsc::channel(16);
    let (connected, consoles) = mpsc::unbounded();
    let upstream = Scripted {
        attempts: Arc::new(Mutex::new(setup.attempts.into())),
        connected,
        on_end: setup.on_end,
        capacity: setup.output_capacity,
    };
    let (controller, controls) = controls(setup.deadline);
    let config = setup.config;
    let relay = tokio::spawn(async move {
        relay(
            to_browser,
            from_browser.map(Ok::<_, Infallible>),
            upstream,
            controls,
            config,
        )
        .await
    });
    Harness {
        browser: Browser { sees, types },
        consoles,
        controller,
        relay,
    }
}

fn not_ready(message: &str) -> Result<(), ConsoleError> {
    Err(ConsoleError::NotReady {
        message: message.into(),
    })
}

#[tokio::test]
async fn keystrokes_reach_the_vm_as_binary_whatever_the_browser_sends_and_output_comes_back() {
    let mut h = start(Setup::default());
    let mut console = h.consoles.next().await.unwrap();

    h.browser
        .type_bytes(Frame::Binary(Bytes::from_static(b"host")))
        .await;
    assert_eq!(
        console.keys.next().await.unwrap(),
        Bytes::from_static(b"host")
    );
    // KubeVirt drops text frames: the relay sends their bytes instead.
    h.browser.type_bytes(Frame::Text("name\r".into())).await;
    assert_eq!(
        console.keys.next().await.unwrap(),
        Bytes::from_static(b"name\r")
    );

    console
        .out
        .send(Ok(Bytes::from_static(b"lab-1\r\nroot@lab-1:~# ")))
        .await
        .unwrap();
    assert_eq!(
        h.browser.next().await,
        Some(Frame::Binary(Bytes::from_static(
            b"lab-1\r\nroot@lab-1:~# "
        )))
    );

    h.browser.type_bytes(Frame::Close(None)).await;
    let end = h.relay.await.unwrap();
    assert_eq!(end.reason, CloseReason::BrowserClosed);
    assert!(end.connected);
    assert_eq!(end.bytes_to_console, 9);
    assert_eq!(
        end.bytes_to_browser,
        b"lab-1\r\nroot@lab-1:~# ".len() as u64
    );
    // The console connection is closed when the browser leaves.
    assert_eq!(console.keys.next().await, None);
}

#[tokio::test]
async fn keystrokes_typed_before_a_console_that_opens_at_once_are_not_lost() {
    // The browser's first frame is already waiting when the relay opens the console; the
    // relay must not read (and drop) it while the connection attempt is also ready. Repeated,
    // because which of two ready branches is looked at first must not matter.
    for round in 0..64 {
        let mut h = start(Setup::default());
        h.browser.type_bytes(Frame::Text("hostname\r".into())).await;
        let mut console = h.consoles.next().await.unwrap();
        assert_eq!(
            console.keys.next().await,
            Some(Bytes::from_static(b"hostname\r")),
            "round {round}"
        );
        h.controller.close(CloseReason::Finished);
        assert_eq!(h.relay.await.unwrap().reason, CloseReason::Finished);
    }
}

#[tokio::test(start_paused = true)]
async fn a_booting_vm_is_retried_every_second_and_the_terminal_says_what_it_waits_for() {
    let started = Instant::now();
    let mut h = start(Setup {
        attempts: vec![
            not_ready("the VM is Scheduling"),
            not_ready("the VM is Scheduled"),
            not_ready("the VM is Scheduled"),
        ],
        config: RelayConfig {
            connected_message: Some("Connected to node main.".into()),
            ..RelayConfig::default()
        },
        ..Setup::default()
    });
    let text = h.browser.read_until("Connected to node main.").await;
    assert!(
        text.contains("Waiting for the VM's console: the VM is Scheduling"),
        "{text:?}"
    );
    assert!(text.contains("the VM is Scheduled\x1b[0m ."), "{text:?}");
    assert_eq!(started.elapsed(), Duration::from_secs(3));
    assert!(h.consoles.next().await.is_some());
    h.controller.close(CloseReason::Finished);
    assert_eq!(h.relay.await.unwrap().reason, CloseReason::Finished);
}

#[tokio::test(start_paused = true)]
async fn a_vm_that_never_boots_is_given_up_after_the_boot_wait() {
    let started = Instant::now();
    let mut h = start(Setup {
        attempts: (0..1000).map(|_| not_ready("the VM is Pending")).collect(),
        config: RelayConfig {
            boot_wait: Duration::from_secs(30),
            ..RelayConfig::default()
        },
        ..Setup::default()
    });
    let (text, close) = h.browser.read_to_close().await;
    let close = close.unwrap();
    assert_eq!(close.code, 4005);
    assert!(text.contains("still not ready after 30 s"), "{text:?}");
    assert!(started.elapsed() <= Duration::from_secs(30));
    let end = h.relay.await.unwrap();
    assert!(!end.connected);
    assert!(end.reason.may_reconnect());
}

#[tokio::test(start_paused = true)]
async fn a_stopped_vm_is_not_waited_for() {
    let mut h = start(Setup {
        attempts: vec![Err(ConsoleError::Stopped {
            message: "phase is Succeeded".into(),
        })],
        ..Setup::default()
    });
    let (text, close) = h.browser.read_to_close().await;
    assert_eq!(close.unwrap().code, 4004);
    assert!(text.contains("The VM has stopped."), "{text:?}");
    h.relay.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_console_closes_at_the_expiry_instant_and_follows_an_extension() {
    let started = Instant::now();
    let mut h = start(Setup {
        deadline: Some(started + Duration::from_secs(600)),
        ..Setup::default()
    });
    let _console = h.consoles.next().await.unwrap();
    // The browser keeps answering pings, as a real one does.
    let Harness {
        mut browser,
        controller,
        relay,
        ..
    } = h;
    let answered = tokio::spawn(async move {
        let mut text = String::new();
        loop {
            match browser.sees.next().await {
                Some(Frame::Ping(p)) => {
                    // The relay may stop reading just after its last ping: keep reading.
                    let _ = browser.types.send(Frame::Pong(p)).await;
                }
                Some(Frame::Binary(b)) => text.push_str(&String::from_utf8_lossy(&b)),
                Some(Frame::Close(close)) => return (text, close, Instant::now()),
                other => panic!("unexpected {other:?}"),
            }
        }
    });
    tokio::time::sleep(Duration::from_secs(300)).await;
    controller.set_deadline(Some(started + Duration::from_secs(1800)));
    let (text, close, at) = answered.await.unwrap();
    let end = relay.await.unwrap();
    assert_eq!(end.reason, CloseReason::Expired, "{text:?}");
    assert_eq!(at - started, Duration::from_secs(1800));
    let close = close.unwrap();
    assert_eq!(close.code, 4001);
    assert!(text.contains("Your lab session has expired."), "{text:?}");
}

#[tokio::test(start_paused = true)]
async fn a_console_opened_in_another_tab_closes_this_one_with_that_reason() {
    // The server orders the close, then KubeVirt drops the old connection: whichever the relay
    // notices first, the student reads the order's reason (not the upstream's guess). The
    // order in which the two are noticed varies, so the scene is played several times.
    for _ in 0..20 {
        let mut h = start(Setup {
            on_end: CloseReason::VmStopped,
            ..Setup::default()
        });
        let console = h.consoles.next().await.unwrap();
        h.controller.close(CloseReason::Replaced);
        drop(console);
        let (text, close) = h.browser.read_to_close().await;
        assert_eq!(close.unwrap().code, 4003);
        assert!(text.contains("opened in another tab"), "{text:?}");
        assert_eq!(h.relay.await.unwrap().reason, CloseReason::Replaced);
    }
}

#[tokio::test(start_paused = true)]
async fn a_takeover_announced_just_after_the_connection_dropped_still_wins() {
    // Another server replica opened the console: KubeVirt dropped this connection first, the
    // replica's announcement arrives half a second later. The student reads "another tab"
    // (the page does not reconnect and steal the console back), not "connection lost".
    let mut h = start(Setup::default());
    let console = h.consoles.next().await.unwrap();
    let dropped = Instant::now();
    drop(console);
    tokio::time::sleep(Duration::from_millis(500)).await;
    h.controller.close(CloseReason::Replaced);
    let (_, close) = h.browser.read_to_close().await;
    assert_eq!(close.unwrap().code, 4003);
    assert_eq!(h.relay.await.unwrap().reason, CloseReason::Replaced);
    assert_eq!(dropped.elapsed(), Duration::from_millis(500));

    // Without an announcement the connection is reported lost once the grace is over.
    let mut h = start(Setup::default());
    let console = h.consoles.next().await.unwrap();
    let dropped = Instant::now();
    drop(console);
    let (_, close) = h.browser.read_to_close().await;
    assert_eq!(close.unwrap().code, 4006);
    assert_eq!(dropped.elapsed(), RelayConfig::default().takeover_grace);
    h.relay.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_console_that_ends_by_itself_is_explained_by_the_upstream() {
    let mut h = start(Setup {
        on_end: CloseReason::VmStopped,
        ..Setup::default()
    });
    let mut console = h.consoles.next().await.unwrap();
    console
        .out
        .send(Ok(Bytes::from_static(b"reboot: Power down\r\n")))
        .await
        .unwrap();
    drop(console);
    let (text, close) = h.browser.read_to_close().await;
    // Output sent before the end is delivered before the reason.
    assert!(text.starts_with("reboot: Power down\r\n"), "{text:?}");
    assert!(text.contains("The VM has stopped."), "{text:?}");
    assert_eq!(close.unwrap().code, 4004);
    h.relay.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_browser_is_pinged_and_a_silent_one_is_dropped() {
    let started = Instant::now();
    let mut h = start(Setup::default());
    let _console = h.consoles.next().await.unwrap();
    assert_eq!(h.browser.sees.next().await, Some(Frame::Ping(Bytes::new())));
    assert_eq!(started.elapsed(), Duration::from_secs(20));
    // Never answered: dropped at the first ping after 60 s of silence.
    let end = h.relay.await.unwrap();
    assert_eq!(end.reason, CloseReason::BrowserUnresponsive);
    assert_eq!(started.elapsed(), Duration::from_secs(60));
}

#[tokio::test(start_paused = true)]
async fn a_browser_that_takes_nothing_holds_back_the_console_and_is_dropped_in_time() {
    let started = Instant::now();
    let mut h = start(Setup {
        // The browser's socket takes one frame and then nothing more.
        to_browser_capacity: 0,
        output_capacity: 4,
        config: RelayConfig {
            max_frame: 1024,
            ..RelayConfig::default()
        },
        ..Setup::default()
    });
    let mut console = h.consoles.next().await.unwrap();
    // The VM prints without pause; count what the relay accepts from it.
    let chunk = Bytes::from(vec![b'y'; 512]);
    let mut accepted = 0usize;
    loop {
        let sent =
            tokio::time::timeout(Duration::from_secs(1), console.out.send(Ok(chunk.clone()))).await;
        match sent {
            Ok(Ok(())) => accepted += chunk.len(),
            Ok(Err(_)) => break,
            Err(_) => break,
        }
    }
    // Bounded: the pipe's few chunks, one frame in the browser's socket, one being sent.
    assert!(accepted <= 12 * 512, "the relay took {accepted} bytes");
    let end = h.relay.await.unwrap();
    assert_eq!(end.reason, CloseReason::BrowserUnresponsive);
    // The 30 s write timeout, then at most the 2 s given to closing.
    assert!(
        started.elapsed() <= Duration::from_secs(32),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn waiting_output_is_coalesced_into_frames_no_larger_than_the_limit() {
    let mut h = start(Setup {
        output_capacity: 64,
        config: RelayConfig {
            max_frame: 4096,
            ..RelayConfig::default()
        },
        ..Setup::default()
    });
    let mut console = h.consoles.next().await.unwrap();
    // 40 chunks of 1000 bytes, all waiting before the relay reads them.
    for i in 0..40u8 {
        console
            .out
            .send(Ok(Bytes::from(vec![b'a' + (i % 26); 1000])))
            .await
            .unwrap();
    }
    let mut total = Vec::new();
    let mut frames = 0;
    while total.len() < 40_000 {
        match h.browser.next().await {
            Some(Frame::Binary(b)) => {
                assert!(b.len() <= 4096 + 1000, "frame of {} bytes", b.len());
                frames += 1;
                total.extend_from_slice(&b);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(frames < 40, "{frames} frames for 40 waiting chunks");
    let expected: Vec<u8> = (0..40u8)
        .flat_map(|i| vec![b'a' + (i % 26); 1000])
        .collect();
    assert_eq!(total, expected, "bytes arrive in order, none lost");
    h.controller.close(CloseReason::Finished);
    h.relay.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn keystrokes_typed_while_the_vm_boots_are_dropped_and_closing_the_tab_stops_the_wait() {
    let mut h = start(Setup {
        attempts: (0..100).map(|_| not_ready("the VM is Pending")).collect(),
        ..Setup::default()
    });
    h.browser
        .type_bytes(Frame::Binary(Bytes::from_static(b"ls\r")))
        .await;
    h.browser.read_until("Waiting").await;
    drop(h.browser);
    let end = h.relay.await.unwrap();
    assert_eq!(end.reason, CloseReason::BrowserClosed);
    assert!(!end.connected);
}

/// A browser socket that refuses everything, its close too (as a WebSocket whose connection
/// broke does).
struct BrokenSocket;

impl futures::Sink<Frame> for BrokenSocket {
    type Error = std::io::Error;

    fn poll_ready(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()))
    }

    fn start_send(self: std::pin::Pin<&mut Self>, _: Frame) -> Result<(), Self::Error> {
        Err(std::io::ErrorKind::BrokenPipe.into())
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()))
    }

    fn poll_close(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()))
    }
}

#[tokio::test]
async fn a_browser_socket_that_fails_every_send_and_its_close_ends_as_browser_closed() {
    let (connected, mut consoles) = mpsc::unbounded();
    let upstream = Scripted {
        attempts: Arc::new(Mutex::new(VecDeque::new())),
        connected,
        on_end: CloseReason::ConsoleLost("gone".into()),
        capacity: 16,
    };
    let (_types, from_browser) = mpsc::channel::<Frame>(16);
    let (_controller, controls) = controls(None);
    let relay = tokio::spawn(relay(
        BrokenSocket,
        from_browser.map(Ok::<_, Infallible>),
        upstream,
        controls,
        RelayConfig::default(),
    ));
    let mut console = consoles.next().await.unwrap();
    // Output for a browser that is gone: the send fails, and so does the close after it.
    console
        .out
        .send(Ok(Bytes::from_static(b"root@lab-1:~# ")))
        .await
        .unwrap();
    let end = relay
        .await
        .expect("the relay ends without a panic when the browser's socket fails twice");
    assert_eq!(end.reason, CloseReason::BrowserClosed);
    assert!(end.connected);
}

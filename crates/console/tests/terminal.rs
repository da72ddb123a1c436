//! What the student's terminal gets beyond the console's bytes: its size passed to the console,
//! a redraw on connecting, and the warnings before the deadline, written only at a safe point
//! of the output stream (a property test over random escape sequences split at random points).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc;
use futures::future::BoxFuture;
use futures::{SinkExt as _, StreamExt as _};
use proptest::prelude::*;
use tokio::time::Instant;
use ttlab_console::safe::Inserter;
use ttlab_console::{
    CloseReason, Connected, Frame, RelayConfig, TermSize, Upstream, controls, notice, relay,
};

// ---------------------------------------------------------------------------------------------
// The inserter, against a model of the stream as tokens

/// One unit of terminal output: inserting before or after it is safe, inside it is not.
#[derive(Debug, Clone)]
struct Token(Vec<u8>);

fn token() -> impl Strategy<Value = Token> {
    let params = proptest::collection::vec(prop_oneof![Just(b';'), b'0'..=b'9', Just(b'?')], 0..6);
    let text = proptest::collection::vec(prop_oneof![b'a'..=b'z', Just(b' ')], 1..10);
    prop_oneof![
        // one ASCII byte (every position in plain text is safe)
        prop_oneof![
            b'a'..=b'z',
            Just(b' '),
            Just(b'\r'),
            Just(b'\n'),
            Just(0x08u8)
        ]
        .prop_map(|b| Token(vec![b])),
        // a multi-byte UTF-8 character
        prop_oneof![Just('é'), Just('€'), Just('🙂'), Just('ß'), Just('語')].prop_map(|c| {
            let mut buf = [0u8; 4];
            Token(c.encode_utf8(&mut buf).as_bytes().to_vec())
        }),
        // CSI: ESC [ params final
        (params.clone(), 0x40u8..=0x7e).prop_map(|(p, f)| {
            let mut v = vec![0x1b, b'['];
            v.extend(p);
            v.push(f);
            Token(v)
        }),
        // OSC ended by BEL or by ST
        (text.clone(), any::<bool>()).prop_map(|(t, bel)| {
            let mut v = b"\x1b]0;".to_vec();
            v.extend(t);
            v.extend_from_slice(if bel { b"\x07" } else { b"\x1b\\" });
            Token(v)
        }),
        // DCS ended by ST
        text.prop_map(|t| {
            let mut v = b"\x1bP1$r".to_vec();
            v.extend(t);
            v.extend_from_slice(b"\x1b\\");
            Token(v)
        }),
        // two- and three-byte escapes
        prop::sample::select(vec![
            &b"\x1b7"[..],
            b"\x1b8",
            b"\x1b(B",
            b"\x1b)0",
            b"\x1bM"
        ])
        .prop_map(|b| Token(b.to_vec())),
    ]
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Whatever the output and however it is split, every line asked for lands at the first
    /// token boundary at or after the point where it was asked, and nothing else changes.
    #[test]
    fn lines_land_at_the_first_safe_point_and_nothing_else_changes(
        tokens in proptest::collection::vec(token(), 0..40),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..12),
        asks in proptest::collection::vec(any::<prop::sample::Index>(), 1..4),
    ) {
        let stream: Vec<u8> = tokens.iter().flat_map(|t| t.0.clone()).collect();
        let mut boundaries = vec![0usize];
        for t in &tokens {
            boundaries.push(boundaries.last().unwrap() + t.0.len());
        }
        // Chunks split at random byte offsets (inside sequences and characters too).
        let mut offsets: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
        offsets.push(0);
        offsets.push(stream.len());
        offsets.sort_unstable();
        offsets.dedup();
        let chunks: Vec<&[u8]> = offsets.windows(2).map(|w| &stream[w[0]..w[1]]).collect();
        // Lines asked for before chunk number k (k == chunks.len(): after the last).
        let mut asked_before: Vec<usize> = asks.iter().map(|i| i.index(chunks.len() + 1)).collect();
        asked_before.sort_unstable();

        let mut inserter = Inserter::new();
        let mut out = Vec::new();
        let mut expected = Vec::new();
        let mut line_no = 0;
        let mut offset = 0;
        for k in 0..=chunks.len() {
            while asked_before.first() == Some(&k) {
                asked_before.remove(0);
                let line = notice(&format!("line {line_no}"));
                let at = *boundaries.iter().find(|&&b| b >= offset).unwrap();
                expected.push((line.clone(), at));
                if let Some(now) = inserter.insert(line) {
                    out.extend_from_slice(&now);
                }
                line_no += 1;
            }
            if let Some(chunk) = chunks.get(k) {
                out.extend_from_slice(&inserter.output(Bytes::copy_from_slice(chunk)));
                offset += chunk.len();
            }
        }
        // Lines still waiting at the end were asked for after the last boundary: none, as the
        // stream of whole tokens ends at one.
        prop_assert!(!inserter.has_pending());
        // Each line stands at its expected place of the original stream (earlier lines, all
        // before it, shift it by their length).
        let mut removed = 0usize;
        let mut from = 0usize;
        for (line, at) in &expected {
            let pos = from + find(&out[from..], line).expect("every line is in the output");
            prop_assert_eq!(pos - removed, *at, "a line landed at {} of the stream", pos - removed);
            removed += line.len();
            from = pos + line.len();
        }
        let mut plain = out;
        for (line, _) in &expected {
            let pos = find(&plain, line).unwrap();
            plain.drain(pos..pos + line.len());
        }
        prop_assert_eq!(plain, stream);
    }
}

// ---------------------------------------------------------------------------------------------
// The relay, over in-memory pipes

/// A console that records what it is sized to and typed.
struct Recorded {
    sizes: Arc<Mutex<Vec<TermSize>>>,
    connected: mpsc::UnboundedSender<(mpsc::Receiver<Bytes>, Output)>,
    /// Connections refused (not ready) before one opens.
    refusals: usize,
}

type Output = mpsc::Sender<Result<Bytes, mpsc::SendError>>;

impl Upstream for Recorded {
    type Input = mpsc::Sender<Bytes>;
    type Output = mpsc::Receiver<Result<Bytes, mpsc::SendError>>;
    type Error = mpsc::SendError;

    fn connect(&mut self) -> Connected<'_, Self> {
        Box::pin(async move {
            if self.refusals > 0 {
                self.refusals -= 1;
                return Err(ttlab_console::ConsoleError::NotReady {
                    message: "the VM is starting".into(),
                });
            }
            let (keys_tx, keys_rx) = mpsc::channel(4);
            let (out_tx, out_rx) = mpsc::channel(4);
            self.connected.unbounded_send((keys_rx, out_tx)).unwrap();
            Ok((keys_tx, out_rx))
        })
    }

    fn ended(&mut self, detail: String) -> BoxFuture<'_, CloseReason> {
        Box::pin(async move { CloseReason::ConsoleLost(detail) })
    }

    fn resize(&mut self, size: TermSize) -> BoxFuture<'_, ()> {
        let sizes = Arc::clone(&self.sizes);
        Box::pin(async move {
            // An agent call takes a moment.
            tokio::time::sleep(Duration::from_millis(50)).await;
            sizes.lock().unwrap().push(size);
        })
    }
}

struct Harness {
    sees: mpsc::Receiver<Frame>,
    types: mpsc::Sender<Frame>,
    consoles: mpsc::UnboundedReceiver<(mpsc::Receiver<Bytes>, Output)>,
    sizes: Arc<Mutex<Vec<TermSize>>>,
    _controller: ttlab_console::Controller,
}

fn start(config: RelayConfig, deadline: Option<Instant>, refusals: usize) -> Harness {
    let (to_browser, sees) = mpsc::channel(16);
    let (types, from_browser) = mpsc::channel(16);
    let (connected, consoles) = mpsc::unbounded();
    let sizes = Arc::new(Mutex::new(Vec::new()));
    let upstream = Recorded {
        sizes: Arc::clone(&sizes),
        connected,
        refusals,
    };
    let (controller, controls) = controls(deadline);
    tokio::spawn(relay(
        to_browser,
        from_browser.map(Ok::<_, Infallible>),
        upstream,
        controls,
        config,
    ));
    Harness {
        sees,
        types,
        consoles,
        sizes,
        _controller: controller,
    }
}

fn resize(cols: u16, rows: u16) -> Frame {
    Frame::Text(format!(
        r#"{{"type":"resize","cols":{cols},"rows":{rows}}}"#
    ))
}

impl Harness {
    /// Terminal text until it contains `needle`.
    async fn read_until(&mut self, needle: &str) -> String {
        let mut text = String::new();
        while !text.contains(needle) {
            match self.sees.next().await {
                Some(Frame::Binary(b)) => text.push_str(&String::from_utf8_lossy(&b)),
                Some(Frame::Ping(_)) => {}
                other => panic!("waiting for {needle:?} after {text:?}, got {other:?}"),
            }
        }
        text
    }
}

#[tokio::test(start_paused = true)]
async fn the_page_size_reaches_the_console_is_never_typed_and_the_redraw_follows_it() {
    let config = RelayConfig {
        redraw: Some(Bytes::from_static(b"\x0c")),
        ..RelayConfig::default()
    };
    // The console is not ready for a second: the size the page sends meanwhile is kept.
    let mut h = start(config, None, 1);
    h.types.send(resize(100, 30)).await.unwrap();
    h.types
        .send(Frame::Binary(Bytes::from_static(b"dropped while booting")))
        .await
        .unwrap();
    let (mut keys, _out) = h.consoles.next().await.unwrap();
    // The first thing typed is the redraw, after the size was applied.
    assert_eq!(keys.next().await.unwrap(), Bytes::from_static(b"\x0c"));
    assert_eq!(
        *h.sizes.lock().unwrap(),
        vec![TermSize {
            cols: 100,
            rows: 30
        }]
    );
    // Later sizes follow; control messages are not typed, other text is.
    h.types.send(resize(132, 43)).await.unwrap();
    h.types
        .send(Frame::Text(r#"{"type":"resize","cols":0,"rows":9}"#.into()))
        .await
        .unwrap();
    h.types.send(Frame::Text("ls\r".into())).await.unwrap();
    assert_eq!(keys.next().await.unwrap(), Bytes::from_static(b"ls\r"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        h.sizes.lock().unwrap().last(),
        Some(&TermSize {
            cols: 132,
            rows: 43
        }),
        "an invalid size is dropped, the valid one applied"
    );
    assert_eq!(h.sizes.lock().unwrap().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn without_a_size_from_the_page_the_redraw_comes_after_a_moment() {
    let config = RelayConfig {
        redraw: Some(Bytes::from_static(b"\x0c")),
        redraw_wait: Duration::from_secs(1),
        ..RelayConfig::default()
    };
    let mut h = start(config, None, 0);
    let (mut keys, _out) = h.consoles.next().await.unwrap();
    let opened = Instant::now();
    assert_eq!(keys.next().await.unwrap(), Bytes::from_static(b"\x0c"));
    assert_eq!(opened.elapsed(), Duration::from_secs(1));
    assert!(h.sizes.lock().unwrap().is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_warnings_are_written_into_the_terminal_but_never_inside_an_escape_sequence() {
    let start_at = Instant::now();
    let deadline = start_at + Duration::from_secs(6 * 60);
    // (A browser that stays silent this long would be dropped otherwise.)
    let config = RelayConfig {
        browser_timeout: Duration::from_secs(3600),
        ..RelayConfig::default()
    };
    let mut h = start(config, Some(deadline), 0);
    let (_keys, mut out) = h.consoles.next().await.unwrap();
    out.send(Ok(Bytes::from_static(b"root@lab:~# ")))
        .await
        .unwrap();
    h.read_until("# ").await;

    // Just before the 5-minute mark the console is in the middle of a colour sequence.
    tokio::time::sleep_until(start_at + Duration::from_secs(59)).await;
    out.send(Ok(Bytes::from_static(b"ls\r\n\x1b[01;3")))
        .await
        .unwrap();
    h.read_until("\x1b[01;3").await;
    tokio::time::sleep_until(start_at + Duration::from_secs(61)).await;
    // Due, but held back: nothing arrives while the sequence is open.
    let held = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match h.sees.next().await {
                Some(Frame::Ping(_)) => {}
                other => return other,
            }
        }
    })
    .await;
    assert!(
        held.is_err(),
        "something was sent inside the sequence: {held:?}"
    );
    // The sequence ends in the next piece of output: the line comes right after it.
    out.send(Ok(Bytes::from_static(b"4mdir\x1b[0m\r\n")))
        .await
        .unwrap();
    let text = h.read_until("dir").await;
    assert!(
        text.starts_with("4m\r\n\x1b[1;33m[ttlab] 5 minutes left in this lab."),
        "{text:?}"
    );
    assert!(text.ends_with("\x1b[0m\r\ndir\x1b[0m\r\n"), "{text:?}");

    // At a quiet boundary, the 1-minute warning comes at its instant by itself.
    tokio::time::sleep_until(start_at + Duration::from_secs(5 * 60)).await;
    let text = h.read_until("1 minute left").await;
    assert!(
        text.contains("[ttlab] 1 minute left in this lab."),
        "{text:?}"
    );
    assert_eq!(Instant::now() - start_at, Duration::from_secs(5 * 60));
}

#[tokio::test(start_paused = true)]
async fn a_console_that_already_printed_is_not_redrawn_and_a_warning_waits_for_the_redraw() {
    let config = RelayConfig {
        redraw: Some(Bytes::from_static(b"\x0c")),
        ..RelayConfig::default()
    };
    // Printed at once (boot lines): no redraw; the size is still applied.
    let mut h = start(config.clone(), None, 0);
    let (mut keys, mut out) = h.consoles.next().await.unwrap();
    out.send(Ok(Bytes::from_static(
        b"lab-1 login: root (automatic login)\r\n# ",
    )))
    .await
    .unwrap();
    h.read_until("# ").await;
    h.types.send(resize(90, 33)).await.unwrap();
    h.types
        .send(Frame::Binary(Bytes::from_static(b"x")))
        .await
        .unwrap();
    assert_eq!(keys.next().await.unwrap(), Bytes::from_static(b"x"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        *h.sizes.lock().unwrap(),
        vec![TermSize { cols: 90, rows: 33 }]
    );

    // Silent, with 3 minutes left: redrawn first, and the warning only after the redraw
    // (which clears the screen) had its answer.
    let mut h = start(config, Some(Instant::now() + Duration::from_secs(180)), 0);
    let (mut keys, mut out) = h.consoles.next().await.unwrap();
    h.types.send(resize(80, 24)).await.unwrap();
    assert_eq!(keys.next().await.unwrap(), Bytes::from_static(b"\x0c"));
    out.send(Ok(Bytes::from_static(b"\x1b[H\x1b[2J# ")))
        .await
        .unwrap();
    let text = h.read_until("3 minutes left").await;
    let cleared = text.find("\x1b[2J").expect("the redraw's answer");
    let warned = text.find("3 minutes left").unwrap();
    assert!(cleared < warned, "{text:?}");
}

#[tokio::test(start_paused = true)]
async fn after_waiting_for_a_booting_console_keystrokes_flow_and_the_size_is_applied() {
    let config = RelayConfig {
        redraw: Some(Bytes::from_static(b"\x0c")),
        ..RelayConfig::default()
    };
    let mut h = start(config, Some(Instant::now() + Duration::from_secs(200)), 3);
    h.types.send(resize(90, 38)).await.unwrap();
    let (mut keys, mut out) = h.consoles.next().await.unwrap();
    out.send(Ok(Bytes::from_static(b"boot\r\nroot@vm:~# ")))
        .await
        .unwrap();
    h.read_until("4 minutes left").await;
    for key in [&b"w"[..], b"h", b"o", b"\r"] {
        h.types
            .send(Frame::Binary(Bytes::copy_from_slice(key)))
            .await
            .unwrap();
        assert_eq!(keys.next().await.unwrap(), Bytes::copy_from_slice(key));
    }
    assert_eq!(
        *h.sizes.lock().unwrap(),
        vec![TermSize { cols: 90, rows: 38 }]
    );
}

/// The next frame that is not a ping.
async fn next_frame(h: &mut Harness) -> Option<Frame> {
    loop {
        match h.sees.next().await {
            Some(Frame::Ping(_)) => {}
            other => return other,
        }
    }
}

#[tokio::test(start_paused = true)]
async fn the_page_is_told_when_the_console_opens_and_which_warnings_it_was_shown() {
    let config = RelayConfig {
        status: true,
        // The test's browser answers no pings.
        browser_timeout: Duration::from_secs(3600),
        ..RelayConfig::default()
    };
    // Not ready for two attempts: the page reads the waiting line, and only then that the
    // console is open.
    let start_at = Instant::now();
    let mut h = start(config.clone(), Some(start_at + Duration::from_secs(180)), 2);
    let mut waited = String::new();
    loop {
        match next_frame(&mut h).await {
            Some(Frame::Binary(b)) => waited.push_str(&String::from_utf8_lossy(&b)),
            Some(Frame::Text(t)) => {
                assert_eq!(t, r#"{"type":"connected"}"#, "after {waited:?}");
                break;
            }
            other => panic!("waiting for the console after {waited:?}, got {other:?}"),
        }
    }
    assert!(waited.contains("Waiting for"), "{waited:?}");
    assert!(Instant::now() - start_at >= Duration::from_secs(2));
    let (_keys, _out) = h.consoles.next().await.unwrap();
    // With 3 minutes left the 5-minute warning is written, the page told just before.
    assert_eq!(
        next_frame(&mut h).await,
        Some(Frame::Text(r#"{"type":"warned","leads":[300]}"#.into()))
    );
    h.read_until("3 minutes left").await;

    // A page that was shown it reconnects: not written again; the next one comes.
    let config = RelayConfig {
        warnings_given: vec![Duration::from_secs(300)],
        ..config
    };
    let start_at = Instant::now();
    let mut h = start(config, Some(start_at + Duration::from_secs(180)), 0);
    assert_eq!(
        next_frame(&mut h).await,
        Some(Frame::Text(r#"{"type":"connected"}"#.into()))
    );
    let (_keys, _out) = h.consoles.next().await.unwrap();
    assert_eq!(
        next_frame(&mut h).await,
        Some(Frame::Text(r#"{"type":"warned","leads":[60]}"#.into()))
    );
    assert_eq!(Instant::now() - start_at, Duration::from_secs(120));
    let text = h.read_until("left in this lab").await;
    assert!(text.contains("1 minute left"), "{text:?}");
    assert!(!text.contains("minutes left"), "{text:?}");
}

//! The console relay's frame handling: any sequence of browser frames, console output chunks,
//! console open results and close orders, on a paused clock.
//!
//! Oracles: the relay always ends; the console receives exactly the browser's binary and text
//! payloads, in order (a prefix of them, as many bytes as it reports); the browser receives
//! exactly the console's output, in order, in frames no larger than the configured maximum
//! plus one chunk; the Close frame's code is the reason's and its reason fits a Close frame;
//! the relay never sends text frames.

#![no_main]

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arbitrary::Arbitrary;
use bytes::Bytes;
use futures::channel::mpsc;
use futures::future::BoxFuture;
use futures::{StreamExt as _, stream};
use libfuzzer_sys::fuzz_target;
use ttlab_console::{
    CloseFrame, CloseReason, Connected, ConsoleError, Frame, MAX_CLOSE_REASON, RelayConfig,
    Upstream, controls, relay,
};

#[derive(Debug, Arbitrary)]
enum BrowserFrame {
    Binary(Vec<u8>),
    Text(String),
    Ping(Vec<u8>),
    Pong(Vec<u8>),
    Close(Option<(u16, String)>),
}

#[derive(Debug, Arbitrary)]
enum Attempt {
    NotReady(String),
    Stopped,
    Unavailable(String),
    Open,
}

#[derive(Debug, Arbitrary)]
enum Order {
    Finished,
    Replaced,
    Shutdown,
    Expire,
}

#[derive(Debug, Arbitrary)]
struct Input {
    browser: Vec<BrowserFrame>,
    /// After the scripted frames: whether the browser hangs up (else it stays silent).
    browser_leaves: bool,
    console: Vec<Vec<u8>>,
    /// After the scripted output: whether the console connection ends (else it stays open).
    console_ends: bool,
    attempts: Vec<Attempt>,
    /// A close order and when (ms after the start), if any.
    order: Option<(Order, u16)>,
    max_frame: u8,
}

struct Script {
    attempts: std::vec::IntoIter<Attempt>,
    console: Option<(Vec<Bytes>, bool)>,
    typed: Arc<Mutex<Vec<u8>>>,
    opened: Arc<Mutex<bool>>,
}

type Keys = Pin<Box<dyn futures::Sink<Bytes, Error = String> + Send>>;

impl Upstream for Script {
    type Input = Keys;
    type Output = stream::BoxStream<'static, Result<Bytes, String>>;
    type Error = String;

    fn connect(&mut self) -> Connected<'_, Self> {
        let attempt = self.attempts.next().unwrap_or(Attempt::Open);
        let result = match attempt {
            Attempt::NotReady(message) => Err(ConsoleError::NotReady { message }),
            Attempt::Stopped => Err(ConsoleError::Stopped {
                message: "stopped".into(),
            }),
            Attempt::Unavailable(message) => Err(ConsoleError::Unavailable { message }),
            Attempt::Open => {
                let (chunks, ends) = self.console.take().unwrap_or_default();
                let output = stream::iter(chunks.into_iter().map(Ok));
                let output: Self::Output = if ends {
                    output.boxed()
                } else {
                    output.chain(stream::pending()).boxed()
                };
                let input = futures::sink::unfold(
                    Arc::clone(&self.typed),
                    |typed, bytes: Bytes| async move {
                        typed.lock().unwrap().extend_from_slice(&bytes);
                        Ok::<_, String>(typed)
                    },
                );
                let input: Keys = Box::pin(input);
                Ok((input, output))
            }
        };
        let opened = Arc::clone(&self.opened);
        Box::pin(async move {
            // Only once the relay actually takes the open console.
            if result.is_ok() {
                *opened.lock().unwrap() = true;
            }
            result
        })
    }

    fn ended(&mut self, detail: String) -> BoxFuture<'_, CloseReason> {
        Box::pin(async move { CloseReason::ConsoleLost(detail) })
    }
}

fuzz_target!(|input: Input| {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(run(input));
});

async fn run(input: Input) {
    let max_frame = usize::from(input.max_frame).max(1) * 16;
    let config = RelayConfig {
        max_frame,
        ..RelayConfig::default()
    };
    // What the browser types, and where each frame starts (frames that arrive while the
    // console is still opening are dropped whole).
    let mut sent_by_browser: Vec<u8> = Vec::new();
    let mut boundaries = vec![0];
    for f in input
        .browser
        .iter()
        .take_while(|f| !matches!(f, BrowserFrame::Close(_)))
    {
        match f {
            BrowserFrame::Binary(b) => sent_by_browser.extend_from_slice(b),
            BrowserFrame::Text(t) => sent_by_browser.extend_from_slice(t.as_bytes()),
            _ => {}
        }
        boundaries.push(sent_by_browser.len());
    }
    let chunks: Vec<Bytes> = input
        .console
        .iter()
        .filter(|c| !c.is_empty())
        .map(|c| Bytes::from(c.clone()))
        .collect();
    let largest_chunk = chunks.iter().map(Bytes::len).max().unwrap_or(0);
    // ttlab's own lines (waiting, goodbye) quote the console's messages.
    let longest_message = input
        .attempts
        .iter()
        .map(|a| match a {
            Attempt::NotReady(m) | Attempt::Unavailable(m) => m.len(),
            _ => 0,
        })
        .max()
        .unwrap_or(0);
    let console_output: Vec<u8> = chunks.iter().flat_map(|c| c.to_vec()).collect();

    let frames: Vec<Result<Frame, Infallible>> = input
        .browser
        .into_iter()
        .map(|f| {
            Ok(match f {
                BrowserFrame::Binary(b) => Frame::Binary(b.into()),
                BrowserFrame::Text(t) => Frame::Text(t),
                BrowserFrame::Ping(b) => Frame::Ping(b.into()),
                BrowserFrame::Pong(b) => Frame::Pong(b.into()),
                BrowserFrame::Close(c) => {
                    Frame::Close(c.map(|(code, reason)| CloseFrame::new(code, &reason)))
                }
            })
        })
        .collect();
    let from_browser = stream::iter(frames);
    let from_browser: stream::BoxStream<'static, Result<Frame, Infallible>> =
        if input.browser_leaves {
            from_browser.boxed()
        } else {
            from_browser.chain(stream::pending()).boxed()
        };
    let (to_browser, mut browser_sees) = mpsc::unbounded::<Frame>();

    // The console's input: what it was typed, recorded.
    let typed = Arc::new(Mutex::new(Vec::new()));
    let opened = Arc::new(Mutex::new(false));
    let upstream = Script {
        attempts: input
            .attempts
            .into_iter()
            .take(8)
            .collect::<Vec<_>>()
            .into_iter(),
        console: Some((chunks, input.console_ends)),
        typed: Arc::clone(&typed),
        opened: Arc::clone(&opened),
    };
    let (controller, controls) = controls(Some(
        tokio::time::Instant::now() + Duration::from_secs(3600),
    ));
    if let Some((order, at)) = input.order {
        let controller = controller.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(u64::from(at))).await;
            match order {
                Order::Finished => controller.close(CloseReason::Finished),
                Order::Replaced => controller.close(CloseReason::Replaced),
                Order::Shutdown => controller.close(CloseReason::ServerShutdown),
                Order::Expire => controller.set_deadline(Some(tokio::time::Instant::now())),
            }
        });
    }
    let end = tokio::time::timeout(
        Duration::from_secs(3 * 3600),
        relay(to_browser, from_browser, upstream, controls, config),
    )
    .await
    .expect("the relay ends by itself (at the latest at the session deadline)");
    drop(controller);

    let mut seen = Vec::new();
    while let Some(frame) = browser_sees.next().await {
        seen.push(frame);
    }
    assert!(
        !seen.iter().any(|f| matches!(f, Frame::Text(_))),
        "the relay sent text"
    );

    // Keystrokes: what the browser sent from some frame on, in order, as many bytes as
    // reported.
    let typed = typed.lock().unwrap().clone();
    assert_eq!(typed.len() as u64, end.bytes_to_console);
    assert!(
        boundaries
            .iter()
            .any(|&at| sent_by_browser[at..].starts_with(&typed)),
        "the console got bytes the browser did not send, or out of order"
    );
    assert_eq!(end.connected, *opened.lock().unwrap());
    if !end.connected {
        assert_eq!(end.bytes_to_browser, 0);
        assert!(
            typed.is_empty(),
            "keystrokes reached a console that never opened"
        );
    }

    // Close frame: matches the reason, fits.
    if let Some(Frame::Close(close)) = seen.last() {
        let close = close.as_ref().expect("a close frame with a code");
        assert_eq!(close.code, end.reason.code());
        assert!(close.reason.len() <= MAX_CLOSE_REASON);
    }

    // Output: the console's bytes, in order, between the opening and the goodbye.
    if end.connected {
        let delivered = end.bytes_to_browser as usize;
        assert!(delivered <= console_output.len());
        let binaries: Vec<&Bytes> = seen
            .iter()
            .filter_map(|f| match f {
                Frame::Binary(b) => Some(b),
                _ => None,
            })
            .collect();
        let all: Vec<u8> = binaries.iter().flat_map(|b| b.to_vec()).collect();
        let want = &console_output[..delivered];
        assert!(
            all.windows(want.len().max(1)).any(|w| w == want) || want.is_empty(),
            "the console's output did not reach the browser intact"
        );
        for b in &binaries {
            assert!(
                b.len() <= max_frame + largest_chunk + longest_message + 256,
                "a frame of {} bytes",
                b.len()
            );
        }
    }
}

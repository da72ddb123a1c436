//! The simulated shell behind a pod's exec: a line discipline (echo
//! and line editing with a TTY, plain lines without), a bash-like prompt, a few builtins
//! (`hostname`, `whoami`, `id`, `pwd`, `uname`, `echo`, `true`, `false`, `stty size`,
//! `exit`), and `yes` / `seq N` for bulk output.
//!
//! The terminal only decides what to print; the exec handler carries the bytes.

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What runs: the shell's name decides how its messages read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A process started by exec: `exit` ends it (and the exec session). The name is the
    /// program's (`bash`, `sh`), used in error messages.
    Shell {
        /// Program name.
        name: String,
    },
}

/// Who the shell runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct User {
    /// User name; `None` for a uid without a passwd entry.
    pub name: Option<String>,
    /// Numeric uid (0 is root).
    pub uid: u32,
}

impl User {
    /// root.
    pub(crate) fn root() -> Self {
        Self {
            name: Some("root".into()),
            uid: 0,
        }
    }
}

/// What the terminal wants done after some input.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Bytes for standard output (with a TTY: the screen).
    Out(Vec<u8>),
    /// Bytes for standard error (with a TTY: the screen too).
    Err(Vec<u8>),
    /// Start bulk output: `count` numbered lines (`seq`), or `pattern` repeated until stopped
    /// (`yes`); then print `then` (the prompt) unless stopped.
    Bulk {
        /// Lines of `seq`, or `None` for `yes`.
        count: Option<u64>,
        /// The repeated text of `yes`.
        pattern: Vec<u8>,
        /// Printed once the output is complete.
        then: Vec<u8>,
    },
    /// Stop the running bulk output (Ctrl-C).
    StopBulk,
    /// The shell exits with this status.
    Exit(i32),
}

/// A simulated shell session.
#[derive(Debug)]
pub(crate) struct Terminal {
    hostname: String,
    user: User,
    kind: Kind,
    tty: bool,
    line: Vec<u8>,
    status: i32,
    size: Option<(u16, u16)>,
}

/// Programs an exec can start directly (not through a shell).
const PROGRAMS: [&str; 11] = [
    "hostname", "whoami", "id", "pwd", "uname", "echo", "true", "false", "yes", "seq", "stty",
];

/// Shells an exec can start (interactively, or with `-c SCRIPT`).
const SHELLS: [&str; 5] = ["bash", "sh", "ash", "dash", "zsh"];

/// What an exec'd command line is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Program {
    /// A shell reading commands from its standard input.
    Shell {
        /// Its name (`bash`).
        name: String,
    },
    /// A shell running `-c SCRIPT`.
    Script {
        /// Its name.
        name: String,
        /// The script.
        script: String,
    },
    /// One of [`PROGRAMS`] with its arguments.
    Command(Vec<String>),
    /// Nothing by that name exists in the simulated container.
    NotFound(String),
}

impl Program {
    /// Classifies an exec command line (`argv[0]` may be a path).
    pub(crate) fn parse(argv: &[String]) -> Self {
        let Some(first) = argv.first() else {
            return Self::NotFound(String::new());
        };
        let base = first.rsplit('/').next().unwrap_or(first).to_owned();
        if SHELLS.contains(&base.as_str()) {
            let mut rest = argv[1..].iter();
            while let Some(a) = rest.next() {
                if a == "-c" {
                    return Self::Script {
                        name: base,
                        script: rest.next().cloned().unwrap_or_default(),
                    };
                }
                if a.starts_with('-') && a.len() > 1 && a[1..].contains('c') && !a.starts_with("--")
                {
                    return Self::Script {
                        name: base,
                        script: rest.next().cloned().unwrap_or_default(),
                    };
                }
            }
            return Self::Shell { name: base };
        }
        if PROGRAMS.contains(&base.as_str()) {
            let mut v = vec![base];
            v.extend(argv[1..].iter().cloned());
            return Self::Command(v);
        }
        Self::NotFound(first.clone())
    }
}

impl Terminal {
    /// A shell (or single command) started by exec.
    pub(crate) fn new(hostname: &str, user: User, kind: Kind, tty: bool) -> Self {
        Self {
            hostname: hostname.to_owned(),
            user,
            kind,
            tty,
            line: Vec::new(),
            status: 0,
            size: None,
        }
    }

    /// Exit status of the last command.
    pub(crate) fn status(&self) -> i32 {
        self.status
    }

    /// The terminal was resized (`stty size` reports it).
    pub(crate) fn resize(&mut self, width: u16, height: u16) {
        self.size = Some((height, width));
    }

    fn home(&self) -> String {
        match (&self.user.name, self.user.uid) {
            (_, 0) => "/root".to_owned(),
            (Some(n), _) => format!("/home/{n}"),
            (None, _) => "/".to_owned(),
        }
    }

    /// The prompt (only shown with a TTY).
    pub(crate) fn prompt(&self) -> Vec<u8> {
        if !self.tty {
            return Vec::new();
        }
        let user = self.user.name.as_deref().unwrap_or("I have no name!");
        let sign = if self.user.uid == 0 { '#' } else { '$' };
        let dir = if self.user.name.is_some() || self.user.uid == 0 {
            "~"
        } else {
            "/"
        };
        format!("{user}@{}:{dir}{sign} ", self.hostname).into_bytes()
    }

    /// Line ends as the terminal shows them: a TTY turns `\n` into `\r\n`.
    fn text(&self, s: &str) -> Vec<u8> {
        if self.tty {
            s.replace('\n', "\r\n").into_bytes()
        } else {
            s.as_bytes().to_vec()
        }
    }

    fn shell_name(&self) -> &str {
        match &self.kind {
            Kind::Shell { name } => name,
        }
    }

    /// Runs one command (`argv[0]` a builtin name), without prompt. Sets the exit status.
    pub(crate) fn run(&mut self, argv: &[&str]) -> Vec<Action> {
        let cmd = argv.first().copied().unwrap_or("");
        let args = argv.get(1..).unwrap_or(&[]);
        let user = self.user.name.clone();
        let (out, err, status) = match cmd {
            "" => (String::new(), String::new(), self.status),
            "hostname" => (format!("{}\n", self.hostname), String::new(), 0),
            "whoami" => match user {
                Some(u) => (format!("{u}\n"), String::new(), 0),
                None => (
                    String::new(),
                    format!("whoami: cannot find name for user ID {}\n", self.user.uid),
                    1,
                ),
            },
            "id" => {
                let uid = self.user.uid;
                let text = match user {
                    Some(u) => format!("uid={uid}({u}) gid={uid}({u}) groups={uid}({u})\n"),
                    None => format!("uid={uid} gid={uid} groups={uid}\n"),
                };
                (text, String::new(), 0)
            }
            "pwd" => (format!("{}\n", self.home()), String::new(), 0),
            "uname" => {
                let text = if args.first() == Some(&"-a") {
                    format!(
                        "Linux {} 5.15.0-kube-sim #1 SMP x86_64 GNU/Linux\n",
                        self.hostname
                    )
                } else {
                    "Linux\n".to_owned()
                };
                (text, String::new(), 0)
            }
            "echo" => (format!("{}\n", args.join(" ")), String::new(), 0),
            "true" | "clear" => (String::new(), String::new(), 0),
            "false" => (String::new(), String::new(), 1),
            "stty" if args.first() == Some(&"size") => {
                if self.tty {
                    let (rows, cols) = self.size.unwrap_or((24, 80));
                    (format!("{rows} {cols}\n"), String::new(), 0)
                } else {
                    (
                        String::new(),
                        "stty: 'standard input': Inappropriate ioctl for device\n".to_owned(),
                        1,
                    )
                }
            }
            "stty" => (String::new(), String::new(), 0),
            "yes" => {
                let word = if args.is_empty() {
                    "y".to_owned()
                } else {
                    args.join(" ")
                };
                self.status = 0;
                return vec![Action::Bulk {
                    count: None,
                    pattern: self.text(&format!("{word}\n")),
                    then: self.prompt(),
                }];
            }
            "seq" => match args.last().and_then(|n| n.parse::<u64>().ok()) {
                Some(n) => {
                    self.status = 0;
                    return vec![Action::Bulk {
                        count: Some(n),
                        pattern: Vec::new(),
                        then: self.prompt(),
                    }];
                }
                None => (String::new(), "seq: missing operand\n".to_owned(), 1),
            },
            "exit" | "logout" => {
                let code = args
                    .first()
                    .and_then(|c| c.parse::<i32>().ok())
                    .map_or(self.status, |c| c & 0xff);
                return self.exit(code);
            }
            other => (
                String::new(),
                format!("{}: {other}: command not found\n", self.shell_name()),
                127,
            ),
        };
        self.status = status;
        let mut actions = Vec::new();
        if !out.is_empty() {
            actions.push(Action::Out(self.text(&out)));
        }
        if !err.is_empty() {
            actions.push(Action::Err(self.text(&err)));
        }
        actions
    }

    fn exit(&mut self, code: i32) -> Vec<Action> {
        self.status = code;
        vec![Action::Exit(code)]
    }

    /// Runs a typed line and shows the next prompt (unless the line started bulk output,
    /// which shows it when done, or exited).
    pub(crate) fn run_line(&mut self, line: &str) -> Vec<Action> {
        let mut actions = Vec::new();
        for part in line.split(';') {
            let argv: Vec<&str> = part.split_whitespace().collect();
            let more = self.run(&argv);
            let stop = more
                .iter()
                .any(|a| matches!(a, Action::Bulk { .. } | Action::Exit(_)));
            actions.extend(more);
            if stop {
                return actions;
            }
        }
        actions.push(Action::Out(self.prompt()));
        actions
    }

    /// Runs a `sh -c` script: commands separated by `;` or newlines, until one exits.
    pub(crate) fn run_script(&mut self, script: &str) -> Vec<Action> {
        let mut actions = Vec::new();
        for part in script.split(['\n', ';']) {
            let argv: Vec<&str> = part.split_whitespace().collect();
            if argv.is_empty() {
                continue;
            }
            let more = self.run(&argv);
            let end = more
                .iter()
                .any(|a| matches!(a, Action::Exit(_) | Action::Bulk { .. }));
            actions.extend(more);
            if end {
                break;
            }
        }
        actions
    }

    /// Feeds typed (or piped) bytes to the shell.
    pub(crate) fn input(&mut self, data: &[u8]) -> Vec<Action> {
        let mut actions = Vec::new();
        for &b in data {
            if !self.tty {
                // No line discipline: lines end with a newline, nothing is echoed.
                if b == b'\n' {
                    let line = String::from_utf8_lossy(&self.line).into_owned();
                    self.line.clear();
                    let argv: Vec<&str> = line.split_whitespace().collect();
                    let more = self.run(&argv);
                    let exited = more.iter().any(|a| matches!(a, Action::Exit(_)));
                    actions.extend(more);
                    if exited {
                        return actions;
                    }
                } else {
                    self.line.push(b);
                }
                continue;
            }
            match b {
                b'\r' | b'\n' => {
                    let line = String::from_utf8_lossy(&self.line).into_owned();
                    self.line.clear();
                    actions.push(Action::Out(b"\r\n".to_vec()));
                    let more = self.run_line(&line);
                    let exited = more.iter().any(|a| matches!(a, Action::Exit(_)));
                    actions.extend(more);
                    if exited {
                        return actions;
                    }
                }
                0x03 => {
                    self.line.clear();
                    self.status = 130;
                    actions.push(Action::StopBulk);
                    actions.push(Action::Out(b"^C\r\n".to_vec()));
                    actions.push(Action::Out(self.prompt()));
                }
                // Ctrl-L, as readline does: clear the screen, then the prompt and the line
                // being edited again (a reconnecting console sends it to redraw).
                0x0c => {
                    let mut out = b"\x1b[H\x1b[2J".to_vec();
                    out.extend(self.prompt());
                    out.extend_from_slice(&self.line);
                    actions.push(Action::Out(out));
                }
                0x7f | 0x08 if self.line.pop().is_some() => {
                    actions.push(Action::Out(b"\x08 \x08".to_vec()));
                }
                0x7f | 0x08 => {}
                0x04 if self.line.is_empty() => {
                    let status = self.status;
                    if matches!(self.kind, Kind::Shell { .. }) {
                        actions.push(Action::Out(b"exit\r\n".to_vec()));
                    }
                    let more = self.exit(status);
                    let exited = more.iter().any(|a| matches!(a, Action::Exit(_)));
                    actions.extend(more);
                    if exited {
                        return actions;
                    }
                }
                b if b >= 0x20 || b == b'\t' => {
                    self.line.push(b);
                    actions.push(Action::Out(vec![b]));
                }
                _ => {}
            }
        }
        actions
    }

    /// The end of standard input: the shell exits with the last status.
    pub(crate) fn end_of_input(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        if !self.tty && !self.line.is_empty() {
            let line = String::from_utf8_lossy(&self.line).into_owned();
            self.line.clear();
            let argv: Vec<&str> = line.split_whitespace().collect();
            actions.extend(self.run(&argv));
            if actions.iter().any(|a| matches!(a, Action::Exit(_))) {
                return actions;
            }
        }
        actions.push(Action::Exit(self.status));
        actions
    }

    /// Whether `seq` lines end with `\r\n`.
    pub(crate) fn crlf(&self) -> bool {
        self.tty
    }
}

/// `yes` (pattern, until stopped) or `seq N` (N numbered lines) in 16 KiB chunks, each
/// wrapped by `wrap` for the channel. Returns whether it ran to completion.
pub(crate) async fn bulk_output<T>(
    tx: &mpsc::Sender<T>,
    stop: &CancellationToken,
    count: Option<u64>,
    pattern: &[u8],
    crlf: bool,
    wrap: impl Fn(Bytes) -> T,
) -> bool {
    const CHUNK: usize = 16 * 1024;
    let end = if crlf { "\r\n" } else { "\n" };
    let mut next: u64 = 1;
    loop {
        let mut buf = Vec::with_capacity(CHUNK + 32);
        match count {
            None => {
                if pattern.is_empty() {
                    return true;
                }
                while buf.len() < CHUNK {
                    buf.extend_from_slice(pattern);
                }
            }
            Some(n) => {
                while buf.len() < CHUNK && next <= n {
                    buf.extend_from_slice(format!("{next}{end}").as_bytes());
                    next += 1;
                }
                if buf.is_empty() {
                    return true;
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return false,
            r = tx.send(wrap(Bytes::from(buf))) => if r.is_err() { return false },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn console() -> Terminal {
        Terminal::new(
            "lab-1",
            User::root(),
            Kind::Shell {
                name: "bash".into(),
            },
            true,
        )
    }

    fn text(actions: &[Action]) -> String {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Out(b) | Action::Err(b) => Some(String::from_utf8_lossy(b).into_owned()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn typed_lines_echo_and_run_builtins() {
        let mut t = console();
        assert_eq!(
            text(&t.input(b"hostname\r")),
            "hostname\r\nlab-1\r\nroot@lab-1:~# "
        );
        assert_eq!(
            text(&t.input(b"whoami\r")),
            "whoami\r\nroot\r\nroot@lab-1:~# "
        );
        assert!(text(&t.input(b"nope\r")).contains("bash: nope: command not found"));
        assert_eq!(t.status(), 127);
        assert_eq!(text(&t.input(b"ab\x7f")), "ab\x08 \x08");
    }

    #[test]
    fn ctrl_l_redraws_the_prompt_and_the_line_being_typed() {
        let mut t = console();
        assert_eq!(
            text(&t.input(b"who\x0c")),
            "who\x1b[H\x1b[2Jroot@lab-1:~# who"
        );
        assert_eq!(text(&t.input(b"ami\r")), "ami\r\nroot\r\nroot@lab-1:~# ");
    }

    #[test]
    fn stty_size_reports_the_size_set_on_the_console() {
        let mut t = console();
        assert_eq!(
            text(&t.input(b"stty size\r")),
            "stty size\r\n24 80\r\nroot@lab-1:~# "
        );
        t.resize(132, 43);
        assert_eq!(
            text(&t.input(b"stty size\r")),
            "stty size\r\n43 132\r\nroot@lab-1:~# "
        );
    }

    #[test]
    fn yes_starts_bulk_output_and_ctrl_c_stops_it() {
        let mut t = console();
        assert!(matches!(
            t.input(b"yes\r").last(),
            Some(Action::Bulk { count: None, pattern, .. }) if pattern == b"y\r\n"
        ));
        assert!(
            t.input(b"\x03")
                .iter()
                .any(|a| matches!(a, Action::StopBulk))
        );
    }

    #[test]
    fn a_shell_exits_with_the_last_status_or_the_one_given() {
        let mut s = Terminal::new(
            "pod-1",
            User::root(),
            Kind::Shell {
                name: "bash".into(),
            },
            true,
        );
        assert_eq!(s.input(b"false\r").last(), Some(&Action::Out(s.prompt())));
        assert_eq!(s.input(b"exit\r").last(), Some(&Action::Exit(1)));
        let mut s = Terminal::new(
            "pod-1",
            User::root(),
            Kind::Shell {
                name: "bash".into(),
            },
            true,
        );
        assert_eq!(s.input(b"exit 7\r").last(), Some(&Action::Exit(7)));
    }

    #[test]
    fn without_a_tty_nothing_is_echoed_and_lines_end_with_newline() {
        let mut s = Terminal::new(
            "pod-1",
            User::root(),
            Kind::Shell { name: "sh".into() },
            false,
        );
        assert_eq!(text(&s.input(b"hostname\nwhoa")), "pod-1\n");
        assert_eq!(text(&s.input(b"mi\n")), "root\n");
        assert_eq!(s.end_of_input(), vec![Action::Exit(0)]);
    }

    #[test]
    fn a_uid_without_a_name_is_shown_like_bash_does() {
        let mut s = Terminal::new(
            "pod-1",
            User {
                name: None,
                uid: 1000,
            },
            Kind::Shell {
                name: "bash".into(),
            },
            true,
        );
        assert_eq!(s.prompt(), b"I have no name!@pod-1:/$ ");
        assert!(text(&s.input(b"whoami\r")).contains("cannot find name for user ID 1000"));
        let mut s = Terminal::new(
            "pod-1",
            User {
                name: Some("student".into()),
                uid: 1000,
            },
            Kind::Shell {
                name: "bash".into(),
            },
            true,
        );
        assert_eq!(s.prompt(), b"student@pod-1:~$ ");
        assert!(text(&s.input(b"pwd\r")).contains("/home/student\r\n"));
    }

    #[test]
    fn exec_command_lines_are_classified() {
        let v = |s: &[&str]| s.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            Program::parse(&v(&["/bin/bash"])),
            Program::Shell {
                name: "bash".into()
            }
        );
        assert_eq!(
            Program::parse(&v(&["sh", "-c", "hostname; exit 3"])),
            Program::Script {
                name: "sh".into(),
                script: "hostname; exit 3".into()
            }
        );
        assert_eq!(
            Program::parse(&v(&["bash", "-lc", "id"])),
            Program::Script {
                name: "bash".into(),
                script: "id".into()
            }
        );
        assert_eq!(
            Program::parse(&v(&["/usr/bin/hostname"])),
            Program::Command(v(&["hostname"]))
        );
        assert_eq!(
            Program::parse(&v(&["nope", "x"])),
            Program::NotFound("nope".into())
        );
        let mut t = Terminal::new("p", User::root(), Kind::Shell { name: "sh".into() }, false);
        let actions = t.run_script("hostname; exit 3; hostname");
        assert_eq!(actions, vec![Action::Out(b"p\n".to_vec()), Action::Exit(3)]);
    }
}

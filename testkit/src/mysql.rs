//! Private MariaDB servers (Debian's `mariadb-server`): `mariadb-install-db`
//! into a temporary directory, then `mariadbd` on a free loopback port, with
//! the durable settings (`innodb_flush_log_at_trx_commit=1`), killable with
//! `SIGKILL` and restartable on the same data (InnoDB crash recovery).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::postgres::free_port;

/// The server options, at install and at every start.
const OPTIONS: [&str; 4] = [
    "--innodb-log-file-size=16M",
    "--innodb-buffer-pool-size=64M",
    "--innodb-flush-log-at-trx-commit=1",
    "--max-connections=500",
];

/// A private MariaDB server, stopped when dropped. Its `root` user has no
/// password and a database `test` exists.
#[derive(Debug)]
pub struct MariaDbServer {
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// The loopback port it listens on.
    pub port: u16,
}

fn server_binary() -> &'static str {
    if Path::new("/usr/sbin/mariadbd").exists() {
        "/usr/sbin/mariadbd"
    } else {
        "mariadbd"
    }
}

impl MariaDbServer {
    /// Installs a data directory and starts the server on it.
    pub fn start() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("dedupe-mariadb-")
            .tempdir()
            .expect("temp dir");
        let tmp = dir.path().join("tmp");
        std::fs::create_dir_all(&tmp).expect("tmp dir");
        // A tmpdir of its own: the bootstrap's temporary tables are named by
        // pid and thread in the shared one, and installs running at once
        // (tests in processes of their own) collided there.
        let out = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.path().join("data").display()))
            .arg(format!("--tmpdir={}", tmp.display()))
            .args([
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ])
            .args(OPTIONS)
            .output()
            .unwrap_or_else(|e| panic!("mariadb-install-db (Debian's mariadb-server): {e}"));
        assert!(
            out.status.success(),
            "mariadb-install-db failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut server = Self {
            dir,
            child: None,
            port: 0,
        };
        for _ in 0..5 {
            server.port = free_port();
            if server.try_start() {
                server.sql("CREATE DATABASE IF NOT EXISTS test");
                return server;
            }
        }
        panic!("mariadbd did not start:\n{}", server.log());
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }

    /// Starts `mariadbd` and waits until it answers (30 s at most).
    fn try_start(&mut self) -> bool {
        let child = Command::new(server_binary())
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.data().display()))
            .arg("--user=root")
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!(
                "--socket={}",
                self.dir.path().join("sock").display()
            ))
            .arg(format!(
                "--pid-file={}",
                self.dir.path().join("pid").display()
            ))
            .arg(format!(
                "--log-error={}",
                self.dir.path().join("error.log").display()
            ))
            .arg(format!(
                "--tmpdir={}",
                self.dir.path().join("tmp").display()
            ))
            .arg("--skip-name-resolve")
            .args(OPTIONS)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let Ok(mut child) = child else {
            return false;
        };
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(_)) = child.try_wait() {
                return false; // exited: the port was taken, or worse (see the log)
            }
            if self.answers() {
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    fn client(&self) -> Command {
        let mut cmd = Command::new("mariadb");
        cmd.args(["--no-defaults", "-h", "127.0.0.1", "-u", "root"])
            .arg(format!("-P{}", self.port))
            .arg("--protocol=tcp");
        cmd
    }

    fn answers(&self) -> bool {
        self.client()
            .args(["-e", "SELECT 1"])
            .output()
            .is_ok_and(|o| o.status.success())
    }

    /// Runs `sql` with the `mariadb` client as root, and answers what it
    /// printed (tab-separated, no column names).
    pub fn sql(&self, sql: &str) -> String {
        let out = self
            .client()
            .args(["-N", "-B", "-e", sql])
            .output()
            .expect("mariadb client");
        assert!(
            out.status.success(),
            "{sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Kills the server the hard way (`SIGKILL`, no shutdown): a machine
    /// losing power. [`restart`](Self::restart) then runs InnoDB's crash
    /// recovery, which with `innodb_flush_log_at_trx_commit=1` keeps every
    /// committed transaction.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops it cleanly (connections are cut).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }

    /// Starts it again after [`stop`](Self::stop) or [`kill`](Self::kill),
    /// on the same port and data.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart of a running server");
        assert!(
            self.try_start(),
            "mariadbd did not start again:\n{}",
            self.log()
        );
    }

    /// URL of a database on it.
    pub fn url(&self, db: &str) -> String {
        format!("mysql://root@127.0.0.1:{}/{db}", self.port)
    }
}

impl Drop for MariaDbServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The server tests use: `DEDUPE_TEST_MYSQL_URL`, or a private MariaDB
/// (kept alive by the returned guard), as the URL of its database `test`.
pub fn server() -> (Option<MariaDbServer>, String) {
    match std::env::var("DEDUPE_TEST_MYSQL_URL") {
        Ok(url) if !url.is_empty() => (None, url),
        _ => {
            let server = MariaDbServer::start();
            let url = server.url("test");
            (Some(server), url)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A committed row survives `SIGKILL` and the restart's crash recovery;
    /// the server answers again on the same port.
    #[test]
    fn committed_rows_survive_a_kill() {
        let mut server = MariaDbServer::start();
        server.sql("CREATE TABLE test.t (k INT PRIMARY KEY) ENGINE=InnoDB");
        server.sql("INSERT INTO test.t VALUES (1), (2)");
        server.kill();
        assert!(!server.answers(), "a killed server answered");
        server.restart();
        assert_eq!(server.sql("SELECT count(*) FROM test.t").trim(), "2");
        server.stop();
        server.restart();
        assert!(server.sql("SELECT version()").contains("MariaDB"));
    }
}

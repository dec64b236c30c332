//! A private PostgreSQL server per test process, owned by the test: a data
//! directory in a temp dir on tmpfs where there is one (a copy of one `initdb`
//! made once per machine), `pg_ctl start` on a free loopback port (fsync on),
//! stop and start again on demand, and stopped when dropped. As root, the server
//! runs as the `postgres` user (Postgres refuses root).
//!
//! When `DEDUPE_TEST_POSTGRES_URL` is set, tests use that server instead; every
//! fixture still gets a schema of its own, so runs never collide.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Finds the directory of `initdb` and `pg_ctl`: `DEDUPE_PG_BIN`, then
/// `pg_config --bindir`, then the newest `/usr/lib/postgresql/*/bin`.
fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("DEDUPE_PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    candidates.retain(|p| p.join("initdb").exists());
    candidates.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    if let Some(newest) = candidates.pop() {
        return newest;
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return dir;
        }
    }
    panic!("no PostgreSQL server binaries found: install PostgreSQL or set DEDUPE_PG_BIN");
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet).
fn dead(pid: &str) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // "pid (comm) S ...": the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// Where data directories go: tmpfs (`/dev/shm`) where the machine has it,
/// else `/tmp` as root (the postgres user must reach it, and a `TMPDIR` may sit
/// under `/root`), else the temp dir.
///
/// Why tmpfs: on this VM's disk, copying the template's thousand files costs
/// 0.5-1.2 s of kernel time and removing them more, against 0.08 s on tmpfs,
/// for each of about a hundred clusters. What the tests prove holds there as
/// on a disk: the server still writes and syncs its WAL before a commit
/// returns, and a killed server (the crash tests) finds everything it had
/// written when it starts again, since a process's death loses nothing the
/// kernel holds. Only a power cut would tell them apart, and no test here cuts
/// the power. Timing is not what these tests measure (the benchmark does).
fn data_parent(as_postgres: bool) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let writable = shm.is_dir()
        && tempfile::Builder::new()
            .prefix("dedupe-pg-probe-")
            .tempdir_in(shm)
            .is_ok();
    if writable {
        shm.to_path_buf()
    } else if as_postgres {
        PathBuf::from("/tmp")
    } else {
        std::env::temp_dir()
    }
}

/// The `initdb` arguments (before `-D`). The template's name is made from
/// them, so no cluster copies a template made with other ones.
const INITDB_ARGS: [&str; 7] = ["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C"];

fn chown_to_postgres(dir: &Path) {
    let ok = Command::new("chown")
        .arg("postgres:")
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "could not hand {} to the postgres user", dir.display());
}

/// A private PostgreSQL cluster, stopped when dropped.
#[derive(Debug)]
pub struct PgCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    as_postgres: bool,
    /// The loopback port it listens on.
    pub port: u16,
}

impl PgCluster {
    fn command(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        if self.as_postgres {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(path);
            cmd
        } else {
            Command::new(path)
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    fn run(&self, mut cmd: Command, what: &str) {
        let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            out.status.success(),
            "{what} failed: {}{}\nserver log:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
    }

    /// Makes a data directory (a copy of this machine's template, see
    /// `template`) and starts the server on it.
    pub fn start() -> Self {
        let as_postgres = is_root();
        let base = data_parent(as_postgres);
        let dir = tempfile::Builder::new()
            .prefix("dedupe-pg-")
            .tempdir_in(&base)
            .expect("temp dir");
        if as_postgres {
            chown_to_postgres(dir.path());
        }
        let mut cluster = Self {
            dir,
            bin: bin_dir(),
            as_postgres,
            port: 0,
        };
        match cluster.template(&base) {
            Some(template) => {
                // `cp -a` keeps the owner (the postgres user) and the modes.
                let mut copy = Command::new("cp");
                copy.arg("-a").arg(template).arg(cluster.data());
                cluster.run(copy, "copying the template data directory");
            }
            None => cluster.initdb(&cluster.data()),
        }
        for _ in 0..5 {
            cluster.port = free_port();
            if cluster.try_start() {
                return cluster;
            }
        }
        panic!("postgres did not start:\n{}", cluster.log());
    }

    fn initdb(&self, data: &Path) {
        let mut initdb = self.command("initdb");
        initdb.args(INITDB_ARGS).arg("-D").arg(data);
        self.run(initdb, "initdb");
    }

    /// A data directory `initdb` made once on this machine for these server
    /// binaries, which each cluster copies: `initdb` takes a second here and
    /// the copy a tenth of one, and the gate starts a cluster for each of
    /// about a hundred tests. Made in a staging directory and renamed into
    /// place, so a process sees either the whole template or none; when two
    /// make it at once, the first rename wins and the other drops its own.
    /// `None` (make the cluster with its own `initdb`) when it cannot be had.
    fn template(&self, base: &Path) -> Option<PathBuf> {
        let name: String = format!("{} {}", self.bin.display(), INITDB_ARGS.join(" "))
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let dir = base.join(format!("dedupe-pg-template-{name}"));
        let data = dir.join("data");
        if data.join("PG_VERSION").exists() {
            return Some(data);
        }
        let staging = tempfile::Builder::new()
            .prefix("dedupe-pg-template-staging-")
            .tempdir_in(base)
            .ok()?;
        if self.as_postgres {
            chown_to_postgres(staging.path());
        }
        self.initdb(&staging.path().join("data"));
        if std::fs::rename(staging.path(), &dir).is_err() && !data.join("PG_VERSION").exists() {
            return None;
        }
        // Renamed: the staging directory is the template now (dropping it
        // finds nothing to remove). Not renamed: another process's is, and
        // dropping it removes ours.
        drop(staging);
        Some(data)
    }

    fn try_start(&self) -> bool {
        let mut cmd = self.command("pg_ctl");
        cmd.arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.path().join("server.log"))
            .arg("-o")
            .arg(format!(
                "-p {} -c listen_addresses=127.0.0.1 -k {} -c max_connections=300 -c fsync=on",
                self.port,
                self.dir.path().display()
            ))
            .args(["-w", "-t", "30", "start"]);
        cmd.output().is_ok_and(|o| o.status.success())
    }

    /// Starts it again after [`stop`](Self::stop), on the same port and data.
    pub fn restart(&self) {
        assert!(
            self.try_start(),
            "postgres did not start again:\n{}",
            self.log()
        );
    }

    /// Stops it (fast shutdown: connections are cut).
    pub fn stop(&self) {
        let mut cmd = self.command("pg_ctl");
        cmd.arg("-D")
            .arg(self.data())
            .args(["-m", "fast", "-w", "stop"]);
        self.run(cmd, "pg_ctl stop");
    }

    /// Kills the server the hard way (`SIGKILL` to the postmaster and every
    /// backend, no shutdown checkpoint): a machine losing power. [`restart`]
    /// then runs crash recovery from the WAL, which with `fsync=on` keeps every
    /// committed transaction.
    ///
    /// [`restart`]: Self::restart
    pub fn kill(&self) {
        let pid_file = self.data().join("postmaster.pid");
        let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.lines().next().map(str::trim).map(str::to_string))
        else {
            panic!("no postmaster.pid: is the server running?");
        };
        // Stop the postmaster first (so it cannot fork more), then its children.
        let _ = Command::new("kill").args(["-STOP", &pid]).status();
        let _ = Command::new("pkill").args(["-KILL", "-P", &pid]).status();
        let _ = Command::new("kill").args(["-KILL", &pid]).status();
        let gone = (0..500).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            dead(&pid)
                && Command::new("pgrep")
                    .args(["-P", &pid])
                    .output()
                    .is_ok_and(|o| o.stdout.is_empty())
        });
        assert!(gone, "postmaster {pid} did not die");
        // Its pid may linger as a zombie nobody reaps (no init in a
        // container), which the next postmaster would take for a live one.
        let _ = std::fs::remove_file(&pid_file);
        let _ = std::fs::remove_file(self.dir.path().join(format!(".s.PGSQL.{}.lock", self.port)));
    }

    /// URL of a database on it.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let mut cmd = self.command("pg_ctl");
        cmd.arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"]);
        let _ = cmd.output();
    }
}

/// The server tests use: `DEDUPE_TEST_POSTGRES_URL`, or a private cluster (kept
/// alive by the returned guard).
pub fn server() -> (Option<PgCluster>, String) {
    match std::env::var("DEDUPE_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => (None, url),
        _ => {
            let cluster = PgCluster::start();
            let url = cluster.url("postgres");
            (Some(cluster), url)
        }
    }
}

/// A schema name no other fixture, test or run uses.
pub fn unique_schema(label: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "dedupe_{label}_{}_{}_{}",
        std::process::id(),
        nanos % 1_000_000_000,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

//! The worker processes of the cross-process runs (races, crashes, deploys,
//! poison items), both sides of them.
//!
//! The parent starts copies of the current test binary, each running one
//! ignored child test with [`DIR_VAR`] (the run's folder) and [`INDEX_VAR`]
//! (its number) set, and the run's own settings beside them. A child appends
//! to its own [`Log`] in the folder, one line per `write`, so a kill loses at
//! most the line being written; the parent judges the logs when the children
//! are gone. A [`Children`] kills whatever still runs and removes the folder
//! when it is dropped, so a run that ends early leaves nothing behind.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::harness::Failure;

/// The run's folder, shared by the parent and its children.
const DIR_VAR: &str = "DEDUPE_CHILD_DIR";
/// The child's number, from 0 in the order the parent started them.
const INDEX_VAR: &str = "DEDUPE_CHILD_INDEX";

/// The parent's side: the live children of one run and the folder they
/// share.
pub(crate) struct Children {
    dir: PathBuf,
    exe: PathBuf,
    child_test: String,
    env: Vec<(String, String)>,
    next: usize,
    /// The children still running (or exited and not yet collected), with
    /// their numbers.
    pub(crate) live: Vec<(usize, Child)>,
}

impl Children {
    /// A new run called `run` (the folder's name) whose children run the
    /// ignored test `child_test` with `env` set.
    pub(crate) fn new(
        run: &str,
        child_test: &str,
        env: &[(&str, String)],
    ) -> Result<Self, Failure> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let dir = std::env::temp_dir().join(format!("dedupe-{run}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| Failure::new(format!("{run} dir: {e}")))?;
        let exe = std::env::current_exe().map_err(|e| Failure::new(format!("test binary: {e}")))?;
        Ok(Self {
            dir,
            exe,
            child_test: child_test.to_string(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            next: 0,
            live: Vec::new(),
        })
    }

    /// The run's folder.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts the next child with `vars` set beside the run's own; its
    /// stdout and stderr go to files in the folder. Answers its number.
    pub(crate) fn spawn(&mut self, vars: &[(&str, String)]) -> Result<usize, Failure> {
        let index = self.next;
        self.next += 1;
        let file = |name: String| {
            std::fs::File::create(self.dir.join(name))
                .map(Stdio::from)
                .map_err(|e| Failure::new(format!("child {index}'s output: {e}")))
        };
        let mut cmd = Command::new(&self.exe);
        cmd.args([
            "--ignored",
            "--exact",
            &self.child_test,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(DIR_VAR, &self.dir)
        .env(INDEX_VAR, index.to_string())
        .stdout(file(format!("stdout-{index}"))?)
        .stderr(file(format!("stderr-{index}"))?);
        for (k, v) in self.env.iter().map(|(k, v)| (k.as_str(), v)) {
            cmd.env(k, v);
        }
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .map_err(|e| Failure::new(format!("spawn child {index}: {e}")))?;
        self.live.push((index, child));
        Ok(index)
    }

    /// What child `index` printed on stdout.
    pub(crate) fn stdout(&self, index: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("stdout-{index}"))).unwrap_or_default()
    }

    /// What child `index` printed on stderr.
    pub(crate) fn stderr(&self, index: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("stderr-{index}"))).unwrap_or_default()
    }

    /// Child `index`'s log as it stands (empty before its first line).
    pub(crate) fn log(&self, index: usize) -> String {
        std::fs::read_to_string(log_path(&self.dir, index)).unwrap_or_default()
    }

    /// Every log in the folder, with its child's number.
    pub(crate) fn logs(&self) -> Result<Vec<(usize, String)>, Failure> {
        let entries =
            std::fs::read_dir(&self.dir).map_err(|e| Failure::new(format!("run dir: {e}")))?;
        let mut logs = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(index) = name
                .strip_prefix("worker-")
                .and_then(|n| n.strip_suffix(".log"))
                .and_then(|n| n.parse::<usize>().ok())
            else {
                continue;
            };
            let log = std::fs::read_to_string(entry.path())
                .map_err(|e| Failure::new(format!("log {name}: {e}")))?;
            logs.push((index, log));
        }
        Ok(logs)
    }

    /// Takes the children that exited out of [`live`](Self::live) and
    /// answers them with how they ended.
    pub(crate) fn exited(&mut self) -> Result<Vec<(usize, ExitStatus)>, Failure> {
        let mut ended = Vec::new();
        let mut still = Vec::with_capacity(self.live.len());
        let mut failure = None;
        for (index, mut child) in self.live.drain(..) {
            match child.try_wait() {
                Ok(None) => still.push((index, child)),
                Ok(Some(status)) => ended.push((index, status)),
                Err(e) => failure = Some(Failure::new(format!("child {index}: {e}"))),
            }
        }
        self.live = still;
        failure.map_or(Ok(ended), Err)
    }

    /// [`exited`](Self::exited), where any child that did not exit with
    /// success fails the run with its stderr.
    pub(crate) fn reap(&mut self) -> Result<(), Failure> {
        match self.exited()?.into_iter().find(|(_, s)| !s.success()) {
            None => Ok(()),
            Some((index, status)) => Err(Failure::new(format!(
                "child {index} failed ({status}):\n{}",
                self.stderr(index)
            ))),
        }
    }

    /// Kills (SIGKILL) the live child at position `at` and waits for it;
    /// answers its number.
    pub(crate) fn kill(&mut self, at: usize) -> usize {
        let (index, mut child) = self.live.swap_remove(at);
        let _ = child.kill();
        let _ = child.wait();
        index
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.live {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn log_path(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("worker-{index}.log"))
}

/// The child's side: a setting the parent passed (`name` from the run's
/// own settings). Panics when the child is not run by its parent.
pub(crate) fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run by the parent test"))
}

/// [`var`] parsed as a number.
pub(crate) fn number(name: &str) -> usize {
    var(name)
        .parse()
        .unwrap_or_else(|e| panic!("{name} is not a number: {e}"))
}

/// [`var`] as a duration in milliseconds.
pub(crate) fn millis(name: &str) -> Duration {
    Duration::from_millis(number(name) as u64)
}

/// The child's side: its folder.
pub(crate) fn dir() -> PathBuf {
    PathBuf::from(var(DIR_VAR))
}

/// The child's side: its number.
pub(crate) fn index() -> usize {
    number(INDEX_VAR)
}

/// A child's log, each line one `write` straight to the file (shared by the
/// child's tasks).
#[derive(Clone)]
pub(crate) struct Log(Arc<Mutex<std::fs::File>>);

impl Log {
    /// Opens this child's log for appending.
    pub(crate) fn open() -> Self {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path(&dir(), index()))
            .expect("the child's log");
        Self(Arc::new(Mutex::new(file)))
    }

    /// Appends `line`.
    pub(crate) fn line(&self, line: String) {
        let mut file = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = file.write_all(format!("{line}\n").as_bytes());
    }
}

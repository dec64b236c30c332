//! A `dedupe serve` child process for the CLI's tests (shared by the files
//! of `tests/`; each uses what it needs).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The signing secret `Serve::start` gives the Stripe route.
pub const STRIPE_SECRET: &str = "whsec_serve_test_secret";

/// A running `dedupe serve`, killed on drop.
pub struct Serve {
    pub child: Child,
    /// The public listener (deliveries).
    pub base: String,
    /// The admin listener (ledger, metrics).
    pub admin: String,
}

impl Serve {
    pub fn start(store: &str, work_ms: u64) -> Self {
        Self::with(
            store,
            work_ms,
            &[
                "--secret",
                &format!("stripe={STRIPE_SECRET}"),
                "--unsigned",
                "hooks",
                "--body-limit",
                "65536",
            ],
            &[],
        )
    }

    /// `dedupe serve` on `store` with the test hooks, an admin listener and
    /// `extra` arguments and environment variables.
    pub fn with(store: &str, work_ms: u64, extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn(
            store,
            work_ms,
            &[&["--fail-on-header", "x-test-fail"], extra].concat(),
            env,
        )
    }

    /// The same without the failing-step hook: a healthy server.
    pub fn spawn(store: &str, work_ms: u64, extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::listening(store, work_ms, extra, env, true)
    }

    /// The seeds' demo: no secret, no admin listener (`admin` is empty).
    pub fn demo(store: &str) -> Self {
        Self::listening(store, 0, &[], &[], false)
    }

    fn listening(
        store: &str,
        work_ms: u64,
        extra: &[&str],
        env: &[(&str, &str)],
        admin: bool,
    ) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dedupe"))
            .args([
                "serve",
                "--store",
                store,
                "--listen",
                "127.0.0.1:0",
                "--work-ms",
                &work_ms.to_string(),
            ])
            .args(if admin {
                &["--admin-listen", "127.0.0.1:0"][..]
            } else {
                &[]
            })
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start dedupe serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("first line");
        let mut addresses = line
            .split_whitespace()
            .filter(|w| w.starts_with("http://"))
            .map(str::to_string);
        let base = addresses
            .next()
            .unwrap_or_else(|| panic!("no address in {line:?}"));
        let admin = match admin {
            true => addresses
                .next()
                .unwrap_or_else(|| panic!("no admin address in {line:?}")),
            false => String::new(),
        };
        Self { child, base, admin }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// The value of the Prometheus sample `name{labels...}`, 0 when absent.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

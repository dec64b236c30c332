//! Running the whole suite and reporting on it.

use std::fmt;
use std::time::{Duration, Instant};

use crate::checks::CHECKS;
use crate::harness::{CheckResult, Failure, Scale, StoreFactory, Verdict};

/// One check's result in a [`Report`].
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// The check's name.
    pub name: &'static str,
    /// Passed, skipped or failed.
    pub result: CheckResult,
    /// How long it took.
    pub elapsed: Duration,
}

/// The result of running every check against one store.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// One entry per check, in suite order.
    pub checks: Vec<CheckReport>,
    /// The scale the checks ran at.
    pub scale: Scale,
}

impl Report {
    /// Whether no check failed.
    pub fn all_passed(&self) -> bool {
        self.checks.iter().all(|c| c.result.is_ok())
    }

    /// The failed checks.
    pub fn failures(&self) -> impl Iterator<Item = (&'static str, &Failure)> {
        self.checks
            .iter()
            .filter_map(|c| c.result.as_ref().err().map(|f| (c.name, f)))
    }

    /// The skipped checks and why.
    pub fn skipped(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.checks.iter().filter_map(|c| match &c.result {
            Ok(Verdict::Skipped(why)) => Some((c.name, why.as_str())),
            _ => None,
        })
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.checks {
            let ms = c.elapsed.as_secs_f64() * 1e3;
            match &c.result {
                Ok(Verdict::Passed) => writeln!(f, "pass  {:<34} {ms:>9.1} ms", c.name)?,
                Ok(Verdict::Skipped(why)) => writeln!(f, "SKIP  {:<34} {why}", c.name)?,
                Err(e) => writeln!(f, "FAIL  {:<34} {e}", c.name)?,
            }
        }
        let failed = self.failures().count();
        let skipped = self.skipped().count();
        write!(
            f,
            "{} checks at {}: {} passed, {skipped} skipped, {failed} failed",
            self.checks.len(),
            self.scale,
            self.checks.len() - failed - skipped
        )
    }
}

/// Runs one check by name.
pub async fn run_check(factory: &dyn StoreFactory, name: &str) -> CheckResult {
    match CHECKS.iter().find(|c| c.name == name) {
        Some(check) => (check.run)(factory).await,
        None => Err(Failure::new(format!(
            "no conformance check is named {name:?}"
        ))),
    }
}

/// Runs every check, one after another, and reports on each.
pub async fn run_all(factory: &dyn StoreFactory) -> Report {
    run_selected(factory, |_| true).await
}

/// Runs the checks whose names `select` accepts, one after another, in suite
/// order, and reports on each (the others are left out of the report, not
/// counted as skipped). For a store whose whole suite already ran elsewhere:
/// a second emulator of the same service, say, that only needs the checks
/// where it behaves differently.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use dedupe_conformance::{run_selected, MemoryFactory};
///
/// let report = run_selected(&MemoryFactory, |name| name == "fresh_claim").await;
/// assert_eq!(report.checks.len(), 1);
/// assert!(report.all_passed(), "{report}");
/// # }
/// ```
pub async fn run_selected(factory: &dyn StoreFactory, select: impl Fn(&str) -> bool) -> Report {
    let mut report = Report {
        checks: Vec::new(),
        scale: factory.scale(),
    };
    for check in CHECKS.iter().filter(|c| select(c.name)) {
        let started = Instant::now();
        let result = (check.run)(factory).await;
        report.checks.push(CheckReport {
            name: check.name,
            result,
            elapsed: started.elapsed(),
        });
    }
    report
}

/// Runs one check and panics with its message if it fails; prints a visible line
/// when it is skipped. This is what the [`suite!`](crate::suite) tests call.
pub async fn assert_check(factory: &dyn StoreFactory, name: &str) {
    match run_check(factory, name).await {
        Ok(Verdict::Passed) if factory.scale() != Scale::Full => {
            println!("conformance check {name} passed at {}", factory.scale());
        }
        Ok(Verdict::Passed) => {}
        Ok(Verdict::Skipped(why)) => {
            eprintln!("conformance check {name} SKIPPED: {why}");
            println!("conformance check {name} SKIPPED: {why}");
        }
        Err(failure) => panic!("conformance check {name} FAILED: {failure}"),
    }
}

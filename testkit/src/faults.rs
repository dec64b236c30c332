//! Fault runs: a contested load of claims, completions and releases on a store,
//! every answer recorded into a [`History`], while the test does something bad to
//! the server or the network; then the verdict the contract asks for.
//!
//! ```text
//! let run = FaultRun::start(store.clone()).await;        // load running, work flowing
//! block_in_place(|| { server.kill(); server.start_again() }); // the fault
//! let verdict = run.finish().await;                       // work flows again, load stopped
//! verdict.assert_sound(bound);                            // typed, retryable, bounded, valid
//! verdict.assert_nothing_lost(store).await;               // durable setups only
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupe_conformance::history::{contested_load, recheck_completed, History};
use dedupe_core::{ClaimId, ClaimOptions, ClaimOutcome, DedupeStore, Error, Key};
use tokio::task::JoinHandle;

use crate::TcpProxy;

/// How long a run waits for work to flow (before the fault) or to flow again
/// (after it) before it fails.
const FLOW_PATIENCE: Duration = Duration::from_secs(60);

/// A recorded load in progress.
#[derive(Debug)]
pub struct FaultRun {
    store: Arc<dyn DedupeStore>,
    history: History,
    stop: Arc<AtomicBool>,
    load: JoinHandle<Vec<Error>>,
}

/// What a run showed.
#[derive(Debug)]
pub struct Verdict {
    /// Every call of every worker.
    pub history: History,
    /// Every error a worker met.
    pub errors: Vec<Error>,
}

impl FaultRun {
    /// Starts eight workers on contested keys with 300 ms leases (see
    /// [`contested_load`]) and returns once ten claims have been won, so the
    /// fault lands on work in progress.
    pub async fn start(store: Arc<dyn DedupeStore>) -> Self {
        let history = History::new(Duration::from_millis(50));
        let stop = Arc::new(AtomicBool::new(false));
        let load = tokio::spawn({
            let (store, history, stop) = (Arc::clone(&store), history.clone(), Arc::clone(&stop));
            async move { contested_load(store, &history, 8, Duration::from_millis(300), stop).await }
        });
        let run = Self {
            store,
            history,
            stop,
            load,
        };
        run.wait_for_wins(10).await;
        run
    }

    async fn wait_for_wins(&self, more: usize) {
        let target = self.history.claims_won() + more;
        let flowing = crate::eventually(FLOW_PATIENCE, || {
            let won = self.history.claims_won();
            async move { won >= target }
        })
        .await;
        assert!(
            flowing,
            "work did not flow within {FLOW_PATIENCE:?}: {} claims won, {} calls; last calls: {:?}",
            self.history.claims_won(),
            self.history.calls().len(),
            self.history
                .calls()
                .iter()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
        );
    }

    /// Waits until twenty more claims have been won after the fault (the same
    /// store objects work again), stops the load and answers what it showed.
    pub async fn finish(self) -> Verdict {
        self.wait_for_wins(20).await;
        self.stop.store(true, Ordering::Relaxed);
        // Every worker ends its current call and stops; a call that never
        // answers is a hang the bound on single calls cannot see.
        let errors = match tokio::time::timeout(FLOW_PATIENCE, self.load).await {
            Ok(done) => done.expect("the load task"),
            Err(_) => panic!(
                "a call never answered: the load did not stop within {FLOW_PATIENCE:?} ({} calls recorded)",
                self.history.calls().len()
            ),
        };
        drop(self.store);
        Verdict {
            history: self.history,
            errors,
        }
    }
}

impl Verdict {
    /// The contract under faults: at least one error was met (the fault was
    /// felt), every error is retryable or a lost lease (typed, never a guess),
    /// no call took longer than `bound` (nothing hung), and the whole history
    /// is valid (one live holder, no stale completion, one outcome, nothing
    /// lost).
    pub fn assert_sound(&self, bound: Duration) {
        assert!(!self.errors.is_empty(), "the fault caused no error at all");
        for e in &self.errors {
            assert!(
                e.is_retryable() || matches!(e, Error::LeaseLost { .. }),
                "a fault gave an error that is not retryable: {e} ({e:?})"
            );
        }
        let slowest = self.history.slowest_call();
        assert!(
            slowest <= bound,
            "a call took {slowest:?}, more than the bound {bound:?}"
        );
        if let Err(problems) = self.history.check() {
            panic!(
                "{} violations of the contract:\n{}",
                problems.len(),
                problems.join("\n")
            );
        }
        eprintln!(
            "{} calls, {} claims won, {} completions acknowledged, {} errors, slowest call {slowest:?}: history valid",
            self.history.calls().len(),
            self.history.claims_won(),
            self.history.acknowledged().len(),
            self.errors.len()
        );
    }

    /// For durable setups: every completion acknowledged before, during or
    /// after the fault is still there (claimed again, it answers its outcome),
    /// and the history, with those claims in it, is still valid.
    pub async fn assert_nothing_lost(&self, store: Arc<dyn DedupeStore>) {
        let lost = recheck_completed(store, &self.history, Duration::from_secs(30)).await;
        assert!(
            lost.is_empty(),
            "{} of {} acknowledged completions were lost:\n{}",
            lost.len(),
            self.history.acknowledged().len(),
            lost.join("\n")
        );
        if let Err(problems) = self.history.check() {
            panic!("{} violations:\n{}", problems.len(), problems.join("\n"));
        }
    }
}

/// The network faults a run under load meets, through `proxy`: every byte
/// swallowed for `hold` (a blackhole), half a second of flow, then every byte
/// held for `hold` and delivered late (a stall). Choose `hold` longer than the
/// store's timeout.
pub async fn blackhole_then_stall(proxy: &TcpProxy, hold: Duration) {
    proxy.blackhole();
    tokio::time::sleep(hold).await;
    proxy.heal();
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.stall();
    tokio::time::sleep(hold).await;
    proxy.heal();
}

/// Cuts every connection through `proxy` `times` times, `every` apart, each
/// cut lasting 20 ms (new connections refused meanwhile).
pub async fn cut_repeatedly(proxy: &TcpProxy, times: usize, every: Duration) {
    for _ in 0..times {
        tokio::time::sleep(every).await;
        proxy.cut();
        tokio::time::sleep(Duration::from_millis(20)).await;
        proxy.heal();
    }
}

/// A claim whose answer is lost (the server ran it, the proxy dropped the reply
/// and closed the connection) fails with a retryable error within `bound`;
/// retried with the same claim id once the network heals, it is `Claimed`, the
/// same lease twice, and a claim without the id is `InFlight`. The store must
/// reach its server through `proxy`.
///
/// A first claim of another key warms the connection (a driver that prepares
/// statements would otherwise lose the answer to its prepare, and the server
/// would never run the claim); afterwards the record is read to make sure the
/// server did run it.
pub async fn lost_answer_is_reclaimed_by_its_claim_id(
    store: &dyn DedupeStore,
    proxy: &TcpProxy,
    key: &Key,
    bound: Duration,
) {
    let plain = ClaimOptions::new(Duration::from_secs(60));
    let warm = Key::new(key.namespace(), format!("{}-warm", key.id())).expect("warm key");
    let warmed = store.claim(&warm, &plain).await.expect("warm-up claim");
    assert!(warmed.lease().is_some(), "{warmed:?}");
    // Drivers hand the connection back after the call, in a task of their own
    // (sqlx checks it with a round trip first): let that finish before the
    // answers start being lost, or the fault lands on that check instead. The
    // assertion below that the server ran the claim fails loudly if it did not.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let opts = plain
        .clone()
        .with_claim_id(ClaimId::new("delivery-7f3a").expect("claim id"));
    proxy.lose_answers();
    let asked = Instant::now();
    let lost = store.claim(key, &opts).await;
    let took = asked.elapsed();
    proxy.heal();
    match lost {
        Err(e) => assert!(e.is_retryable(), "a lost answer gave {e} ({e:?})"),
        Ok(answer) => panic!("an answer the proxy dropped reached the client: {answer:?}"),
    }
    assert!(took <= bound, "the lost answer took {took:?} to fail");
    let give_up = Instant::now() + Duration::from_secs(20);
    let stored = loop {
        match store.get(key).await {
            Err(e) if e.is_retryable() && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => break other.expect("a read once healed"),
        }
    };
    let stored = stored.expect("the server never ran the claim whose answer was lost");
    assert_eq!(stored.claim_id, opts.claim_id, "{stored:?}");
    // The retry with the claim id is Claimed; without it the key is held.
    let first = store.claim(key, &opts).await.expect("the retry");
    let Some(first) = first.lease().cloned() else {
        panic!("the retry with the same claim id was answered {first:?}, not Claimed");
    };
    assert_eq!(first.token, stored.token, "the retry got another lease");
    let other = store.claim(key, &plain).await.expect("another claim");
    assert!(matches!(other, ClaimOutcome::InFlight { .. }), "{other:?}");
    let again = store.claim(key, &opts).await.expect("a second retry");
    assert_eq!(again.lease(), Some(&first), "{again:?}");
    store
        .complete(&first, b"done once", Duration::from_secs(60))
        .await
        .expect("the retried lease completes");
}

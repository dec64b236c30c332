//! The Deduper helper: every path through claim, work, complete or release.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupe_core::{
    ClaimOptions, DedupeStore, Deduper, Fingerprint, HandleError, Handled, Key, MemoryStore,
    OnFailure, RecordState,
};

fn key(id: &str) -> Key {
    Key::new("test", id).expect("valid key")
}

#[derive(Debug, thiserror::Error)]
#[error("payment provider said no")]
struct Declined;

#[tokio::test]
async fn failed_work_is_released_and_runs_again() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(Arc::new(store.clone()));
    let k = key("retry-me");
    match deduper
        .run(&k, |_| async { Err::<Vec<u8>, _>(Declined) })
        .await
    {
        Err(HandleError::Work {
            claim: Ok(OnFailure::Release),
            ..
        }) => {}
        other => panic!("failed work answered {other:?}"),
    }
    assert!(
        store.get(&k).await.expect("get").is_none(),
        "the failed claim was not released"
    );
    let second = deduper
        .run(&k, |_| async { Ok::<_, Declined>(b"ok".to_vec()) })
        .await
        .expect("second run");
    assert_eq!(
        second,
        Handled::Ran {
            outcome: b"ok".to_vec(),
            attempt: 1
        }
    );
}

#[tokio::test]
async fn kept_failures_are_answered_as_failures_not_successes() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(Arc::new(store.clone())).with_on_failure(OnFailure::Keep);
    let k = key("keep-failure");
    match deduper
        .run(&k, |_| async { Err::<Vec<u8>, _>(Declined) })
        .await
    {
        Err(HandleError::Work {
            claim: Ok(OnFailure::Keep),
            ..
        }) => {}
        other => panic!("failed work answered {other:?}"),
    }
    let again = deduper
        .run(&k, |_| async {
            panic!("kept failures must not run again") as Result<Vec<u8>, Declined>
        })
        .await
        .expect("second run");
    assert_eq!(
        again,
        Handled::Failed {
            error: "payment provider said no".into()
        }
    );
    // Work that succeeded with the very same bytes is told apart.
    let ok = key("succeeded-with-same-text");
    deduper
        .run(&ok, |_| async {
            Ok::<_, Declined>(b"payment provider said no".to_vec())
        })
        .await
        .expect("first run");
    let dup = deduper
        .run(&ok, |_| async { Ok::<_, Declined>(Vec::new()) })
        .await
        .expect("duplicate");
    assert_eq!(
        dup,
        Handled::Duplicate {
            outcome: b"payment provider said no".to_vec()
        }
    );
}

#[tokio::test]
async fn an_outcome_not_written_by_a_deduper_is_corrupt_not_guessed() {
    let store = MemoryStore::new();
    let k = key("raw");
    let lease = store
        .claim(&k, &ClaimOptions::default())
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("claimed");
    store
        .complete(&lease, b"raw bytes", Duration::from_secs(60))
        .await
        .expect("complete");
    let deduper = Deduper::new(store);
    match deduper
        .run(&k, |_| async { Ok::<_, Declined>(Vec::new()) })
        .await
    {
        Err(HandleError::Store(dedupe_core::Error::CorruptRecord { .. })) => {}
        other => panic!("an untagged outcome answered {other:?}"),
    }
}

#[tokio::test]
async fn a_bad_lease_ttl_is_reported_before_anything_is_claimed() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(store.clone()).with_lease_ttl(Duration::ZERO);
    assert!(deduper.validate().is_err());
    match deduper
        .run(&key("zero"), |_| async { Ok::<_, Declined>(Vec::new()) })
        .await
    {
        Err(HandleError::Store(dedupe_core::Error::InvalidConfig { .. })) => {}
        other => panic!("a zero lease answered {other:?}"),
    }
    assert!(store.is_empty(), "something was written");
}

#[tokio::test]
async fn the_expire_task_purges_on_its_period_and_stops() {
    let store = MemoryStore::new();
    let lease = store
        .claim(&key("short"), &ClaimOptions::new(Duration::from_millis(5)))
        .await
        .expect("claim")
        .lease()
        .cloned()
        .expect("claimed");
    drop(lease);
    assert_eq!(store.len(), 1);
    let task = dedupe_core::spawn_expire_task(Arc::new(store.clone()), Duration::from_millis(10));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !store.is_empty() {
        assert!(Instant::now() < deadline, "the expire task never purged");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task.stop().await;
    // Stopped: an expired record stays until someone purges it.
    let _claimed = store
        .claim(
            &key("after-stop"),
            &ClaimOptions::new(Duration::from_millis(1)),
        )
        .await
        .expect("claim");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(store.len(), 1, "the task still ran after stop");
}

#[tokio::test]
async fn a_panic_in_the_work_releases_the_claim() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(Arc::new(store.clone()));
    let k = key("panics");
    let task = {
        let (deduper, k) = (deduper.clone(), k.clone());
        tokio::spawn(async move {
            deduper
                .run(&k, |_| async {
                    panic!("handler bug") as Result<Vec<u8>, Declined>
                })
                .await
        })
    };
    let joined = task.await;
    assert!(
        joined.is_err_and(|e| e.is_panic()),
        "the panic was swallowed"
    );
    assert!(
        store.get(&k).await.expect("get").is_none(),
        "a panicking worker kept its claim"
    );
}

/// The caller's future dropped mid-work (a client gone, a timeout): the work
/// goes on under its claim, a copy meanwhile is told it is in flight (it does
/// not run the work a second time), and once the work ends its outcome is the
/// one stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_run_mid_work_leaves_the_work_running_under_its_claim() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(Arc::new(store.clone()));
    let k = key("cancelled");
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (finish_tx, finish) = tokio::sync::oneshot::channel::<()>();
    let task = {
        let (deduper, k, runs) = (deduper.clone(), k.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            deduper
                .run(&k, move |_| async move {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    started_tx.send(()).expect("signal");
                    finish.await.expect("told to finish");
                    Ok::<_, Declined>(b"first".to_vec())
                })
                .await
        })
    };
    started.await.expect("work started");
    task.abort();
    assert!(task.await.is_err_and(|e| e.is_cancelled()));
    let copy = {
        let runs = Arc::clone(&runs);
        deduper
            .run(&k, move |_| async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, Declined>(b"second".to_vec())
            })
            .await
            .expect("copy")
    };
    assert!(
        matches!(copy, Handled::InFlight { .. }),
        "a copy while the dropped run's work goes on answered {copy:?}"
    );
    finish_tx.send(()).expect("the work is still running");
    let since = Instant::now();
    let record = loop {
        let record = store.get(&k).await.expect("get").expect("record");
        if matches!(record.state, RecordState::Done { .. }) {
            break record;
        }
        assert!(
            since.elapsed() < Duration::from_secs(5),
            "the dropped run's work never completed"
        );
        tokio::task::yield_now().await;
    };
    assert_eq!(record.attempts, 1);
    let again = deduper
        .run(&k, |_| async { Ok::<_, Declined>(b"third".to_vec()) })
        .await
        .expect("rerun");
    assert_eq!(
        again,
        Handled::Duplicate {
            outcome: b"first".to_vec()
        }
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// Work past `with_max_work_time` is dropped and its claim released: the run
/// says so, and the next delivery runs the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_past_its_time_bound_is_dropped_and_released() {
    let store = MemoryStore::new();
    let deduper =
        Deduper::new(Arc::new(store.clone())).with_max_work_time(Duration::from_millis(100));
    let k = key("bounded");
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    struct SetOnDrop(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let result = {
        let guard = SetOnDrop(Arc::clone(&dropped));
        deduper
            .run(&k, move |_| async move {
                let _guard = guard;
                std::future::pending::<Result<Vec<u8>, Declined>>().await
            })
            .await
    };
    match result {
        Err(HandleError::TimedOut { limit, released }) => {
            assert_eq!(limit, Duration::from_millis(100));
            released.expect("released");
        }
        other => panic!("a run past its bound answered {other:?}"),
    }
    assert!(
        dropped.load(std::sync::atomic::Ordering::SeqCst),
        "the work still runs"
    );
    assert!(
        store.get(&k).await.expect("get").is_none(),
        "the claim was kept"
    );
    let again = deduper
        .run(&k, |_| async { Ok::<_, Declined>(b"ok".to_vec()) })
        .await
        .expect("rerun");
    assert!(
        matches!(again, Handled::Ran { attempt: 1, .. }),
        "{again:?}"
    );
}

/// Shutdown waits for running work within its grace, aborts (and releases)
/// what runs past it, and refuses new runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_then_aborts_and_refuses_new_work() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(Arc::new(store.clone()));
    let (quick, stuck) = (key("quick"), key("stuck"));
    let quick_run = {
        let (d, k) = (deduper.clone(), quick.clone());
        tokio::spawn(async move {
            d.run(&k, |_| async {
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok::<_, Declined>(b"quick".to_vec())
            })
            .await
        })
    };
    let stuck_run = {
        let (d, k) = (deduper.clone(), stuck.clone());
        tokio::spawn(async move {
            d.run(&k, |_| async {
                std::future::pending::<Result<Vec<u8>, Declined>>().await
            })
            .await
        })
    };
    let since = Instant::now();
    while store.len() < 2 {
        assert!(
            since.elapsed() < Duration::from_secs(5),
            "the runs never claimed"
        );
        tokio::task::yield_now().await;
    }
    let drained = deduper.shutdown(Duration::from_millis(600)).await;
    assert_eq!((drained.running, drained.aborted), (2, 1), "{drained:?}");
    assert!(matches!(
        quick_run.await.expect("join"),
        Ok(Handled::Ran { .. })
    ));
    assert!(matches!(
        stuck_run.await.expect("join"),
        Err(HandleError::Aborted { released: Ok(()) })
    ));
    let record = store.get(&quick).await.expect("get").expect("record");
    assert!(matches!(record.state, RecordState::Done { .. }));
    assert!(
        store.get(&stuck).await.expect("get").is_none(),
        "the aborted claim was kept"
    );
    let late = deduper
        .run(&key("late"), |_| async { Ok::<_, Declined>(Vec::new()) })
        .await;
    assert!(
        matches!(&late, Err(HandleError::Store(e)) if e.is_retryable()),
        "a run after shutdown answered {late:?}"
    );
}

/// A heartbeat whose extend is slow does not freeze the work: the work is
/// polled while the extend is on its way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_heartbeat_does_not_freeze_the_work() {
    #[derive(Debug, Clone)]
    struct SlowExtend(MemoryStore);
    // A wrapper forwards every method: one it forgets would silently fall back
    // to the trait's default instead of the wrapped store's.
    #[deny(clippy::missing_trait_methods)]
    #[dedupe_core::async_trait]
    impl DedupeStore for SlowExtend {
        async fn claim(
            &self,
            key: &Key,
            opts: &ClaimOptions,
        ) -> dedupe_core::Result<dedupe_core::ClaimOutcome> {
            self.0.claim(key, opts).await
        }
        async fn complete(
            &self,
            lease: &dedupe_core::Lease,
            outcome: &[u8],
            retention: Duration,
        ) -> dedupe_core::Result<()> {
            self.0.complete(lease, outcome, retention).await
        }
        async fn release(&self, lease: &dedupe_core::Lease) -> dedupe_core::Result<()> {
            self.0.release(lease).await
        }
        async fn extend(
            &self,
            lease: &dedupe_core::Lease,
            ttl: Duration,
        ) -> dedupe_core::Result<dedupe_core::Lease> {
            tokio::time::sleep(Duration::from_millis(400)).await;
            self.0.extend(lease, ttl).await
        }
        async fn expire(&self) -> dedupe_core::Result<u64> {
            self.0.expire().await
        }
        async fn get(&self, key: &Key) -> dedupe_core::Result<Option<dedupe_core::Record>> {
            self.0.get(key).await
        }
        async fn forget(&self, key: &Key) -> dedupe_core::Result<bool> {
            self.0.forget(key).await
        }
        async fn claim_many(
            &self,
            keys: &[Key],
            opts: &ClaimOptions,
        ) -> dedupe_core::Result<Vec<dedupe_core::ClaimOutcome>> {
            self.0.claim_many(keys, opts).await
        }
        fn capabilities(&self) -> dedupe_core::Capabilities {
            self.0.capabilities()
        }
    }
    let deduper = Deduper::new(SlowExtend(MemoryStore::new()))
        .with_lease_ttl(Duration::from_millis(900))
        .with_heartbeat(true);
    let handled = deduper
        .run(&key("beating"), |_| async {
            // 1.2 s of 10 ms steps: the heartbeat's 400 ms extends fall inside.
            let mut widest = Duration::ZERO;
            let mut last = Instant::now();
            for _ in 0..120 {
                tokio::time::sleep(Duration::from_millis(10)).await;
                widest = widest.max(last.elapsed());
                last = Instant::now();
            }
            Ok::<_, Declined>(format!("{}", widest.as_millis()).into_bytes())
        })
        .await
        .expect("run");
    let Handled::Ran { outcome, .. } = handled else {
        panic!("{handled:?}")
    };
    let widest: u64 = String::from_utf8(outcome)
        .expect("text")
        .parse()
        .expect("ms");
    assert!(
        widest < 300,
        "the work stood still for {widest} ms while the lease was extended"
    );
}

#[tokio::test]
async fn in_flight_and_mismatch_do_not_run_the_work() {
    let store: Arc<dyn DedupeStore> = Arc::new(MemoryStore::new());
    let deduper = Deduper::new(Arc::clone(&store));
    let k = key("busy");
    let holder = store
        .claim(
            &k,
            &ClaimOptions::default().with_fingerprint(Fingerprint::sha256(b"a")),
        )
        .await
        .expect("claim");
    let answer = deduper
        .run(&k, |_| async {
            panic!("must not run") as Result<Vec<u8>, Declined>
        })
        .await
        .expect("run");
    assert!(matches!(answer, Handled::InFlight { .. }), "{answer:?}");
    let opts = ClaimOptions::default().with_fingerprint(Fingerprint::sha256(b"b"));
    let answer = deduper
        .run_with(&k, opts, |_| async {
            panic!("must not run") as Result<Vec<u8>, Declined>
        })
        .await
        .expect("run");
    assert_eq!(answer, Handled::Mismatch);
    assert!(holder.lease().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_that_outlives_its_lease_is_reported_not_recorded() {
    let store = MemoryStore::new();
    // Without the heartbeat, work longer than its lease is taken over.
    let deduper = Deduper::new(Arc::new(store.clone()))
        .with_lease_ttl(Duration::from_millis(20))
        .with_heartbeat(false);
    let k = key("slow");
    let result = deduper
        .run(&k, {
            let store = store.clone();
            move |lease| async move {
                tokio::time::sleep_until((Instant::now() + Duration::from_millis(40)).into()).await;
                // Another delivery takes the event over after the deadline.
                let taken = store
                    .claim(&lease.key, &ClaimOptions::default())
                    .await
                    .expect("claim");
                assert!(taken.lease().is_some_and(|l| l.is_takeover()));
                Ok::<_, Declined>(b"late".to_vec())
            }
        })
        .await;
    match result {
        Err(HandleError::NotRecorded { outcome, source }) => {
            assert_eq!(outcome, b"late");
            assert!(matches!(source, dedupe_core::Error::LeaseLost { .. }));
        }
        other => panic!("a lost lease answered {other:?}"),
    }
    let record = store
        .get(&k)
        .await
        .expect("get")
        .expect("the new holder's record");
    assert!(
        matches!(record.state, RecordState::InFlight { .. }),
        "the stale worker overwrote the new holder"
    );
    assert_eq!(record.attempts, 2);
}

/// With the heartbeat on, work that runs for several lease TTLs keeps its lease:
/// other deliveries meanwhile are answered InFlight, never a takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_keeps_long_work_from_being_taken_over() {
    let store = MemoryStore::new();
    let ttl = Duration::from_millis(600);
    let deduper = Deduper::new(Arc::new(store.clone()))
        .with_lease_ttl(ttl)
        .with_heartbeat(true);
    let k = key("long-work");
    let handled = deduper
        .run(&k, {
            let (store, k) = (store.clone(), k.clone());
            move |_lease| async move {
                // The work lasts more than three lease TTLs; other copies arrive
                // after the first TTL and after the second.
                for _ in 0..2 {
                    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
                    let other = store
                        .claim(&k, &ClaimOptions::default())
                        .await
                        .expect("claim");
                    assert!(
                        matches!(
                            other,
                            dedupe_core::ClaimOutcome::InFlight { attempt: 1, .. }
                        ),
                        "a copy during long work answered {other:?}"
                    );
                }
                tokio::time::sleep(ttl).await;
                Ok::<_, Declined>(b"long".to_vec())
            }
        })
        .await
        .expect("run");
    assert_eq!(
        handled,
        Handled::Ran {
            outcome: b"long".to_vec(),
            attempt: 1
        }
    );
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Long(String);

#[tokio::test]
async fn a_kept_failure_too_long_for_the_store_is_cut_and_still_kept() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(store.clone()).with_on_failure(OnFailure::Keep);
    let k = key("long-failure");
    let text = "é".repeat(200 * 1024); // 400 KiB of two-byte characters
    match deduper
        .run(&k, {
            let text = text.clone();
            |_| async move { Err::<Vec<u8>, _>(Long(text)) }
        })
        .await
    {
        Err(HandleError::Work {
            claim: Ok(OnFailure::Keep),
            ..
        }) => {}
        other => panic!("a long failure answered {other:?}"),
    }
    match deduper
        .run(&k, |_| async {
            panic!("a kept failure must not run again") as Result<Vec<u8>, Long>
        })
        .await
        .expect("second run")
    {
        Handled::Failed { error } => {
            assert!(
                error.len() < text.len() && text.starts_with(&error),
                "{}",
                error.len()
            )
        }
        other => panic!("answered {other:?}"),
    }
}

/// A claim id asked again while its first run goes on (a caller that timed
/// out and retried the same request): the store answers the same lease, and
/// the second run does not run the work beside the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_id_asked_again_mid_run_does_not_run_the_work_twice() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(Arc::new(store.clone()));
    let k = key("reentrant");
    let opts =
        ClaimOptions::default().with_claim_id(dedupe_core::ClaimId::new("req-1").expect("id"));
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (finish_tx, finish) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let (d, k, opts, runs) = (deduper.clone(), k.clone(), opts.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            d.run_with(&k, opts, move |_| async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                started_tx.send(()).expect("signal");
                finish.await.expect("finish");
                Ok::<_, Declined>(b"first".to_vec())
            })
            .await
        })
    };
    started.await.expect("started");
    let again = {
        let runs = Arc::clone(&runs);
        deduper
            .run_with(&k, opts.clone(), move |_| async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, Declined>(b"second".to_vec())
            })
            .await
            .expect("again")
    };
    assert!(matches!(again, Handled::InFlight { .. }), "{again:?}");
    finish_tx.send(()).expect("finish");
    assert!(matches!(
        first.await.expect("join"),
        Ok(Handled::Ran { .. })
    ));
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A work closure that panics before it returns its future releases the
/// claim like a panicking future does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_closure_that_panics_releases_the_claim() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(Arc::new(store.clone()));
    let k = key("closure-panics");
    let task = {
        let (d, k) = (deduper.clone(), k.clone());
        tokio::spawn(async move {
            d.run(
                &k,
                |_lease| -> std::future::Ready<Result<Vec<u8>, Declined>> { panic!("closure bug") },
            )
            .await
        })
    };
    assert!(task.await.is_err_and(|e| e.is_panic()));
    assert!(
        store.get(&k).await.expect("get").is_none(),
        "the claim was kept"
    );
}

/// Work that blocks its thread for longer than the lease keeps its lease:
/// the heartbeat is a task of its own, beating on another thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_work_does_not_stop_the_heartbeat() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(Arc::new(store.clone()))
        .with_lease_ttl(Duration::from_millis(600))
        .with_heartbeat(true);
    let handled = deduper
        .run(&key("blocking"), |_| async {
            std::thread::sleep(Duration::from_millis(1500));
            Ok::<_, Declined>(b"done".to_vec())
        })
        .await;
    assert!(
        matches!(handled, Ok(Handled::Ran { attempt: 1, .. })),
        "the lease passed while the work blocked: {handled:?}"
    );
}

/// Work that never ends, with the default settings: its claim holds (a copy
/// nine minutes in is answered in flight), then the default bound drops the
/// work at ten minutes and releases the claim, so the next delivery runs
/// the work. Without the bound the first run never ends and this fails.
#[tokio::test(start_paused = true)]
async fn hung_work_loses_its_claim_at_the_default_bound() {
    let deduper = Deduper::new(MemoryStore::new());
    assert!(deduper.heartbeat(), "the heartbeat is on by default");
    let key = key("hung");
    let hung = tokio::spawn({
        let (deduper, key) = (deduper.clone(), key.clone());
        async move {
            deduper
                .run(&key, |_| {
                    std::future::pending::<Result<Vec<u8>, std::io::Error>>()
                })
                .await
        }
    });
    tokio::time::sleep(Duration::from_secs(9 * 60)).await;
    let copy = deduper
        .run(&key, |_| async {
            Ok::<_, std::io::Error>(b"copy".to_vec())
        })
        .await
        .expect("answered");
    assert!(matches!(copy, Handled::InFlight { .. }), "{copy:?}");
    let ended = tokio::time::timeout(Duration::from_secs(2 * 60), hung)
        .await
        .expect("the default bound ended the hung work")
        .expect("joined");
    match ended {
        Err(HandleError::TimedOut { limit, released }) => {
            assert_eq!(limit, Deduper::DEFAULT_MAX_WORK_TIME);
            released.expect("released");
        }
        other => panic!("{other:?}"),
    }
    let next = deduper
        .run(&key, |_| async {
            Ok::<_, std::io::Error>(b"next".to_vec())
        })
        .await
        .expect("ran");
    assert!(matches!(next, Handled::Ran { .. }), "{next:?}");
}

/// A record whose lease has passed, planted directly in `store`.
async fn plant_expired(store: &MemoryStore, id: &str) {
    let _planted = store
        .claim(&key(id), &ClaimOptions::new(Duration::from_millis(1)))
        .await
        .expect("claim");
    tokio::time::sleep(Duration::from_millis(5)).await;
}

async fn until_len(store: &MemoryStore, len: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while store.len() != len {
        assert!(
            Instant::now() < deadline,
            "{} records, not {len}: the expiry task did not run",
            store.len()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// With the default settings the deduper deletes expired records: its first
/// work starts the expiry task (whose first pass is at once), none runs
/// before any work, `with_expiry(None)` runs none, and shutdown stops it.
#[tokio::test]
async fn expiry_runs_by_default_from_the_first_work() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(store.clone());
    plant_expired(&store, "old").await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(store.len(), 1, "an expiry task ran before any work");
    deduper
        .run(&key("work"), |_| async {
            Ok::<_, Declined>(b"done".to_vec())
        })
        .await
        .expect("run");
    until_len(&store, 1).await; // "old" gone, "work" kept for its retention
    assert!(store.get(&key("work")).await.expect("get").is_some());
    deduper.shutdown(Duration::from_secs(1)).await;

    let off = MemoryStore::new();
    let deduper = Deduper::new(off.clone()).with_expiry(None);
    plant_expired(&off, "old").await;
    deduper
        .run(&key("work"), |_| async {
            Ok::<_, Declined>(b"done".to_vec())
        })
        .await
        .expect("run");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(off.len(), 2, "expiry ran though turned off");

    let stopped = MemoryStore::new();
    let deduper = Deduper::new(stopped.clone()).with_expiry(Some(Duration::from_millis(10)));
    deduper
        .run(&key("work"), |_| async {
            Ok::<_, Declined>(b"done".to_vec())
        })
        .await
        .expect("run");
    deduper.shutdown(Duration::from_secs(1)).await;
    plant_expired(&stopped, "late").await;
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(stopped.len(), 2, "the expiry task outlived shutdown");
}

/// The inbox worker, a front door of its own, starts the expiry too.
#[tokio::test]
async fn the_inbox_worker_starts_the_expiry() {
    let store = MemoryStore::new();
    let deduper = Deduper::new(store.clone());
    plant_expired(&store, "old").await;
    let worker = dedupe_core::InboxWorker::new(&deduper, store.clone(), "test");
    let running = tokio::spawn(async move {
        worker
            .run(|_taken| async { Ok::<_, Declined>(Vec::new()) })
            .await
    });
    until_len(&store, 0).await;
    running.abort();
}

/// `Admin::record_keys` on the memory store: records only (an inbox item
/// is not one), one namespace or all, in `(namespace, id)` order, pages
/// that end with `next: None`.
#[tokio::test]
async fn memory_lists_record_keys_a_page_at_a_time() {
    use dedupe_core::backend::{Admin, RecordQuery};
    use dedupe_core::Inbox;
    let store = MemoryStore::new();
    for (ns, id) in [("b", "1"), ("a", "2"), ("a", "1"), ("c", "9"), ("a", "3")] {
        let _claimed = store
            .claim(&Key::new(ns, id).expect("key"), &ClaimOptions::default())
            .await
            .expect("claim");
    }
    store
        .accept(&Key::new("a", "item").expect("key"), b"{}")
        .await
        .expect("accept");
    let mut listed = Vec::new();
    let mut query = RecordQuery::new(None, 2);
    loop {
        let page = store.record_keys(&query).await.expect("page");
        assert!(page.keys.len() <= 2);
        listed.extend(page.keys.iter().map(|k| k.to_string()));
        match page.next {
            Some(next) => query = query.after(Some(next)),
            None => break,
        }
    }
    assert_eq!(listed, ["a:1", "a:2", "a:3", "b:1", "c:9"]);
    let only_a = store
        .record_keys(&RecordQuery::new(Some("a".into()), 10))
        .await
        .expect("page");
    assert_eq!(only_a.keys.len(), 3);
    assert_eq!(only_a.next, None);
    assert!(store
        .record_keys(&RecordQuery::new(None, 1).after(Some("no cursor".into())))
        .await
        .is_err());
}

/// A store that deletes expired records by itself (Redis, DynamoDB's TTL)
/// gets no expiry task: a DynamoDB table is not scanned every hour.
#[tokio::test]
async fn a_store_that_expires_by_itself_gets_no_expiry_task() {
    #[derive(Debug, Clone)]
    struct ExpiresItself(MemoryStore);
    #[dedupe_core::async_trait]
    impl DedupeStore for ExpiresItself {
        async fn claim(
            &self,
            key: &Key,
            opts: &ClaimOptions,
        ) -> dedupe_core::Result<dedupe_core::ClaimOutcome> {
            self.0.claim(key, opts).await
        }
        async fn complete(
            &self,
            lease: &dedupe_core::Lease,
            outcome: &[u8],
            retention: Duration,
        ) -> dedupe_core::Result<()> {
            self.0.complete(lease, outcome, retention).await
        }
        async fn release(&self, lease: &dedupe_core::Lease) -> dedupe_core::Result<()> {
            self.0.release(lease).await
        }
        async fn extend(
            &self,
            lease: &dedupe_core::Lease,
            ttl: Duration,
        ) -> dedupe_core::Result<dedupe_core::Lease> {
            self.0.extend(lease, ttl).await
        }
        async fn expire(&self) -> dedupe_core::Result<u64> {
            self.0.expire().await
        }
        async fn get(&self, key: &Key) -> dedupe_core::Result<Option<dedupe_core::Record>> {
            self.0.get(key).await
        }
        async fn forget(&self, key: &Key) -> dedupe_core::Result<bool> {
            self.0.forget(key).await
        }
        fn capabilities(&self) -> dedupe_core::Capabilities {
            self.0.capabilities().with_expires_by_itself(true)
        }
    }
    let store = MemoryStore::new();
    let deduper = Deduper::new(ExpiresItself(store.clone()));
    plant_expired(&store, "old").await;
    deduper
        .run(&key("work"), |_| async {
            Ok::<_, Declined>(b"done".to_vec())
        })
        .await
        .expect("run");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        store.len(),
        2,
        "an expiry task ran on a store that expires by itself"
    );
}

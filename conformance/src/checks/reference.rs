//! The store against the reference model, operation by operation.

use super::*;

/// One store's side of the differential run: the store and the leases its
/// claims handed out, per key, in order.
struct Side {
    store: Arc<dyn DedupeStore>,
    leases: Vec<Vec<Lease>>,
}

/// What two conforming stores must agree on for one operation: the answer with
/// tokens and deadlines (which differ by nature) left out.
fn normal(answer: &Result<ClaimOutcome, Error>) -> String {
    match answer {
        Ok(ClaimOutcome::Claimed(lease)) => format!("claimed attempt {}", lease.attempt),
        Ok(ClaimOutcome::InFlight { attempt, .. }) => format!("in-flight attempt {attempt}"),
        Ok(ClaimOutcome::Duplicate { outcome, .. }) => format!("duplicate {outcome:?}"),
        Ok(ClaimOutcome::Mismatch { state }) => format!("mismatch {state:?}"),
        Err(e) => normal_err(e),
    }
}

fn normal_err(e: &Error) -> String {
    match e {
        Error::LeaseLost { .. } => "lease lost".into(),
        other => format!("error {other}"),
    }
}

impl Side {
    /// Applies operation `op` (drawn from `seq`, identical for both sides) and
    /// answers its normalized result.
    async fn apply(&mut self, keys: &[Key], op: &[usize; 5]) -> String {
        let [kind, k, variant, pick, extra] = *op;
        // Short leases and retentions, so records expire while the run goes on.
        let lease_ttl = if extra % 3 == 0 {
            MODEL_SHORT
        } else {
            LONG_TTL
        };
        let retention = if extra % 2 == 0 {
            MODEL_SHORT
        } else {
            LONG_TTL
        };
        let fingerprints = [
            None,
            Some(Fingerprint::sha256(b"a")),
            Some(Fingerprint::sha256(b"b")),
        ];
        let claim_ids = [None, ClaimId::new("x").ok(), ClaimId::new("y").ok()];
        let mut opts = ClaimOptions::new(lease_ttl);
        opts.fingerprint = fingerprints[variant % 3].clone();
        opts.claim_id = claim_ids[(variant / 3) % 3].clone();
        let lease = |leases: &Vec<Vec<Lease>>| {
            let list = &leases[k];
            (!list.is_empty()).then(|| list[pick % list.len()].clone())
        };
        match kind {
            0..=3 => {
                let answer = self.store.claim(&keys[k], &opts).await;
                if let Ok(ClaimOutcome::Claimed(l)) = &answer {
                    self.leases[k].push(l.clone());
                }
                format!("claim {}", normal(&answer))
            }
            4 | 5 => match lease(&self.leases) {
                Some(l) => {
                    let outcome = format!("outcome-{extra}").into_bytes();
                    let r = self.store.complete(&l, &outcome, retention).await;
                    format!(
                        "complete {}",
                        r.map(|()| "ok".to_string())
                            .unwrap_or_else(|e| normal_err(&e))
                    )
                }
                None => "no lease".into(),
            },
            6 => match lease(&self.leases) {
                Some(l) => {
                    let r = self.store.release(&l).await;
                    format!(
                        "release {}",
                        r.map(|()| "ok".to_string())
                            .unwrap_or_else(|e| normal_err(&e))
                    )
                }
                None => "no lease".into(),
            },
            7 => match lease(&self.leases) {
                Some(l) => {
                    let r = self.store.extend(&l, lease_ttl).await;
                    format!(
                        "extend {}",
                        r.map(|_| "ok".to_string())
                            .unwrap_or_else(|e| normal_err(&e))
                    )
                }
                None => "no lease".into(),
            },
            8 => format!(
                "forget {:?}",
                self.store
                    .forget(&keys[k])
                    .await
                    .map_err(|e| normal_err(&e))
            ),
            9 => {
                let got = self.store.get(&keys[k]).await.map(|r| {
                    r.map(|r| {
                        let outcome = match r.state {
                            RecordState::Done { outcome, .. } => Some(outcome),
                            RecordState::InFlight { .. } => None,
                        };
                        (r.attempts, outcome, r.fingerprint, r.claim_id)
                    })
                });
                format!("get {:?}", got.map_err(|e| normal_err(&e)))
            }
            10 => format!(
                "expire {:?}",
                self.store.expire().await.map_err(|e| normal_err(&e))
            ),
            _ => {
                // A batch of three keys, repeats allowed.
                let batch: Vec<Key> = [k, pick, extra]
                    .iter()
                    .map(|i| keys[i % keys.len()].clone())
                    .collect();
                match self.store.claim_many(&batch, &opts).await {
                    Ok(answers) => {
                        let mut text = String::from("claim_many");
                        for (key, answer) in batch.iter().zip(answers) {
                            if let ClaimOutcome::Claimed(l) = &answer {
                                let i = keys.iter().position(|x| x == key).unwrap_or(0);
                                self.leases[i].push(l.clone());
                            }
                            text.push_str(&format!(" [{}]", normal(&Ok(answer))));
                        }
                        text
                    }
                    Err(e) => format!("claim_many {}", normal_err(&e)),
                }
            }
        }
    }
}

/// Lease and retention used by the model-based run for records meant to expire.
const MODEL_SHORT: Duration = Duration::from_millis(400);
/// No operation runs this close to a deadline of the reference (either side),
/// so that the store and the reference, a few milliseconds apart, agree on
/// whether it passed.
const MODEL_GUARD: Duration = Duration::from_millis(150);
/// Operations per seed.
const MODEL_STEPS: usize = 120;
/// Set to a seed to replay exactly that one.
pub const SEED_VAR: &str = "DEDUPE_CONFORMANCE_SEED";

fn describe(op: &[usize; 5]) -> String {
    let [kind, k, variant, pick, extra] = *op;
    let what = match kind {
        0..=3 => "claim",
        4 | 5 => "complete",
        6 => "release",
        7 => "extend",
        8 => "forget",
        9 => "get",
        10 => "expire",
        11 => "sleep",
        _ => "claim_many",
    };
    format!("{what}(key {k}, variant {variant}, lease #{pick}, extra {extra})")
}

/// Waits until no reference deadline is within [`MODEL_GUARD`] of now.
async fn step_clear_of(deadlines: &[SystemTime]) {
    loop {
        let now = SystemTime::now();
        let near = deadlines
            .iter()
            .filter(|d| {
                let gap = match d.duration_since(now) {
                    Ok(ahead) => ahead,
                    Err(past) => past.duration(),
                };
                gap < MODEL_GUARD
            })
            .max();
        match near {
            Some(d) => {
                let until = *d + MODEL_GUARD + Duration::from_millis(1);
                if let Ok(wait) = until.duration_since(now) {
                    tokio::time::sleep(wait).await;
                }
            }
            None => return,
        }
    }
}

/// The deadline of a live record.
fn deadline_of(record: &Record) -> SystemTime {
    match record.state {
        RecordState::InFlight { lease_deadline } => lease_deadline,
        RecordState::Done {
            retention_deadline, ..
        } => retention_deadline,
    }
}

/// Runs one seed: `MODEL_STEPS` operations in lockstep on the store and the
/// reference, with real time passing. Answers the history, or the failure with
/// the whole sequence that led to it.
async fn run_seed(
    factory: &dyn StoreFactory,
    seed: u64,
    history: &mut Vec<String>,
) -> Result<(), Failure> {
    let fixture = factory.create().await?;
    let explicit_expire = fixture.store().capabilities().explicit_expire;
    let keys: Vec<Key> = (0..4)
        .map(|i| key(&format!("model-{i}")))
        .collect::<Result<_, _>>()?;
    let mut tested = Side {
        store: fixture.store(),
        leases: vec![Vec::new(); keys.len()],
    };
    let reference_store = Arc::new(dedupe_core::MemoryStore::new());
    let mut reference = Side {
        store: reference_store.clone(),
        leases: vec![Vec::new(); keys.len()],
    };
    let mut deadlines: Vec<SystemTime> = Vec::new();
    let mut seq = Sequence(seed | 1);
    let mut steps: Vec<String> = Vec::new();
    for step in 0..MODEL_STEPS {
        let mut op = [
            seq.below(13),
            seq.below(keys.len()),
            seq.below(9),
            seq.below(8),
            seq.below(6),
        ];
        if op[0] == 10 && !explicit_expire {
            op[0] = 9;
        }
        if op[0] == 11 {
            // Let time pass: some records expire.
            tokio::time::sleep(Duration::from_millis(20 + 80 * op[4] as u64)).await;
            steps.push(format!("{step}: {}", describe(&op)));
            continue;
        }
        step_clear_of(&deadlines).await;
        let want = reference.apply(&keys, &op).await;
        let got = tested.apply(&keys, &op).await;
        steps.push(format!("{step}: {} -> {got}", describe(&op)));
        if got != want {
            return Err(Failure::new(format!(
                "seed {seed} (replay with {SEED_VAR}={seed}), step {step}: the store answered \
                 `{got}`, the reference `{want}`. The sequence:\n  {}",
                steps.join("\n  ")
            )));
        }
        history.push(got);
        // Every deadline either side now holds, to keep the next step clear:
        // the store's own too, which a slow call (a loaded machine) puts
        // later than the reference's by more than the guard.
        for k in &keys {
            if let Some(record) = reference_store.get(k).await? {
                deadlines.push(deadline_of(&record));
            }
            if let Some(record) = tested.store.get(k).await? {
                deadlines.push(deadline_of(&record));
            }
        }
        let now = SystemTime::now();
        deadlines.retain(|d| *d + MODEL_GUARD * 2 > now);
    }
    Ok(())
}

/// Model-based differential check: random sequences of operations (claims with
/// and without fingerprints and claim ids, short and long leases, completes with
/// short and long retentions, releases and extends with current and stale
/// leases, forgets, gets, expires, batches with repeats, and pauses that let
/// records expire) on four keys, run in lockstep on the store and on the
/// reference [`MemoryStore`] with real time passing; every answer, and every
/// `get`, must match. One fixed seed and four new ones each run; a failure prints
/// its seed (set `DEDUPE_CONFORMANCE_SEED` to replay it) and the whole sequence.
///
/// [`MemoryStore`]: dedupe_core::MemoryStore
pub async fn matches_reference_store(factory: &dyn StoreFactory) -> CheckResult {
    let seeds: Vec<u64> = match std::env::var(SEED_VAR) {
        Ok(seed) => vec![seed
            .trim()
            .parse()
            .map_err(|_| Failure::new(format!("{SEED_VAR}={seed} is not a number")))?],
        Err(_) => {
            let fresh = SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1);
            let mut gen = Sequence(fresh | 1);
            std::iter::once(0x9e37_79b9_7f4a_7c15)
                .chain((1..factory.scale().model_seeds()).map(|_| gen.next()))
                .collect()
        }
    };
    let mut history = Vec::new();
    for seed in &seeds {
        run_seed(factory, *seed, &mut history).await?;
    }
    if seeds.len() == 1 {
        return Ok(Verdict::Passed);
    }
    // The sequences must have reached every kind of answer, or they proved
    // little. Random sequences may miss a rare one (a takeover needs a short
    // lease to pass unreleased): draw more seeds until every kind showed up.
    let mut seeds = seeds;
    let mut gen = Sequence(seeds.iter().fold(0x2545_f491, |a, s| a ^ s) | 1);
    loop {
        let missing: Vec<&str> = NEEDED
            .iter()
            .copied()
            .filter(|needed| !history.iter().any(|h| h.contains(needed)))
            .collect();
        if missing.is_empty() {
            return Ok(Verdict::Passed);
        }
        ensure!(
            seeds.len() < MODEL_MAX_SEEDS,
            "the model-based sequences (seeds {seeds:?}) never produced {missing:?}"
        );
        let seed = gen.next();
        seeds.push(seed);
        run_seed(factory, seed, &mut history).await?;
    }
}

/// Every kind of answer the model-based run must have produced.
const NEEDED: &[&str] = &[
    "claim claimed attempt 1",
    "claim claimed attempt 2",
    "claim in-flight",
    "claim duplicate",
    "claim mismatch",
    "complete ok",
    "complete lease lost",
    "release ok",
    "release lease lost",
    "extend ok",
    "extend lease lost",
    "forget Ok(true)",
    "forget Ok(false)",
    "get Ok(Some",
    "get Ok(None)",
    "claim_many",
];

/// Seeds the run may draw, in all, to reach every kind of answer.
const MODEL_MAX_SEEDS: usize = 15;

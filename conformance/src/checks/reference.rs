//! The store against the reference model, operation by operation.

use super::*;

/// A small deterministic generator (xorshift64*), so a failing sequence replays
/// exactly.
struct Sequence(u64);

impl Sequence {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

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
        let fingerprints = [
            None,
            Some(Fingerprint::sha256(b"a")),
            Some(Fingerprint::sha256(b"b")),
        ];
        let claim_ids = [None, ClaimId::new("x").ok(), ClaimId::new("y").ok()];
        let mut opts = ClaimOptions::new(LONG_TTL);
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
                    let r = self.store.complete(&l, &outcome, LONG_TTL).await;
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
                    let r = self.store.extend(&l, LONG_TTL).await;
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

/// Differential check: 600 operations drawn from a fixed seed (claims with and
/// without fingerprints and claim ids, completes, releases and extends with
/// current and stale leases, forgets, gets, batches with repeats) on six keys,
/// run in lockstep on the store and on the reference [`MemoryStore`]; every
/// answer must match.
///
/// [`MemoryStore`]: dedupe_core::MemoryStore
pub async fn matches_reference_store(factory: &dyn StoreFactory) -> CheckResult {
    let fixture = factory.create().await?;
    let keys: Vec<Key> = (0..6)
        .map(|i| key(&format!("diff-{i}")))
        .collect::<Result<_, _>>()?;
    let mut tested = Side {
        store: fixture.store(),
        leases: vec![Vec::new(); keys.len()],
    };
    let mut reference = Side {
        store: Arc::new(dedupe_core::MemoryStore::new()),
        leases: vec![Vec::new(); keys.len()],
    };
    let mut seq = Sequence(0x9e37_79b9_7f4a_7c15);
    let mut history: Vec<String> = Vec::new();
    for step in 0..600 {
        let op = [
            seq.below(11),
            seq.below(keys.len()),
            seq.below(9),
            seq.below(8),
            seq.below(6),
        ];
        let want = reference.apply(&keys, &op).await;
        let got = tested.apply(&keys, &op).await;
        if got != want {
            let recent = history
                .iter()
                .rev()
                .take(8)
                .rev()
                .cloned()
                .collect::<Vec<_>>()
                .join("\n  ");
            return Err(Failure::new(format!(
                "step {step} (op {op:?}): the store answered `{got}`, the reference `{want}`; the steps before:\n  {recent}"
            )));
        }
        history.push(format!("{step}: {op:?} -> {got}"));
    }
    // The sequence must have reached every kind of answer, or it proved little.
    for needed in [
        "claim claimed",
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
    ] {
        ensure!(
            history.iter().any(|h| h.contains(needed)),
            "the differential sequence never produced `{needed}`: the store answered too few kinds"
        );
    }
    Ok(Verdict::Passed)
}

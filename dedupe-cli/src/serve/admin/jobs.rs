//! The bulk actions started from the admin surface: each a
//! [`Bulk`] on a task of its own, kept with an id so the
//! operator can follow its progress and cancel it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use dedupe_core::{Bulk, BulkAction, Inbox, ItemFilter};
use serde_json::{json, Value};

use super::query::filter_json;

/// Finished jobs kept for the operator to look at; older ones are dropped.
const KEPT: usize = 100;
/// Jobs running at once, at most: each reads and writes the store.
const RUNNING: usize = 8;

/// One bulk action and when it started.
pub(crate) struct Job {
    pub(crate) id: u64,
    pub(crate) started: SystemTime,
    pub(crate) bulk: Arc<Bulk>,
}

impl Job {
    pub(crate) fn json(&self) -> Value {
        let p = self.bulk.progress();
        json!({
            "id": self.id,
            "action": self.bulk.action().as_str(),
            "filter": filter_json(self.bulk.filter()),
            "started_at": crate::inbox::rfc3339(self.started),
            "state": if !p.finished { "running" } else if p.error.is_some() { "failed" }
                     else if p.cancelled { "cancelled" } else { "done" },
            "scanned": p.scanned,
            "matched": p.matched,
            "done": p.done,
            "skipped": p.skipped,
            "error": p.error,
        })
    }
}

/// The jobs of this server, by id.
#[derive(Default)]
pub(crate) struct Jobs {
    jobs: Mutex<(u64, BTreeMap<u64, Arc<Job>>)>,
}

impl Jobs {
    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, BTreeMap<u64, Arc<Job>>)> {
        self.jobs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts `action` over the items matching `filter`, on a task; refused
    /// (with the reason) while [`RUNNING`] jobs run.
    pub(crate) fn start(
        &self,
        inbox: Arc<dyn Inbox>,
        filter: ItemFilter,
        action: BulkAction,
    ) -> Result<Arc<Job>, String> {
        let bulk = Arc::new(Bulk::new(filter, action));
        let job = {
            let mut jobs = self.lock();
            let running = jobs
                .1
                .values()
                .filter(|j| !j.bulk.progress().finished)
                .count();
            if running >= RUNNING {
                return Err(format!(
                    "{running} bulk actions are running: wait for one to end, or cancel one"
                ));
            }
            jobs.0 += 1;
            let job = Arc::new(Job {
                id: jobs.0,
                started: SystemTime::now(),
                bulk: Arc::clone(&bulk),
            });
            jobs.1.insert(job.id, Arc::clone(&job));
            // Forget the oldest finished ones past the limit.
            while jobs.1.len() > KEPT {
                let oldest = jobs
                    .1
                    .iter()
                    .find(|(_, j)| j.bulk.progress().finished)
                    .map(|(id, _)| *id);
                match oldest {
                    Some(id) => jobs.1.remove(&id),
                    None => break,
                };
            }
            job
        };
        tracing::info!(job = job.id, action = action.as_str(), namespace = %bulk.filter().namespace, "bulk action started");
        tokio::spawn(async move {
            bulk.run(inbox.as_ref()).await;
            let p = bulk.progress();
            tracing::info!(
                done = p.done,
                skipped = p.skipped,
                cancelled = p.cancelled,
                "bulk action finished"
            );
        });
        Ok(job)
    }

    pub(crate) fn get(&self, id: u64) -> Option<Arc<Job>> {
        self.lock().1.get(&id).cloned()
    }

    /// Every job kept, newest first.
    pub(crate) fn all(&self) -> Vec<Arc<Job>> {
        self.lock().1.values().rev().cloned().collect()
    }
}

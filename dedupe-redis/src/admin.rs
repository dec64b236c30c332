//! The tools' store-wide operations ([`Admin`]) on the store's prefix.

use dedupe_core::backend::{Admin, KeyPage, RecordQuery};
use dedupe_core::{async_trait, Error, Result};
use redis::AsyncCommands;

use crate::RedisStore;

/// A [`RedisStore`] with the URLs of the servers it runs on, which removing
/// its namespace needs: every key under the prefix is deleted on each server
/// named (on a Cluster, each primary's own keys). Migrate makes nothing (the
/// scripts load on first use); durability is the servers' persistence
/// settings and their evicted keys.
#[derive(Debug, Clone)]
pub struct RedisAdmin {
    store: RedisStore,
    urls: Vec<String>,
}

impl RedisAdmin {
    /// The administration of `store`, whose keys live on the servers at
    /// `urls` (one URL for a standalone server; each primary's on a Cluster).
    pub fn new(store: RedisStore, urls: Vec<String>) -> Self {
        Self { store, urls }
    }
}

#[async_trait]
impl Admin for RedisAdmin {
    async fn migrate(&self) -> Result<()> {
        Ok(())
    }

    /// Keys need no schema: there is nothing to be missing.
    async fn check(&self) -> Result<()> {
        Ok(())
    }

    /// One `SCAN` batch a page, server by server (each primary on a
    /// Cluster): the cursor is the server's place in `urls` and its SCAN
    /// cursor; `COUNT` is a hint to Redis, so a page may hold fewer keys
    /// than the limit (or none) or more, and still have a next; a key SCAN
    /// returns twice (it may, during a rehash) is listed twice. Inbox items
    /// are left out. The servers are the URL's: on a Cluster, name every
    /// primary.
    async fn record_keys(&self, query: &RecordQuery) -> Result<KeyPage> {
        let fail =
            |e: redis::RedisError| Error::retryable("listing the records", Some(Box::new(e) as _));
        let (mut node, mut cursor) = match query.after.as_deref() {
            None => (0usize, 0u64),
            Some(after) => after
                .split_once(':')
                .and_then(|(n, c)| Some((n.parse().ok()?, c.parse().ok()?)))
                .ok_or_else(|| Error::config(format!("{after:?} is not a cursor of this store")))?,
        };
        let Some(url) = self.urls.get(node) else {
            return Ok(KeyPage::default());
        };
        let pattern = match query.namespace.as_deref() {
            Some(namespace) => format!("{}*", glob_escape(&self.store.record_base(namespace))),
            None => format!("{}*", glob_escape(self.store.prefix())),
        };
        let client = redis::Client::open(url.as_str()).map_err(fail)?;
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(fail)?;
        let (next_cursor, found): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(query.limit)
            .query_async(&mut conn)
            .await
            .map_err(fail)?;
        let mut keys = Vec::new();
        for found in found {
            let Some(key) = self.store.key_of_record_key(&found) else {
                continue;
            };
            // An inbox item (only where the store can keep one) is
            // `dedupe inbox list`'s, not a record.
            let item = self.store.index_keys(key.namespace()).is_some()
                && dedupe_core::Inbox::item(&self.store, &key).await?.is_some();
            if !item {
                keys.push(key);
            }
        }
        cursor = next_cursor;
        if cursor == 0 {
            node += 1;
        }
        let next = (node < self.urls.len()).then(|| format!("{node}:{cursor}"));
        Ok(KeyPage { keys, next })
    }

    async fn remove_namespace(&self) -> Result<()> {
        for url in &self.urls {
            delete_prefixed(url, self.store.prefix()).await?;
        }
        Ok(())
    }

    async fn durability(&self) -> Option<String> {
        let evicted = match self.store.evicted_keys().await {
            Some(n) => format!("evicted_keys {n}"),
            None => "evicted_keys unknown".into(),
        };
        Some(format!("{}; {evicted}", self.store.durability().await))
    }
}

/// Deletes the keys under `prefix` held by the server at `url`.
async fn delete_prefixed(url: &str, prefix: &str) -> Result<()> {
    let fail = |e: redis::RedisError| {
        Error::retryable("deleting the prefix's keys", Some(Box::new(e) as _))
    };
    let client = redis::Client::open(url).map_err(fail)?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(fail)?;
    let keys: Vec<String> = {
        let mut iter: redis::AsyncIter<'_, String> = conn
            .scan_match(format!("{}*", glob_escape(prefix)))
            .await
            .map_err(fail)?;
        let mut keys = Vec::new();
        while let Some(key) = iter.next_item().await {
            keys.push(key.map_err(fail)?);
        }
        keys
    };
    for key in keys {
        // One key per call: on a Cluster node, keys of one call must share a slot.
        let _: i64 = conn.del(key).await.map_err(fail)?;
    }
    Ok(())
}

/// A prefix as a literal in a SCAN pattern.
fn glob_escape(prefix: &str) -> String {
    let mut escaped = String::with_capacity(prefix.len());
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

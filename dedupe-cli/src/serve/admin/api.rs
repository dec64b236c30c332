//! The JSON API under `/api` (documented in the CLI's README): the
//! namespaces' health, items by filter a page at a time, an item's detail,
//! replay and forget of one item or of every item a filter matches (with a
//! dry run, progress and a cancel), pause and resume; the ledger and the
//! metrics.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dedupe_core::{
    count_items, search_items, BulkAction, Error, Inbox, InboxCounts, Item, Key, MAX_PAGE,
};
use http::{header, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::query::{filter_json, FilterFields};
use super::state::{refuse, Admin};
use crate::serve::routes;

/// Items a search reads at most for one page (matching or not).
pub(super) const SEARCH_BUDGET: u64 = 10_000;
/// Bytes of a payload the detail shows.
pub(super) const PREVIEW_BYTES: usize = 4096;

pub(super) fn routes() -> Router<Arc<Admin>> {
    Router::new()
        .route("/api/csrf", get(csrf))
        .route("/api/namespaces", get(namespaces))
        .route("/api/namespaces/{ns}", get(namespace))
        .route("/api/namespaces/{ns}/items", get(items))
        .route("/api/namespaces/{ns}/items/{id}", get(item))
        .route("/api/namespaces/{ns}/items/{id}/replay", post(replay))
        .route("/api/namespaces/{ns}/items/{id}/forget", post(forget))
        .route("/api/namespaces/{ns}/bulk", post(bulk))
        .route("/api/namespaces/{ns}/pause", post(pause))
        .route("/api/namespaces/{ns}/resume", post(resume))
        .route("/api/jobs", get(jobs))
        .route("/api/jobs/{id}", get(job))
        .route("/api/jobs/{id}/cancel", post(cancel))
        .route("/api/ledger", get(ledger))
}

/// A store error as an answer: 503 with `Retry-After` when it may pass, 500
/// otherwise; the text goes to the log (it can name hosts and tables).
pub(super) fn store_failed(e: &Error) -> Response {
    tracing::warn!(error = %e, "admin call failed on the store");
    let mut response = refuse(
        if e.is_retryable() {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        },
        "store",
        if e.is_retryable() {
            "the store failed for now (the server's log says why); retry"
        } else {
            "the store failed (the server's log says why)"
        },
    );
    if e.is_retryable() {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, http::HeaderValue::from(1));
    }
    response
}

/// The inbox, or a 404 when this server has none (not `--inbox`).
pub(super) fn inbox_of(admin: &Admin) -> Result<&Arc<dyn Inbox>, Response> {
    admin.inbox.as_ref().ok_or_else(|| {
        refuse(
            StatusCode::NOT_FOUND,
            "no_inbox",
            "this server runs without an inbox (start it with --inbox)",
        )
    })
}

pub(super) fn key_of(ns: &str, id: &str) -> Result<Key, Response> {
    Key::new(ns, id).map_err(|e| refuse(StatusCode::BAD_REQUEST, "bad_key", e.to_string()))
}

/// One namespace's health, as JSON.
pub(super) async fn health(admin: &Admin, inbox: &dyn Inbox, ns: &str) -> Result<Value, Error> {
    let counts: InboxCounts = inbox.counts(ns).await?;
    let paused = inbox.paused(ns).await?;
    let mut shown = crate::inbox::counts_json(ns, &counts, paused);
    shown["processed_per_minute"] = json!(admin.throughput.last_minutes(ns));
    Ok(shown)
}

async fn csrf(State(admin): State<Arc<Admin>>) -> Response {
    Json(json!({"csrf_token": admin.auth.csrf})).into_response()
}

async fn namespaces(State(admin): State<Arc<Admin>>) -> Response {
    let inbox = match inbox_of(&admin) {
        Ok(inbox) => inbox,
        Err(r) => return r,
    };
    let mut shown = Vec::new();
    for ns in &admin.namespaces {
        match health(&admin, inbox.as_ref(), ns).await {
            Ok(v) => shown.push(v),
            Err(e) => return store_failed(&e),
        }
    }
    Json(json!({"namespaces": shown})).into_response()
}

async fn namespace(State(admin): State<Arc<Admin>>, Path(ns): Path<String>) -> Response {
    let inbox = match inbox_of(&admin) {
        Ok(inbox) => inbox,
        Err(r) => return r,
    };
    if let Err(r) = key_of(&ns, "x") {
        return r;
    }
    match health(&admin, inbox.as_ref(), &ns).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => store_failed(&e),
    }
}

#[derive(Deserialize)]
pub(super) struct PageFields {
    #[serde(default)]
    pub(super) after: Option<String>,
    #[serde(default)]
    pub(super) limit: Option<String>,
}

async fn items(
    State(admin): State<Arc<Admin>>,
    Path(ns): Path<String>,
    Query(fields): Query<FilterFields>,
    Query(page): Query<PageFields>,
) -> Response {
    let inbox = match inbox_of(&admin) {
        Ok(inbox) => inbox,
        Err(r) => return r,
    };
    let filter = match fields.filter(&ns) {
        Ok(f) => f,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, "bad_filter", e),
    };
    let limit = match page
        .limit
        .as_deref()
        .map(str::trim)
        .filter(|l| !l.is_empty())
    {
        None => 50,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
            _ => {
                return refuse(
                    StatusCode::BAD_REQUEST,
                    "bad_page",
                    format!("limit: {l:?} is not 1 to {MAX_PAGE}"),
                )
            }
        },
    };
    let after = page.after.filter(|a| !a.is_empty());
    match search_items(inbox.as_ref(), &filter, after, limit, SEARCH_BUDGET).await {
        Ok(found) => Json(json!({
            "filter": filter_json(&filter),
            "items": found.items.iter().map(crate::inbox::item_json).collect::<Vec<_>>(),
            "next": found.next,
            "scanned": found.scanned,
        }))
        .into_response(),
        Err(e) if matches!(e, Error::InvalidConfig { .. }) => {
            refuse(StatusCode::BAD_REQUEST, "bad_filter", e.to_string())
        }
        Err(e) => store_failed(&e),
    }
}

/// An item's detail: what `dedupe inbox list --json` shows, with its
/// delivery read back (event and delivery ids, the headers kept: no
/// credentials were stored) and a preview of its payload.
pub(super) fn detail_json(item: &Item) -> Value {
    let mut shown = crate::inbox::item_json(item);
    let (payload, delivery) = match dedupe_webhook::StoredDelivery::parse(&item.payload) {
        Ok(d) => {
            let headers: Vec<Value> = d
                .headers
                .iter()
                .map(|(n, v)| json!([n.as_str(), String::from_utf8_lossy(v.as_bytes())]))
                .collect();
            (
                d.payload.to_vec(),
                json!({"event_id": d.event_id, "delivery_id": d.delivery_id, "headers": headers}),
            )
        }
        Err(_) => (item.payload.clone(), Value::Null),
    };
    let cut = payload.len().min(PREVIEW_BYTES);
    shown["payload_preview"] = json!(String::from_utf8_lossy(&payload[..cut]));
    shown["payload_truncated"] = json!(payload.len() > cut);
    shown["delivery"] = delivery;
    shown["accepted_at"] = json!(crate::inbox::rfc3339(item.accepted_at));
    shown
}

async fn item(State(admin): State<Arc<Admin>>, Path((ns, id)): Path<(String, String)>) -> Response {
    let inbox = match inbox_of(&admin) {
        Ok(inbox) => inbox,
        Err(r) => return r,
    };
    let key = match key_of(&ns, &id) {
        Ok(k) => k,
        Err(r) => return r,
    };
    match inbox.item(&key).await {
        Ok(Some(item)) => Json(detail_json(&item)).into_response(),
        Ok(None) => match completed_at(inbox.as_ref(), &key).await {
            Ok(Some(at)) => Json(json!({
                "namespace": key.namespace(),
                "id": key.id(),
                "state": "done",
                "completed_at": crate::inbox::rfc3339(at),
            }))
            .into_response(),
            Ok(None) => refuse(
                StatusCode::NOT_FOUND,
                "no_item",
                format!("{key} holds no item"),
            ),
            Err(e) => store_failed(&e),
        },
        Err(e) => store_failed(&e),
    }
}

/// When the key's record was completed, if it is done: an item that ran to
/// its end is a done record, no longer an item.
pub(super) async fn completed_at(
    inbox: &dyn Inbox,
    key: &Key,
) -> Result<Option<std::time::SystemTime>, Error> {
    Ok(match inbox.get(key).await? {
        Some(dedupe_core::Record {
            state: dedupe_core::RecordState::Done { completed_at, .. },
            ..
        }) => Some(completed_at),
        _ => None,
    })
}

async fn replay(
    State(admin): State<Arc<Admin>>,
    Path((ns, id)): Path<(String, String)>,
) -> Response {
    let inbox = match inbox_of(&admin) {
        Ok(inbox) => inbox,
        Err(r) => return r,
    };
    let key = match key_of(&ns, &id) {
        Ok(k) => k,
        Err(r) => return r,
    };
    match replay_one(inbox.as_ref(), &key).await {
        Ok(replayed) => Json(json!({"key": key.to_string(), "replayed": replayed})).into_response(),
        Err(e) => store_failed(&e),
    }
}

/// Replays one item (the API's and the dashboard's button), counted in the
/// outcomes when it was replayed, as a bulk replay counts each.
pub(super) async fn replay_one(inbox: &dyn Inbox, key: &Key) -> Result<bool, Error> {
    let replayed = inbox.replay(key).await?;
    if replayed {
        dedupe_core::count_inbox_outcome(key.namespace(), "replayed");
    }
    Ok(replayed)
}

async fn forget(
    State(admin): State<Arc<Admin>>,
    Path((ns, id)): Path<(String, String)>,
) -> Response {
    let inbox = match inbox_of(&admin) {
        Ok(inbox) => inbox,
        Err(r) => return r,
    };
    let key = match key_of(&ns, &id) {
        Ok(k) => k,
        Err(r) => return r,
    };
    match inbox.forget(&key).await {
        Ok(forgotten) => {
            Json(json!({"key": key.to_string(), "forgotten": forgotten})).into_response()
        }
        Err(e) => store_failed(&e),
    }
}

/// `POST /api/namespaces/{ns}/bulk`, a JSON body: `action` (`replay` or
/// `forget`), `dry_run` (default false), and the filter's fields.
#[derive(Deserialize)]
struct BulkBody {
    action: String,
    #[serde(default)]
    dry_run: bool,
    /// Says that an empty filter (every item of the namespace) is meant.
    #[serde(default)]
    all: bool,
    #[serde(flatten)]
    filter: FilterFields,
    /// Fields the body should not have: a misspelt `dry_run` or filter
    /// field is refused, never taken as "no condition".
    #[serde(flatten)]
    unknown: std::collections::BTreeMap<String, Value>,
}

async fn bulk(
    State(admin): State<Arc<Admin>>,
    Path(ns): Path<String>,
    body: Result<Json<BulkBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let inbox = match inbox_of(&admin) {
        Ok(inbox) => inbox,
        Err(r) => return r,
    };
    let Json(body) = match body {
        Ok(body) => body,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, "bad_body", e.body_text()),
    };
    if !body.unknown.is_empty() {
        let names: Vec<&str> = body.unknown.keys().map(String::as_str).collect();
        return refuse(
            StatusCode::BAD_REQUEST,
            "bad_body",
            format!("unknown fields: {}", names.join(", ")),
        );
    }
    if body.filter.pairs().is_empty() && !body.all {
        return refuse(
            StatusCode::BAD_REQUEST,
            "bad_filter",
            "an empty filter matches every item of the namespace: say \"all\": true to mean it",
        );
    }
    let action = match body.action.parse::<BulkAction>() {
        Ok(a) => a,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, "bad_action", e.to_string()),
    };
    let filter = match body.filter.filter(&ns) {
        Ok(f) => f,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, "bad_filter", e),
    };
    if body.dry_run {
        return match count_items(inbox.as_ref(), &filter).await {
            Ok(matched) => Json(json!({
                "dry_run": true,
                "action": action.as_str(),
                "filter": filter_json(&filter),
                "matched": matched,
            }))
            .into_response(),
            Err(e) => store_failed(&e),
        };
    }
    match admin.jobs.start(Arc::clone(inbox), filter, action) {
        Ok(job) => (StatusCode::ACCEPTED, Json(job.json())).into_response(),
        Err(busy) => refuse(StatusCode::TOO_MANY_REQUESTS, "busy", busy),
    }
}

async fn pause(State(admin): State<Arc<Admin>>, Path(ns): Path<String>) -> Response {
    pause_or_resume(&admin, &ns, true).await
}

async fn resume(State(admin): State<Arc<Admin>>, Path(ns): Path<String>) -> Response {
    pause_or_resume(&admin, &ns, false).await
}

pub(super) async fn pause_or_resume(admin: &Admin, ns: &str, pause: bool) -> Response {
    let inbox = match inbox_of(admin) {
        Ok(inbox) => inbox,
        Err(r) => return r,
    };
    if let Err(r) = key_of(ns, "x") {
        return r;
    }
    let changed = if pause {
        inbox.pause(ns).await
    } else {
        inbox.resume(ns).await
    };
    match changed {
        Ok(changed) => {
            tracing::info!(
                namespace = ns,
                pause,
                changed,
                "namespace paused or resumed from the admin surface"
            );
            Json(json!({"namespace": ns, "paused": pause, "changed": changed})).into_response()
        }
        Err(e) => store_failed(&e),
    }
}

async fn jobs(State(admin): State<Arc<Admin>>) -> Response {
    Json(json!({"jobs": admin.jobs.all().iter().map(|j| j.json()).collect::<Vec<_>>()}))
        .into_response()
}

fn job_id(id: &str) -> Result<u64, Response> {
    id.parse()
        .map_err(|_| refuse(StatusCode::NOT_FOUND, "no_job", format!("no job {id:?}")))
}

async fn job(State(admin): State<Arc<Admin>>, Path(id): Path<String>) -> Response {
    match job_id(&id).map(|id| admin.jobs.get(id)) {
        Ok(Some(job)) => Json(job.json()).into_response(),
        Ok(None) => refuse(StatusCode::NOT_FOUND, "no_job", format!("no job {id}")),
        Err(r) => r,
    }
}

async fn cancel(State(admin): State<Arc<Admin>>, Path(id): Path<String>) -> Response {
    match job_id(&id).map(|id| admin.jobs.get(id)) {
        Ok(Some(job)) => {
            job.bulk.cancel();
            Json(job.json()).into_response()
        }
        Ok(None) => refuse(StatusCode::NOT_FOUND, "no_job", format!("no job {id}")),
        Err(r) => r,
    }
}

#[derive(Deserialize)]
pub(super) struct LedgerPage {
    limit: Option<usize>,
    after: Option<String>,
}

/// A page of the ledger, oldest first: `?limit=` rows (default 1000, at most
/// 10000) after the cursor `?after=` (a row's `seq`); `next` is the cursor of
/// the following page, `null` on the last.
pub(super) async fn ledger(
    State(admin): State<Arc<Admin>>,
    Query(page): Query<LedgerPage>,
) -> Response {
    routes::ledger_page(&admin.app, page.limit, page.after).await
}

pub(super) async fn metrics_text(State(admin): State<Arc<Admin>>) -> Response {
    routes::metrics_page(&admin.app)
}

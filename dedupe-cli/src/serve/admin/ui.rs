//! The dashboard under `/ui`: HTML rendered here (maud, escaped by
//! construction), one stylesheet built into the binary, no script. Every
//! page works with a plain form and a link; a running bulk action's page
//! reloads itself every second until it is over.
//!
//! Pages: `/ui` (each namespace's counts, oldest due age, items finished per
//! minute here, pause and resume), `/ui/namespaces/{ns}` (items by filter, a
//! page at a time, and the bulk actions), `/ui/namespaces/{ns}/items/{id}`
//! (an item, its errors, its delivery; replay, forget),
//! `/ui/namespaces/{ns}/bulk/confirm` (the dry run's count, then the real
//! thing), `/ui/jobs` and `/ui/jobs/{id}` (progress, cancel), `/ui/login`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::extract::{Path, Query, State};
use axum::http::HeaderValue;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use dedupe_core::{count_items, search_items, BulkAction, Item, ItemFilter};
use http::{header, StatusCode};
use maud::{html, Markup, DOCTYPE};
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use serde::Deserialize;

use super::api::{detail_json, health, inbox_of, key_of, PageFields, SEARCH_BUDGET};
use super::query::FilterFields;
use super::state::{same, Admin, COOKIE};

const STYLE: &str = include_str!("ui.css");

pub(super) fn routes() -> Router<Arc<Admin>> {
    Router::new()
        .route("/ui", get(overview))
        .route("/ui/style.css", get(style))
        .route("/ui/login", get(login_page).post(login))
        .route("/ui/namespaces/{ns}", get(namespace))
        .route("/ui/namespaces/{ns}/pause", post(pause))
        .route("/ui/namespaces/{ns}/resume", post(resume))
        .route("/ui/namespaces/{ns}/items/{id}", get(item))
        .route("/ui/namespaces/{ns}/items/{id}/replay", post(replay))
        .route("/ui/namespaces/{ns}/items/{id}/forget", post(forget))
        .route("/ui/namespaces/{ns}/bulk/confirm", post(confirm))
        .route("/ui/namespaces/{ns}/bulk", post(start))
        .route("/ui/jobs", get(jobs))
        .route("/ui/jobs/{id}", get(job))
        .route("/ui/jobs/{id}/cancel", post(cancel))
}

fn enc(part: &str) -> String {
    utf8_percent_encode(part, NON_ALPHANUMERIC).to_string()
}

fn ns_path(ns: &str) -> String {
    format!("/ui/namespaces/{}", enc(ns))
}

fn item_path(item_ns: &str, id: &str) -> String {
    format!("{}/items/{}", ns_path(item_ns), enc(id))
}

/// `?a=b&c=d` of `pairs`, or nothing.
fn query_string(pairs: &[(&str, String)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    format!(
        "?{}",
        serde_urlencoded::to_string(pairs).unwrap_or_default()
    )
}

fn age(since: SystemTime) -> String {
    let d = SystemTime::now().duration_since(since).unwrap_or_default();
    human(d)
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", s / 60),
        7200..=172_799 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86_400),
    }
}

/// The frame of every page: title, navigation, content.
fn page(title: &str, body: Markup) -> Response {
    page_with(title, body, None)
}

fn page_with(title: &str, body: Markup, refresh: Option<u32>) -> Response {
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if let Some(secs) = refresh {
                    meta http-equiv="refresh" content=(secs);
                }
                title { (title) " · dedupe" }
                link rel="stylesheet" href="/ui/style.css";
            }
            body {
                header {
                    a.brand href="/ui" { "dedupe" }
                    nav { a href="/ui" { "Namespaces" } a href="/ui/jobs" { "Bulk actions" } }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    };
    let mut response = Html(markup.into_string()).into_response();
    // The pages are never framed (no click-jacking of their buttons) and
    // never cached (they show live state and carry the form token).
    let headers = response.headers_mut();
    headers.insert("x-frame-options", HeaderValue::from_static("DENY"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; form-action 'self'; frame-ancestors 'none'",
        ),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// A page saying what went wrong, with the status.
fn problem(status: StatusCode, message: &str) -> Response {
    let mut response = page(
        "Something went wrong",
        html! { p.error { (message) } p { a href="/ui" { "Back to the namespaces" } } },
    );
    *response.status_mut() = status;
    response
}

fn token_field(admin: &Admin) -> Markup {
    html! { input type="hidden" name="csrf_token" value=(admin.auth.csrf); }
}

/// A button that POSTs to `action`, with the anti-forgery token.
fn post_button(admin: &Admin, action: &str, label: &str, class: &str) -> Markup {
    html! {
        form.inline method="post" action=(action) {
            (token_field(admin))
            button class=(class) type="submit" { (label) }
        }
    }
}

fn inbox_or_problem(admin: &Admin) -> Result<&Arc<dyn dedupe_core::Inbox>, Response> {
    inbox_of(admin).map_err(|_| {
        problem(
            StatusCode::NOT_FOUND,
            "This server runs without an inbox (start it with --inbox).",
        )
    })
}

fn store_problem(e: &dedupe_core::Error) -> Response {
    tracing::warn!(error = %e, "dashboard call failed on the store");
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "The store failed (the server's log says why). Reload to try again.",
    )
}

async fn style() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        STYLE,
    )
        .into_response()
}

async fn overview(State(admin): State<Arc<Admin>>) -> Response {
    let inbox = match inbox_or_problem(&admin) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let mut rows = Vec::new();
    for ns in &admin.namespaces {
        match health(&admin, inbox.as_ref(), ns).await {
            Ok(v) => rows.push((ns.clone(), v)),
            Err(e) => return store_problem(&e),
        }
    }
    let body = html! {
        table.counts {
            thead { tr {
                th { "Namespace" } th { "Takes" } th.num { "Pending" } th.num { "Running" }
                th.num { "Failed" } th.num { "Dead" } th { "Oldest due" }
                th { "Finished here, per minute (last 15)" } th {}
            } }
            tbody {
                @for (ns, v) in &rows {
                    @let paused = v["paused"].as_bool().unwrap_or(false);
                    tr id=(format!("ns-{ns}")) {
                        td { a href=(ns_path(ns)) { (ns) } }
                        td { @if paused { span.badge.paused { "paused" } } @else { span.badge { "taking" } } }
                        td.num { (v["pending"]) }
                        td.num { (v["running"]) }
                        td.num { (v["failed"]) }
                        td.num {
                            a href=(format!("{}?state=dead", ns_path(ns))) { (v["dead"]) }
                        }
                        td { @match v["oldest_due_age_ms"].as_u64() {
                            Some(ms) => (human(Duration::from_millis(ms))),
                            None => "-",
                        } }
                        td.spark { (sparkline(&v["processed_per_minute"])) }
                        td {
                            @if paused {
                                (post_button(&admin, &format!("{}/resume", ns_path(ns)), "Resume", "secondary"))
                            } @else {
                                (post_button(&admin, &format!("{}/pause", ns_path(ns)), "Pause", "secondary"))
                            }
                        }
                    }
                }
            }
        }
        p.hint { "Counts are the store's, for every server; the per-minute figures are this server's workers." }
    };
    page("Namespaces", body)
}

/// Per-minute counts as a row of bars, the numbers in their titles.
fn sparkline(counts: &serde_json::Value) -> Markup {
    let counts: Vec<u64> = counts
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
        .unwrap_or_default();
    let top = counts.iter().copied().max().unwrap_or(0).max(1);
    let total: u64 = counts.iter().sum();
    html! {
        span.bars title=(format!("{total} in the last {} minutes", counts.len())) {
            @for c in &counts {
                // Ten heights as classes: the page's policy allows no inline style.
                span class=(format!("bar h{}", (c * 10).div_ceil(top))) title=(c) {}
            }
        }
        " " span.total { (counts.last().copied().unwrap_or(0)) "/min" }
    }
}

fn filter_form(ns: &str, fields: &FilterFields) -> Markup {
    let state = fields.state.as_deref().unwrap_or("");
    html! {
        form.filters method="get" action=(ns_path(ns)) {
            label { "State "
                select name="state" {
                    @for s in ["", "pending", "running", "failed", "dead"] {
                        option value=(s) selected[s == state] { @if s.is_empty() { "any" } @else { (s) } }
                    }
                }
            }
            label { "Error contains " input type="search" name="error" value=(fields.error.as_deref().unwrap_or("")); }
            label { "Ordering key " input type="text" name="ordering_key" value=(fields.ordering_key.as_deref().unwrap_or("")); }
            label { "Attempts ≥ " input.short type="number" min="0" name="min_attempts" value=(fields.min_attempts.as_deref().unwrap_or("")); }
            label { "≤ " input.short type="number" min="0" name="max_attempts" value=(fields.max_attempts.as_deref().unwrap_or("")); }
            label { "Older than (s) " input.short type="number" min="0" name="older_than_secs" value=(fields.older_than_secs.as_deref().unwrap_or("")); }
            label { "Newer than (s) " input.short type="number" min="0" name="newer_than_secs" value=(fields.newer_than_secs.as_deref().unwrap_or("")); }
            button type="submit" { "Filter" }
        }
    }
}

/// Hidden fields carrying a filter through a form.
fn filter_fields(fields: &FilterFields) -> Markup {
    html! {
        @for (name, value) in fields.pairs() {
            input type="hidden" name=(name) value=(value);
        }
    }
}

fn items_table(ns: &str, items: &[Item]) -> Markup {
    html! {
        table.items {
            thead { tr {
                th { "Id" } th { "State" } th.num { "Attempts" } th.num { "Takeovers" }
                th { "Ordering key" } th { "Accepted" } th { "Last error" }
            } }
            tbody {
                @for item in items {
                    tr {
                        td { a href=(item_path(ns, item.key.id())) { (item.key.id()) } }
                        td { span class=(format!("badge {}", item.status.as_str())) { (item.status.as_str()) } }
                        td.num { (item.attempts) @if let Some(m) = item.max_attempts { "/" (m) } }
                        td.num { (item.takeovers) }
                        td { (item.ordering_key.as_deref().unwrap_or("")) }
                        td title=(crate::inbox::rfc3339(item.accepted_at)) { (age(item.accepted_at)) " ago" }
                        td.error { (item.last_error.as_deref().unwrap_or("")) }
                    }
                }
            }
        }
    }
}

async fn namespace(
    State(admin): State<Arc<Admin>>,
    Path(ns): Path<String>,
    Query(fields): Query<FilterFields>,
    Query(page_at): Query<PageFields>,
) -> Response {
    let inbox = match inbox_or_problem(&admin) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let filter = match fields.filter(&ns) {
        Ok(f) => f,
        Err(e) => return problem(StatusCode::BAD_REQUEST, &e),
    };
    let after = page_at.after.filter(|a| !a.is_empty());
    let found = match search_items(inbox.as_ref(), &filter, after, 50, SEARCH_BUDGET).await {
        Ok(found) => found,
        Err(e) => return store_problem(&e),
    };
    let paused = match inbox.paused(&ns).await {
        Ok(p) => p,
        Err(e) => return store_problem(&e),
    };
    let fields = FilterFields::of(&filter);
    let next = found.next.as_ref().map(|next| {
        let mut pairs = fields.pairs();
        pairs.push(("after", next.clone()));
        format!("{}{}", ns_path(&ns), query_string(&pairs))
    });
    let body = html! {
        p {
            @if paused { span.badge.paused { "paused" } " " (post_button(&admin, &format!("{}/resume", ns_path(&ns)), "Resume", "secondary")) }
            @else { span.badge { "taking" } " " (post_button(&admin, &format!("{}/pause", ns_path(&ns)), "Pause", "secondary")) }
        }
        (filter_form(&ns, &fields))
        @if found.items.is_empty() {
            p #no-items { "No item matches." }
        } @else {
            (items_table(&ns, &found.items))
        }
        p.hint {
            (found.items.len()) " shown, " (found.scanned) " read."
            @if let Some(next) = &next { " " a #next href=(next) { "Next page →" } }
        }
        section.bulk {
            h2 { "Every item matching this filter" }
            p { "Each action first counts the matching items and asks you to confirm." }
            @for (action, label) in [("replay", "Replay matching items…"), ("forget", "Forget matching items…")] {
                form.inline method="post" action=(format!("{}/bulk/confirm", ns_path(&ns))) {
                    (token_field(&admin))
                    (filter_fields(&fields))
                    input type="hidden" name="action" value=(action);
                    button type="submit" id=(format!("bulk-{action}")) class=(if action == "forget" { "danger" } else { "" }) { (label) }
                }
            }
        }
    };
    page(&format!("Namespace {ns}"), body)
}

async fn item(
    State(admin): State<Arc<Admin>>,
    Path((ns, id)): Path<(String, String)>,
    Query(said): Query<Said>,
) -> Response {
    let inbox = match inbox_or_problem(&admin) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let key = match key_of(&ns, &id) {
        Ok(k) => k,
        Err(_) => return problem(StatusCode::BAD_REQUEST, "Not a valid key."),
    };
    let item = match inbox.item(&key).await {
        Ok(Some(item)) => item,
        Ok(None) => {
            let completed = match super::api::completed_at(inbox.as_ref(), &key).await {
                Ok(at) => at,
                Err(e) => return store_problem(&e),
            };
            return page(
                &format!("Item {id}"),
                html! {
                    @if let Some(done) = said.done.as_deref().and_then(notice) { p.notice #notice { (done) } }
                    @if let Some(at) = completed {
                        dl.facts {
                            dt { "State" } dd #state { span.badge.done { "completed" } }
                            dt { "Completed" } dd { (crate::inbox::rfc3339(at)) " (" (age(at)) " ago)" }
                        }
                        p.hint { "Its deliveries are duplicates now, until the store's retention removes the record." }
                    } @else {
                        p #no-item { "The namespace holds no item " code { (id) } " (forgotten, past its retention, or never accepted)." }
                    }
                    p { a href=(ns_path(&ns)) { "Back to " (ns) } }
                },
            );
        }
        Err(e) => return store_problem(&e),
    };
    let detail = detail_json(&item);
    let path = item_path(&ns, &id);
    let body = html! {
        @if let Some(done) = said.done.as_deref().and_then(notice) { p.notice #notice { (done) } }
        dl.facts {
            dt { "State" } dd #state { span class=(format!("badge {}", item.status.as_str())) { (item.status.as_str()) } }
            dt { "Attempts" } dd { (item.attempts) @if let Some(m) = item.max_attempts { " of " (m) } }
            dt { "Takeovers" } dd { (item.takeovers) }
            dt { "Ordering key" } dd { (item.ordering_key.as_deref().unwrap_or("none")) }
            dt { "Accepted" } dd { (crate::inbox::rfc3339(item.accepted_at)) " (" (age(item.accepted_at)) " ago)" }
            dt { @match item.status.as_str() { "running" => "Lease until", "dead" => "Died", _ => "Due" } }
            dd { (crate::inbox::rfc3339(item.due_at)) }
            dt { "Last error" } dd #last-error.error { (item.last_error.as_deref().unwrap_or("none")) }
        }
        p {
            (post_button(&admin, &format!("{path}/replay"), "Replay", ""))
            " "
            (post_button(&admin, &format!("{path}/forget"), "Forget", "danger"))
        }
        h2 { "Errors" }
        @if item.errors.is_empty() { p { "None recorded." } }
        @else {
            table { thead { tr { th.num { "Attempt" } th { "At" } th { "Error" } } }
                tbody { @for e in &item.errors {
                    tr { td.num { (e.attempt) } td { (crate::inbox::rfc3339(e.at)) } td.error { (e.error) } }
                } }
            }
        }
        h2 { "Delivery" }
        @if let Some(delivery) = detail["delivery"].as_object() {
            dl.facts {
                dt { "Event id" } dd { (delivery["event_id"].as_str().unwrap_or("-")) }
                dt { "Delivery id" } dd { (delivery["delivery_id"].as_str().unwrap_or("-")) }
            }
            h3 { "Headers (credentials are never stored)" }
            table.headers { tbody {
                @for h in delivery["headers"].as_array().into_iter().flatten() {
                    tr { td { (h[0].as_str().unwrap_or("")) } td { (h[1].as_str().unwrap_or("")) } }
                }
            } }
        } @else {
            p { "Not a stored webhook delivery: the payload as it is." }
        }
        h3 { "Payload"
            @if detail["payload_truncated"].as_bool() == Some(true) { " (the first " (super::api::PREVIEW_BYTES) " bytes)" } }
        pre.payload { (detail["payload_preview"].as_str().unwrap_or("")) }
        p { a href=(ns_path(&ns)) { "Back to " (ns) } }
    };
    page(&format!("Item {id}"), body)
}

#[derive(Deserialize)]
struct Said {
    #[serde(default)]
    done: Option<String>,
}

/// Back to `path` with the code of what was done ([`notice`]).
fn done(path: &str, code: &str) -> Response {
    Redirect::to(&format!(
        "{path}{}",
        query_string(&[("done", code.to_string())])
    ))
    .into_response()
}

async fn replay(
    State(admin): State<Arc<Admin>>,
    Path((ns, id)): Path<(String, String)>,
) -> Response {
    let inbox = match inbox_or_problem(&admin) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let Ok(key) = key_of(&ns, &id) else {
        return problem(StatusCode::BAD_REQUEST, "Not a valid key.");
    };
    match super::api::replay_one(inbox.as_ref(), &key).await {
        Ok(true) => done(&item_path(&ns, &id), "replayed"),
        Ok(false) => done(&item_path(&ns, &id), "not-replayed"),
        Err(e) => store_problem(&e),
    }
}

async fn forget(
    State(admin): State<Arc<Admin>>,
    Path((ns, id)): Path<(String, String)>,
) -> Response {
    let inbox = match inbox_or_problem(&admin) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let Ok(key) = key_of(&ns, &id) else {
        return problem(StatusCode::BAD_REQUEST, "Not a valid key.");
    };
    match inbox.forget(&key).await {
        Ok(true) => done(&item_path(&ns, &id), "forgotten"),
        Ok(false) => done(&item_path(&ns, &id), "not-forgotten"),
        Err(e) => store_problem(&e),
    }
}

async fn pause(State(admin): State<Arc<Admin>>, Path(ns): Path<String>) -> Response {
    pause_or_resume(&admin, &ns, true).await
}

async fn resume(State(admin): State<Arc<Admin>>, Path(ns): Path<String>) -> Response {
    pause_or_resume(&admin, &ns, false).await
}

async fn pause_or_resume(admin: &Admin, ns: &str, pause: bool) -> Response {
    let answer = super::api::pause_or_resume(admin, ns, pause).await;
    if answer.status().is_success() {
        Redirect::to(&ns_path(ns)).into_response()
    } else {
        problem(
            answer.status(),
            "The namespace could not be paused or resumed.",
        )
    }
}

/// A bulk form: the action and the filter's fields.
#[derive(Deserialize)]
struct BulkForm {
    action: String,
    #[serde(flatten)]
    filter: FilterFields,
}

fn bulk_of(ns: &str, form: &BulkForm) -> Result<(BulkAction, ItemFilter), Response> {
    let action = form
        .action
        .parse::<BulkAction>()
        .map_err(|e| problem(StatusCode::BAD_REQUEST, &e.to_string()))?;
    let filter = form
        .filter
        .filter(ns)
        .map_err(|e| problem(StatusCode::BAD_REQUEST, &e))?;
    Ok((action, filter))
}

/// The dry run: how many items match, and the button that acts on them.
async fn confirm(
    State(admin): State<Arc<Admin>>,
    Path(ns): Path<String>,
    Form(form): Form<BulkForm>,
) -> Response {
    let inbox = match inbox_or_problem(&admin) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let (action, filter) = match bulk_of(&ns, &form) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let matched = match count_items(inbox.as_ref(), &filter).await {
        Ok(n) => n,
        Err(e) => return store_problem(&e),
    };
    let fields = FilterFields::of(&filter);
    let verb = match action {
        BulkAction::Replay => "Replay",
        BulkAction::Forget => "Forget",
    };
    let body = html! {
        p #dry-run { strong #matched { (matched) } " item" @if matched != 1 { "s" } " of " (ns) @if matched == 1 { " matches" } @else { " match" } " this filter now." }
        (describe(&fields))
        @if matched > 0 {
            p { @match action {
                BulkAction::Replay => "Replaying makes each dead item (or failed item waiting for its retry) due now; items that changed meanwhile are left alone.",
                BulkAction::Forget => "Forgetting removes each item that still matches when it is reached: its next delivery is accepted anew. This cannot be undone.",
            } }
            form.inline method="post" action=(format!("{}/bulk", ns_path(&ns))) {
                (token_field(&admin))
                (filter_fields(&fields))
                input type="hidden" name="action" value=(action.as_str());
                button #confirm type="submit" class=(if action == BulkAction::Forget { "danger" } else { "" }) {
                    (verb) " " (matched) " item" @if matched != 1 { "s" }
                }
            }
            " "
        }
        a href=(format!("{}{}", ns_path(&ns), query_string(&fields.pairs()))) { "Cancel" }
    };
    page(&format!("{verb} by filter"), body)
}

fn describe(fields: &FilterFields) -> Markup {
    let pairs = fields.pairs();
    html! {
        @if pairs.is_empty() { p { "Filter: every item of the namespace." } }
        @else {
            p { "Filter: " @for (i, (name, value)) in pairs.iter().enumerate() {
                @if i > 0 { ", " } (name) " = " code { (value) }
            } }
        }
    }
}

async fn start(
    State(admin): State<Arc<Admin>>,
    Path(ns): Path<String>,
    Form(form): Form<BulkForm>,
) -> Response {
    let inbox = match inbox_or_problem(&admin) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let (action, filter) = match bulk_of(&ns, &form) {
        Ok(b) => b,
        Err(r) => return r,
    };
    match admin.jobs.start(Arc::clone(inbox), filter, action) {
        Ok(job) => Redirect::to(&format!("/ui/jobs/{}", job.id)).into_response(),
        Err(busy) => problem(StatusCode::TOO_MANY_REQUESTS, &busy),
    }
}

async fn jobs(State(admin): State<Arc<Admin>>) -> Response {
    let all = admin.jobs.all();
    let body = html! {
        @if all.is_empty() { p { "No bulk action has run on this server." } }
        @else {
            table { thead { tr { th { "Job" } th { "Action" } th { "Namespace" } th { "State" } th.num { "Done" } th.num { "Skipped" } th { "Started" } } }
                tbody { @for job in &all {
                    @let v = job.json();
                    tr {
                        td { a href=(format!("/ui/jobs/{}", job.id)) { "#" (job.id) } }
                        td { (v["action"].as_str().unwrap_or("")) }
                        td { (job.bulk.filter().namespace) }
                        td { (v["state"].as_str().unwrap_or("")) }
                        td.num { (v["done"]) }
                        td.num { (v["skipped"]) }
                        td { (v["started_at"].as_str().unwrap_or("")) }
                    }
                } }
            }
        }
    };
    page("Bulk actions", body)
}

async fn job(State(admin): State<Arc<Admin>>, Path(id): Path<String>) -> Response {
    let Some(job) = id.parse().ok().and_then(|id| admin.jobs.get(id)) else {
        return problem(StatusCode::NOT_FOUND, "No such bulk action on this server.");
    };
    let v = job.json();
    let state = v["state"].as_str().unwrap_or("").to_string();
    let running = state == "running";
    let ns = job.bulk.filter().namespace.clone();
    let fields = FilterFields::of(job.bulk.filter());
    let body = html! {
        p { "A " (v["action"].as_str().unwrap_or("")) " of " a href=(ns_path(&ns)) { (ns) } ", started " (v["started_at"].as_str().unwrap_or("")) "." }
        (describe(&fields))
        dl.facts {
            dt { "State" } dd #job-state { (state) }
            dt { "Read" } dd { (v["scanned"]) }
            dt { "Matched" } dd #job-matched { (v["matched"]) }
            dt { "Done" } dd #job-done { (v["done"]) }
            dt { "Left alone" } dd { (v["skipped"]) " (changed by a worker or another operator meanwhile)" }
            @if let Some(e) = v["error"].as_str() { dt { "Error" } dd.error { (e) } }
        }
        @if running {
            (post_button(&admin, &format!("/ui/jobs/{}/cancel", job.id), "Cancel", "danger"))
            p.hint { "This page reloads every second while the action runs." }
        }
        p { a href=(format!("{}{}", ns_path(&ns), query_string(&fields.pairs()))) { "Back to the filtered items" } }
    };
    page_with(
        &format!("Bulk action #{}", job.id),
        body,
        running.then_some(1),
    )
}

async fn cancel(State(admin): State<Arc<Admin>>, Path(id): Path<String>) -> Response {
    match id.parse().ok().and_then(|id| admin.jobs.get(id)) {
        Some(job) => {
            job.bulk.cancel();
            Redirect::to(&format!("/ui/jobs/{}", job.id)).into_response()
        }
        None => problem(StatusCode::NOT_FOUND, "No such bulk action on this server."),
    }
}

async fn login_page(State(admin): State<Arc<Admin>>) -> Response {
    if admin.auth.token.is_none() {
        return Redirect::to("/ui").into_response();
    }
    page(
        "Sign in",
        html! {
            form method="post" action="/ui/login" {
                label { "Admin token " input type="password" name="token" autocomplete="current-password" autofocus; }
                " " button type="submit" { "Sign in" }
            }
            p.hint { "The token the server was given (--admin-token-file or DEDUPE_ADMIN_TOKEN)." }
        },
    )
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
}

/// What a state-changing page did, as the `?done=` code it redirects with:
/// the page shows the text for a known code, nothing for anything else.
fn notice(code: &str) -> Option<&'static str> {
    Some(match code {
        "replayed" => "Replayed: the item is due now.",
        "not-replayed" => {
            "Not replayed: it is no dead item nor a failed one waiting for its retry."
        }
        "forgotten" => "Forgotten: its next delivery is accepted anew.",
        "not-forgotten" => "There was nothing to forget.",
        _ => return None,
    })
}

async fn login(State(admin): State<Arc<Admin>>, Form(form): Form<LoginForm>) -> Response {
    match (&admin.auth.token, &admin.auth.session) {
        (Some(token), Some(session)) if same(form.token.trim(), token) => {
            let mut response = Redirect::to("/ui").into_response();
            let cookie = format!("{COOKIE}={session}; Path=/; HttpOnly; SameSite=Strict");
            if let Ok(value) = HeaderValue::from_str(&cookie) {
                response.headers_mut().insert(header::SET_COOKIE, value);
            }
            response
        }
        (Some(_), _) => problem(StatusCode::UNAUTHORIZED, "That is not the admin token."),
        _ => Redirect::to("/ui").into_response(),
    }
}

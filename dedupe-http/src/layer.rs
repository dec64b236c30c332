//! The layer: which requests it guards, how it keys and fingerprints them,
//! and what it answers.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use dedupe_core::{
    ClaimOptions, ClaimOutcome, Deduper, Error, Fingerprint, Key, Lease, RecordState, Settle,
    Worked,
};
use futures_util::future::BoxFuture;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use sha2::{Digest, Sha256};
use tower::{Layer, Service, ServiceExt};

use crate::answer::{count, Answer, OnMismatch};
use crate::header::{IdempotencyKey, KeyError};
use crate::stored::{StoredResponse, REPLAYED};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Whether a request needs an `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyPolicy {
    /// Without a key: 400 (the draft's answer).
    Required,
    /// With a key: run once; without: run as usual.
    Optional,
    /// The layer lets the request through untouched, key or not.
    Ignored,
}

/// What to do with a response over [`Idempotency::max_response_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LargeResponse {
    /// Answer 500 (a problem saying so) in its place and keep that problem as
    /// the request's outcome: the handler ran once and never runs again for
    /// this key; its response is lost, so raise the limit for such routes.
    /// The default: a retry never runs the work twice.
    Refuse,
    /// Send the response and release the claim: nothing is kept, and a retry
    /// with the key runs the handler again.
    PassAndRelease,
}

/// A request's key decided in front of the layer, by a layer that checked
/// the request first (dedupe-webhook's signature check puts one on every
/// delivery it lets through): with [`Idempotency::keyed_by_extension`], the
/// layer claims this key instead of reading the `Idempotency-Key` header.
#[derive(Debug, Clone)]
pub struct RequestKey {
    /// The store key, namespace included.
    pub key: Key,
    /// What makes two requests with the key the same one (`None`: the key
    /// alone decides).
    pub fingerprint: Option<Fingerprint>,
    /// What the key with another fingerprint gets.
    pub on_mismatch: OnMismatch,
}

/// Where the layer finds a request's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeySource {
    /// The `Idempotency-Key` header, scoped and hashed.
    Header,
    /// A [`RequestKey`] extension.
    Extension,
}

type PolicyFn = dyn Fn(&Parts) -> KeyPolicy + Send + Sync;
type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type StatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// `Idempotency-Key` for an HTTP API, on any dedupe store: the first request
/// with a key runs the handler; a retry of the same request gets the stored
/// response (marked `Idempotent-Replayed: true`); one sent while the first
/// runs gets 409 with `Retry-After`; the same key on another request, 422;
/// a store outage, 503 and nothing run.
///
/// The lifecycle is the [`Deduper`]'s: the handler runs in a task of its own
/// (a client that disconnects does not stop it, and its claim is settled
/// when it ends), its lease beats beside it, a panic releases the claim.
///
/// ```
/// use dedupe_core::{Deduper, MemoryStore};
/// use dedupe_http::{Idempotency, KeyPolicy};
/// use http::Method;
///
/// // Keys are per caller: one client can neither replay nor block
/// // another's requests. A POST or PATCH without a key is refused (400).
/// let layer = Idempotency::scoped(Deduper::new(MemoryStore::new()), |req| {
///     req.headers.get("authorization")?.to_str().ok().map(String::from)
/// })
/// .layer();
/// # let _ = layer;
/// // A route whose clients cannot all send a key yet, on one caller's API:
/// let lenient = Idempotency::single_caller(Deduper::new(MemoryStore::new())).keys_optional();
/// # let _ = (lenient, KeyPolicy::Required, Method::POST);
/// ```
#[derive(Clone)]
pub struct Idempotency {
    deduper: Deduper,
    namespace: String,
    policy: Arc<PolicyFn>,
    scope: Option<Arc<ScopeFn>>,
    fingerprint: Option<Vec<HeaderName>>,
    stored_statuses: Arc<StatusFn>,
    max_request_bytes: usize,
    max_response_bytes: usize,
    large_response: LargeResponse,
    wait: Option<Duration>,
    never_replayed: Vec<HeaderName>,
    source: KeySource,
    acknowledge_foreign: bool,
}

impl fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("namespace", &self.namespace)
            .field("scoped", &self.scope.is_some())
            .field("fingerprint", &self.fingerprint)
            .field("deduper", &self.deduper)
            .field("max_request_bytes", &self.max_request_bytes)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("large_response", &self.large_response)
            .field("wait", &self.wait)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

/// The statuses kept by default: 2xx, and 4xx but those a retry may answer
/// otherwise (408 Request Timeout, 409 Conflict, 425 Too Early, 429 Too Many
/// Requests). A 5xx is never kept by default: the claim is released and the
/// client's retry runs again.
pub fn stored_by_default(status: StatusCode) -> bool {
    status.is_success()
        || (status.is_client_error() && !matches!(status.as_u16(), 408 | 409 | 425 | 429))
}

impl Idempotency {
    /// Default request body limit: 1 MiB.
    pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;
    /// Default response body limit: 256 KiB.
    pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 256 * 1024;

    /// The layer's settings over `deduper`, whose policy is the layer's
    /// lifecycle: its store, lease and heartbeat (on by default, so a
    /// handler slower than the lease is not run a second time by a retry
    /// arriving after it), the bound on a handler's run
    /// ([`Deduper::with_max_work_time`], 10 minutes by default), and how
    /// long stored responses answer retries (its
    /// [`Retention`](dedupe_core::Retention) for the layer's namespace, 35
    /// days by default; Stripe keeps keys 24 hours, and a shorter retention
    /// is a `Retention::with_namespace("http", ...)` away). Besides:
    /// namespace `http`; **a key required on POST and PATCH** (400 without
    /// one: a retried POST without a key would run twice) and ignored on
    /// other methods; keys **scoped by `scope`**, the caller a request comes
    /// from (an authenticated principal, an API key, a tenant), and by
    /// method and path, so one caller's key never meets another's (`None`
    /// from it is a scope of its own, the anonymous callers; the scope is
    /// hashed into the store key, never stored as is); the fingerprint over
    /// method, path and query, `Content-Type` and the body; the limits
    /// above.
    ///
    /// There is no constructor without a scope but
    /// [`single_caller`](Self::single_caller): without one, two clients
    /// that pick the same key for the same path meet, and the second gets
    /// the first's response.
    ///
    /// ```compile_fail
    /// // No layer without a decision about callers:
    /// let layer = dedupe_http::Idempotency::new(dedupe_core::Deduper::new(
    ///     dedupe_core::MemoryStore::new(),
    /// ));
    /// ```
    pub fn scoped(
        deduper: Deduper,
        scope: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        Self::with_scope(deduper, Some(Arc::new(scope)))
    }

    /// As [`scoped`](Self::scoped), for an API with one caller (or callers
    /// that may see each other's responses): every request shares one key
    /// space.
    pub fn single_caller(deduper: Deduper) -> Self {
        Self::with_scope(deduper, None)
    }

    /// The engine under another front door: it keys requests by the
    /// [`RequestKey`] a layer in front of this one put in their extensions,
    /// not by the header (dedupe-webhook keys deliveries by their provider's
    /// event id this way). Every method needs one; the scope, the namespace
    /// and the fingerprint are the front layer's to apply.
    pub fn keyed_by_extension(deduper: Deduper) -> Self {
        let mut engine = Self::with_scope(deduper, None).policy(|_| KeyPolicy::Required);
        engine.source = KeySource::Extension;
        engine
    }

    fn with_scope(deduper: Deduper, scope: Option<Arc<ScopeFn>>) -> Self {
        Self {
            deduper,
            namespace: "http".into(),
            policy: Arc::new(|req: &Parts| match req.method {
                Method::POST | Method::PATCH => KeyPolicy::Required,
                _ => KeyPolicy::Ignored,
            }),
            scope,
            fingerprint: Some(vec![http::header::CONTENT_TYPE]),
            stored_statuses: Arc::new(stored_by_default),
            max_request_bytes: Self::DEFAULT_MAX_REQUEST_BYTES,
            max_response_bytes: Self::DEFAULT_MAX_RESPONSE_BYTES,
            large_response: LargeResponse::Refuse,
            wait: None,
            never_replayed: Vec::new(),
            source: KeySource::Header,
            acknowledge_foreign: false,
        }
    }

    /// A done record whose outcome is not a kept response (the key was
    /// completed by other code: an inbox worker, a handler of another
    /// version) is answered 200 with `{"duplicate": true, "key": ...}`,
    /// marked replayed, instead of 500 `corrupt-stored-response`. For
    /// webhook senders, which need only to hear that the event was
    /// processed.
    pub fn acknowledge_foreign_outcomes(mut self) -> Self {
        self.acknowledge_foreign = true;
        self
    }

    /// The store namespace of the keys (default `http`).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// Which requests need a key, which may carry one, which the layer
    /// leaves alone (default: required on POST and PATCH, ignored on the
    /// rest).
    pub fn policy(mut self, policy: impl Fn(&Parts) -> KeyPolicy + Send + Sync + 'static) -> Self {
        self.policy = Arc::new(policy);
        self
    }

    /// Keys optional on POST and PATCH (a request without one runs
    /// unprotected), for the routes of a layer whose clients cannot all
    /// send one yet; the opt-out of the default.
    pub fn keys_optional(self) -> Self {
        self.policy(|req| match req.method {
            Method::POST | Method::PATCH => KeyPolicy::Optional,
            _ => KeyPolicy::Ignored,
        })
    }

    /// The request headers, besides method, path, query and body, that make
    /// two requests the same (default: `Content-Type`).
    pub fn fingerprint_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.fingerprint = Some(headers.into_iter().collect());
        self
    }

    /// No fingerprint: a key reused with another request gets the first
    /// request's response instead of 422.
    pub fn without_fingerprint(mut self) -> Self {
        self.fingerprint = None;
        self
    }

    /// How long a stored response answers retries: the deduper's retention
    /// of the layer's namespace.
    pub fn retention(&self) -> Duration {
        self.deduper.retention().for_namespace(&self.namespace)
    }

    /// Which statuses are kept as the request's outcome; any other releases
    /// the claim, so the retry runs the handler again (default:
    /// [`stored_by_default`]).
    pub fn stored_statuses(
        mut self,
        stored: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.stored_statuses = Arc::new(stored);
        self
    }

    /// The largest request body read (default 1 MiB; larger: 413, nothing
    /// written).
    pub fn max_request_bytes(mut self, limit: usize) -> Self {
        self.max_request_bytes = limit;
        self
    }

    /// The largest response body kept (default 256 KiB), and what to do with
    /// a larger one.
    pub fn max_response_bytes(mut self, limit: usize, larger: LargeResponse) -> Self {
        self.max_response_bytes = limit;
        self.large_response = larger;
        self
    }

    /// A request sent while the first with its key runs waits up to `bound`
    /// for the first's outcome (its replay), instead of 409 at once; past the
    /// bound, 409.
    pub fn wait_for_in_flight(mut self, bound: Duration) -> Self {
        self.wait = Some(bound);
        self
    }

    /// Response headers never replayed, besides
    /// [`NEVER_REPLAYED`](crate::NEVER_REPLAYED).
    pub fn never_replay(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.never_replayed.extend(headers);
        self
    }

    /// The tower layer.
    pub fn layer(self) -> IdempotencyLayer {
        IdempotencyLayer {
            config: Arc::new(self),
        }
    }

    /// The store key of a request through this layer: [`key_in`](Self::key_in)
    /// its namespace.
    pub fn store_key(
        &self,
        scope: Option<&str>,
        method: &Method,
        path: &str,
        key: &IdempotencyKey,
    ) -> Result<Key, dedupe_core::KeyError> {
        Self::key_in(&self.namespace, scope, method, path, key)
    }

    /// The store key of a request in a layer's `namespace`: the namespace
    /// and the SHA-256 (hex) of the scope (the caller, `None` for a
    /// [`single_caller`](Self::single_caller) layer or an anonymous caller),
    /// method, path and client key, each length-prefixed. What `dedupe
    /// inspect --idempotency-key` computes, so an operator finds one
    /// request's record from what they know of it.
    ///
    /// ```
    /// use dedupe_http::{Idempotency, IdempotencyKey};
    /// let key = IdempotencyKey::parse(b"order-7")?;
    /// let stored = Idempotency::key_in("orders", Some("alice"), &http::Method::POST, "/orders", &key)?;
    /// assert_eq!(stored.namespace(), "orders");
    /// assert_eq!(stored.id().len(), 64);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn key_in(
        namespace: &str,
        scope: Option<&str>,
        method: &Method,
        path: &str,
        key: &IdempotencyKey,
    ) -> Result<Key, dedupe_core::KeyError> {
        let mut hash = Sha256::new();
        match scope {
            Some(scope) => {
                hash.update([1]);
                part(&mut hash, scope.as_bytes());
            }
            None => hash.update([0]),
        }
        part(&mut hash, method.as_str().as_bytes());
        part(&mut hash, path.as_bytes());
        part(&mut hash, key.as_str().as_bytes());
        Key::new(namespace, hex::encode(hash.finalize()))
    }

    fn fingerprint_of(&self, req: &Parts, body: &[u8]) -> Option<Fingerprint> {
        let headers = self.fingerprint.as_ref()?;
        let mut hash = Sha256::new();
        part(&mut hash, req.method.as_str().as_bytes());
        part(
            &mut hash,
            req.uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .as_bytes(),
        );
        for name in headers {
            part(&mut hash, name.as_str().as_bytes());
            for value in req.headers.get_all(name) {
                part(&mut hash, value.as_bytes());
            }
            hash.update([0xff]);
        }
        part(&mut hash, body);
        Some(Fingerprint::sha256(&hash.finalize()))
    }
}

fn part(hash: &mut Sha256, bytes: &[u8]) {
    hash.update((bytes.len() as u64).to_be_bytes());
    hash.update(bytes);
}

/// What the handler of a keyed request finds in its request's extensions:
/// its lease, for a handler that completes inside its own SQL transaction
/// (`complete_in` of the Postgres or SQLite store) so that its writes and
/// the stored response commit together.
///
/// It is a request extension, not an extractor: in axum, take it as
/// `Extension<Idempotent>` (below); elsewhere,
/// `request.extensions().get::<Idempotent>()`.
///
/// ```no_run
/// use axum::Extension;
/// use dedupe_http::Idempotent;
/// # async fn handler(
/// Extension(idem): Extension<Idempotent>,
/// #     store: dedupe_postgres::PgStore,
/// #     pool: sqlx::PgPool,
/// # ) -> Result<http::Response<http_body_util::Full<bytes::Bytes>>, Box<dyn std::error::Error>> {
/// use dedupe_http::StoredResponse;
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (item) VALUES ('book')").execute(&mut *tx).await?;
/// let response = StoredResponse::new(http::StatusCode::CREATED).body("{\"id\":1}");
/// store.complete_in(&mut tx, idem.lease(), &response.encode(), idem.retention()).await?;
/// tx.commit().await?;
/// idem.completed(); // the layer stores nothing more
/// Ok(response.into_http())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Idempotent {
    lease: Lease,
    retention: Duration,
    settled: Arc<AtomicBool>,
}

impl Idempotent {
    /// The request's lease.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// How long the layer keeps responses.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// Says the handler completed (or released) the lease itself: the layer
    /// sends the handler's response as it is and settles nothing. Call it
    /// after the commit.
    pub fn completed(&self) {
        self.settled.store(true, Ordering::SeqCst);
    }
}

/// The tower layer [`Idempotency::layer`] makes.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    config: Arc<Idempotency>,
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            config: Arc::clone(&self.config),
            inner,
        }
    }
}

/// The service [`IdempotencyLayer`] makes, over any service whose request
/// and response bodies are built from bytes (axum's `Body`, http-body-util's
/// `Full`).
#[derive(Debug, Clone)]
pub struct IdempotencyService<S> {
    config: Arc<Idempotency>,
    inner: S,
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for IdempotencyService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body + From<Bytes> + Send + 'static,
    ReqB::Data: Send,
    ReqB::Error: Into<BoxError>,
    ResB: Body + From<Bytes> + Send + 'static,
    ResB::Data: Send,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response<ResB>, S::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is checked on the clone that runs the request (`oneshot`).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let config = Arc::clone(&self.config);
        let inner = self.inner.clone();
        Box::pin(handle(config, inner, req))
    }
}

/// What the held work hands back.
enum Ran<ResB, E> {
    /// The response to send, and what it answers.
    Respond(Response<ResB>, Answer),
    /// The inner service failed: its error is the layer's.
    Failed(E),
}

/// A keyed request's key, as found before its body is read.
enum Found {
    Header(IdempotencyKey),
    Extension(RequestKey),
}

async fn handle<S, ReqB, ResB>(
    config: Arc<Idempotency>,
    inner: S,
    req: Request<ReqB>,
) -> Result<Response<ResB>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body + From<Bytes> + Send + 'static,
    ReqB::Data: Send,
    ReqB::Error: Into<BoxError>,
    ResB: Body + From<Bytes> + Send + 'static,
    ResB::Data: Send,
    ResB::Error: Into<BoxError>,
{
    let started = Instant::now();
    let (mut parts, body) = req.into_parts();
    let policy = (config.policy)(&parts);
    if policy == KeyPolicy::Ignored {
        return inner.oneshot(Request::from_parts(parts, body)).await;
    }
    let found = match config.source {
        KeySource::Header => {
            IdempotencyKey::from_headers(&parts.headers).map(|k| k.map(Found::Header))
        }
        KeySource::Extension => Ok(parts
            .extensions
            .remove::<RequestKey>()
            .map(Found::Extension)),
    };
    let refused = |response: Response<ResB>| {
        count(&config.namespace, started, &response);
        Ok(response)
    };
    let found = match found {
        Ok(Some(found)) => found,
        Ok(None) if policy == KeyPolicy::Optional => {
            return inner.oneshot(Request::from_parts(parts, body)).await
        }
        Ok(None) => return refused(bad_key(&KeyError::Missing)),
        Err(e) => return refused(bad_key(&e)),
    };
    let body = match Limited::new(body, config.max_request_bytes).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return refused(Answer::TooLarge.problem(
                &format!(
                    "the request body is over {} bytes; nothing was run",
                    config.max_request_bytes
                ),
                None,
            ))
        }
        Err(e) => {
            return refused(Answer::BadRequest.problem(
                &format!("the request body could not be read ({e}); nothing was run"),
                None,
            ))
        }
    };
    let keyed = match found {
        Found::Extension(keyed) => keyed,
        Found::Header(key) => {
            let scope = config.scope.as_ref().map(|f| f(&parts));
            match config.store_key(
                // An extractor's `None` (anonymous) is not `Some("")`.
                scope.as_ref().and_then(|s| s.as_deref()),
                &parts.method,
                parts.uri.path(),
                &key,
            ) {
                Ok(store_key) => RequestKey {
                    key: store_key,
                    fingerprint: config.fingerprint_of(&parts, &body),
                    on_mismatch: OnMismatch::Refuse,
                },
                Err(e) => return refused(bad_key(&e)),
            }
        }
    };
    // From here the request is a task of the deduper's: the claim, the
    // handler and the settlement run to their end even when the client goes
    // away (a claim made in the request's own future would be left held
    // until its lease passed by a client that left right after it), and the
    // request only awaits the answer. One task for the whole path: the claim
    // and the handler do not hop between tasks.
    let deduper = config.deduper.clone();
    let task = deduper.spawn(async move {
        let namespace = keyed.key.namespace().to_string();
        let answered = claim(config, inner, parts, body, keyed).await;
        if let Ok(response) = &answered {
            count(&namespace, started, response);
        }
        answered
    });
    match task {
        Ok(task) => match task.await {
            Ok(answered) => answered,
            Err(e) => {
                tracing::error!(error = %e, "the request's task ended early");
                Ok(Answer::Panicked.problem(
                    "the request's task ended early; a retry runs it again",
                    None,
                ))
            }
        },
        Err(_) => Ok(Answer::Unavailable.problem(
            "the server is shutting down; nothing was run",
            Some(Duration::from_secs(5)),
        )),
    }
}

/// Claims the request's key, then runs the handler under the claim, or
/// answers what the claim found.
async fn claim<S, ReqB, ResB>(
    config: Arc<Idempotency>,
    inner: S,
    parts: Parts,
    body: Bytes,
    keyed: RequestKey,
) -> Result<Response<ResB>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: From<Bytes> + Send + 'static,
    ResB: Body + From<Bytes> + Send + 'static,
    ResB::Data: Send,
    ResB::Error: Into<BoxError>,
{
    let key = keyed.key;
    let mut opts = ClaimOptions::new(config.deduper.lease_ttl());
    if let Some(fp) = keyed.fingerprint {
        opts = opts.with_fingerprint(fp);
    }
    // A bound of a year or more (`Duration::MAX`, say) waits a year: past
    // what `Instant` holds, the addition would panic.
    let waiting_until = config
        .wait
        .map(|bound| Instant::now() + bound.min(Duration::from_secs(365 * 86_400)));
    let mut poll = Duration::from_millis(25);
    loop {
        match config.deduper.store().claim(&key, &opts).await {
            Err(e) => return Ok(store_error(&key, &e)),
            Ok(ClaimOutcome::Duplicate { outcome, .. }) => {
                return Ok(replay(&config, &key, &outcome, Answer::Replayed))
            }
            Ok(ClaimOutcome::Mismatch { .. }) if keyed.on_mismatch == OnMismatch::Replay => {
                return Ok(mismatch_replay(&config, &key).await)
            }
            Ok(ClaimOutcome::Mismatch { .. }) => {
                return Ok(Answer::Mismatch.problem(
                    "this key was used with another request (method, path, headers or body \
                     differ); nothing was run",
                    None,
                ))
            }
            Ok(ClaimOutcome::InFlight { deadline, .. }) => {
                if waiting_until.is_some_and(|until| Instant::now() + poll < until) {
                    tokio::time::sleep(poll).await;
                    poll = (poll * 2).min(Duration::from_millis(500));
                    continue;
                }
                return Ok(in_flight(deadline));
            }
            Ok(ClaimOutcome::Claimed(lease)) => {
                return run(config, inner, parts, body, lease).await;
            }
        }
    }
}

/// Runs the handler under `lease` in a task of the `Deduper`, then keeps
/// its response, or releases the claim, as the settings say.
async fn run<S, ReqB, ResB>(
    config: Arc<Idempotency>,
    inner: S,
    mut parts: Parts,
    body: Bytes,
    lease: Lease,
) -> Result<Response<ResB>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: From<Bytes> + Send + 'static,
    ResB: Body + From<Bytes> + Send + 'static,
    ResB::Data: Send,
    ResB::Error: Into<BoxError>,
{
    let retention = config
        .deduper
        .retention()
        .for_namespace(lease.key.namespace());
    let idem = Idempotent {
        lease: lease.clone(),
        retention,
        settled: Arc::new(AtomicBool::new(false)),
    };
    parts.extensions.insert(idem.clone());
    let req = Request::from_parts(parts, ReqB::from(body));
    let deduper = config.deduper.clone();
    let this = Arc::clone(&config);
    let work = async move {
        let response = match inner.oneshot(req).await {
            Ok(response) => response,
            Err(e) => return (Ran::Failed(e), Settle::Release),
        };
        let ran = if response.status().is_success() {
            Answer::Processed
        } else {
            Answer::Failed
        };
        if idem.settled.load(Ordering::SeqCst) {
            return (Ran::Respond(response, ran), Settle::Settled);
        }
        let (head, body) = response.into_parts();
        if !(this.stored_statuses)(head.status) {
            return (
                Ran::Respond(Response::from_parts(head, body), Answer::Failed),
                Settle::Release,
            );
        }
        let limit = match this.large_response {
            LargeResponse::Refuse => this.max_response_bytes,
            // Read whole: it is sent as it is, and not kept.
            LargeResponse::PassAndRelease => usize::MAX,
        };
        // The handler's work is done: a problem kept in its response's place
        // is what the key answers from now on, so it never runs twice.
        let kept_problem = |answer: Answer, detail: String| {
            let problem = answer.stored_problem(&detail, None);
            let mut response: Response<ResB> = problem.clone().into_http();
            response.extensions_mut().insert(answer);
            (
                Ran::Respond(response, answer),
                Settle::Complete {
                    outcome: problem.encode(),
                    retention,
                },
            )
        };
        let bytes = match Limited::new(body, limit).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return kept_problem(
                    Answer::ResponseTooLarge,
                    format!(
                        "the handler ran, and its response is over the {} bytes kept for \
                         retries; it was not sent, and a retry answers this again",
                        this.max_response_bytes
                    ),
                )
            }
            Err(e) => {
                return kept_problem(
                    Answer::Panicked,
                    format!(
                        "the handler ran, and its response body failed ({e}); a retry \
                         answers this again"
                    ),
                )
            }
        };
        // Kept when the body is within the layer's limit (PassAndRelease read
        // it whole) and the response with its headers within the store's: a
        // completion over the store's limit is refused, and the claim would
        // be left in flight until its lease passed, then run again.
        let store_limit = this.deduper.store().capabilities().max_outcome_bytes;
        let outcome = (bytes.len() <= this.max_response_bytes)
            .then(|| {
                StoredResponse::from_parts(
                    head.status,
                    &head.headers,
                    bytes.clone(),
                    &this.never_replayed,
                )
                .encode()
            })
            .filter(|outcome| outcome.len() <= store_limit);
        match (outcome, &this.large_response) {
            (Some(outcome), _) => (
                Ran::Respond(Response::from_parts(head, ResB::from(bytes)), ran),
                Settle::Complete { outcome, retention },
            ),
            // Sent, not kept.
            (None, LargeResponse::PassAndRelease) => (
                Ran::Respond(
                    Response::from_parts(head, ResB::from(bytes)),
                    Answer::Failed,
                ),
                Settle::Release,
            ),
            (None, LargeResponse::Refuse) => kept_problem(
                Answer::ResponseTooLarge,
                format!(
                    "the handler ran, and its response with its headers is over the \
                     {store_limit} bytes the store keeps; it was not sent, and a retry answers \
                     this again"
                ),
            ),
        }
    };
    // Already in a task of the deduper's (see `handle`): held right here.
    let worked = deduper.hold(lease, work).await;
    Ok(match worked {
        Worked::Returned { value, settled } => {
            let (mut response, answer) = match value {
                Ran::Respond(response, answer) => (response, answer),
                Ran::Failed(e) => return Err(e),
            };
            // Answering an error after the handler's work would make the
            // client retry work that is done: its response goes out.
            let answer = match settled {
                Err(Error::LeaseLost { .. }) => Answer::LeaseLost,
                _ => answer,
            };
            response.extensions_mut().insert(answer);
            response
        }
        Worked::Panicked { .. } => Answer::Panicked.problem(
            "the handler panicked; nothing was kept, and a retry runs it again",
            None,
        ),
        Worked::TimedOut { limit, .. } => Answer::HandlerTimeout.problem(
            &format!(
                "the handler ran past its {limit:?} bound and was stopped; a retry runs it again"
            ),
            Some(Duration::from_secs(1)),
        ),
        Worked::AlreadyRunning { deadline } => in_flight(deadline),
        _ => Answer::Unavailable.problem(
            "the server is shutting down; the request was stopped and a retry runs it again",
            Some(Duration::from_secs(5)),
        ),
    })
}

fn bad_key<B: From<Bytes>>(error: &dyn std::error::Error) -> Response<B> {
    Answer::BadKey.problem(&format!("{error}; nothing was run"), None)
}

/// 409 with `Retry-After` until the holder's lease passes (at most a
/// minute).
fn in_flight<B: From<Bytes>>(deadline: SystemTime) -> Response<B> {
    let left = deadline
        .duration_since(SystemTime::now())
        .unwrap_or_default()
        .min(Duration::from_secs(60));
    Answer::InFlight.problem(
        "the first request with this key is still being processed; retry after the time given",
        Some(left),
    )
}

/// A store error before anything ran: 503 when a retry may get through,
/// else 500. The store's own text goes to the log only: it can name hosts,
/// tables or credentials.
fn store_error<B: From<Bytes>>(key: &Key, e: &Error) -> Response<B> {
    if e.is_retryable() {
        tracing::warn!(%key, error = %e, "idempotency store unavailable: answering 503");
        Answer::Unavailable.problem(
            "the idempotency store is unavailable; nothing was run",
            Some(Duration::from_secs(1)),
        )
    } else {
        tracing::error!(%key, error = %e, "idempotency store refused the claim");
        Answer::Error.problem(
            "the idempotency store refused the request; nothing was run (see the server's log)",
            None,
        )
    }
}

/// The key with another fingerprint, where a mismatch is a duplicate: the
/// kept response, 409 while the first runs (logged and counted).
async fn mismatch_replay<B: From<Bytes>>(config: &Idempotency, key: &Key) -> Response<B> {
    tracing::warn!(%key, "a known key with another fingerprint: answered as a duplicate");
    match config.deduper.store().get(key).await {
        Ok(Some(record)) => match record.state {
            RecordState::Done { outcome, .. } => {
                replay(config, key, &outcome, Answer::MismatchReplayed)
            }
            RecordState::InFlight { lease_deadline } => in_flight(lease_deadline),
        },
        // Gone between the claim and the read (released, expired): come
        // back, the next claim decides.
        Ok(None) => in_flight(SystemTime::now()),
        Err(e) => store_error(key, &e),
    }
}

/// The kept response of a done request, marked as a replay.
fn replay<B: From<Bytes>>(
    config: &Idempotency,
    key: &Key,
    outcome: &[u8],
    answer: Answer,
) -> Response<B> {
    let mut response: Response<B> = match StoredResponse::decode(outcome) {
        Ok(stored) => {
            let mut response: Response<B> = stored.into_http();
            for name in &config.never_replayed {
                response.headers_mut().remove(name);
            }
            response
        }
        Err(_) if config.acknowledge_foreign => {
            // Completed by other code: the request was processed, and that
            // is all there is to say.
            let body = serde_json::json!({ "duplicate": true, "key": key.to_string() });
            let mut response = Response::new(B::from(Bytes::from(body.to_string())));
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(e) => {
            tracing::error!(%key, error = %e, "a kept response does not decode");
            return Answer::CorruptStored
                .problem(&format!("{e}; the request is not run again"), None);
        }
    };
    response
        .headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    response.extensions_mut().insert(answer);
    response
}

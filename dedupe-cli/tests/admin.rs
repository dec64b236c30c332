//! The admin listener of `dedupe serve`: its dashboard driven in a real
//! headless Chromium (Debian's `chromium` and `chromium-driver`, which
//! `scripts/test` installs), its refusals (token, anti-forgery token,
//! hosts), and the public listener serving none of it.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::Value;

mod harness;
use harness::{client, sample, Serve};

/// A `chromedriver` on a free port, killed on drop.
struct Driver {
    child: Child,
    url: String,
    _profile: tempfile::TempDir,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Starts Debian's chromedriver and a headless Chromium session on it, at a
/// laptop's window size.
async fn browser() -> (Driver, Client) {
    let port = free_port();
    let child = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "chromedriver did not start ({e}): scripts/test installs Debian's chromium-driver"
            )
        });
    let profile = tempfile::tempdir().expect("a browser profile");
    let driver = Driver {
        child,
        url: format!("http://127.0.0.1:{port}"),
        _profile: profile,
    };
    let http = client();
    let deadline = Instant::now() + Duration::from_secs(30);
    while http
        .get(format!("{}/status", driver.url))
        .send()
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "chromedriver never answered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1366,900",
                format!("--user-data-dir={}", driver._profile.path().display()),
            ],
        }),
    );
    let session = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .expect("a Chromium session");
    (driver, session)
}

/// Where this run's screenshots go: under the test's output directory.
fn shots() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard-screenshots");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("screenshot directory");
    dir
}

/// The page's visible text.
async fn text(browser: &Client) -> String {
    browser
        .find(Locator::Css("body"))
        .await
        .expect("a body")
        .text()
        .await
        .expect("its text")
}

/// Saves a screenshot as `name`.png, then fails unless the page shows every
/// one of `expected`.
async fn check(browser: &Client, dir: &std::path::Path, name: &str, expected: &[&str]) {
    let png = browser.screenshot().await.expect("a screenshot");
    std::fs::write(dir.join(format!("{name}.png")), png).expect("save the screenshot");
    let shown = text(browser).await;
    for want in expected {
        assert!(
            shown.contains(want),
            "page {name} ({}) does not show {want:?}; it shows:\n{shown}",
            browser
                .current_url()
                .await
                .map(|u| u.to_string())
                .unwrap_or_default()
        );
    }
}

/// Reloads the page until its text shows `want` (a worker's or a bulk
/// action's progress), for at most 30 s.
async fn until_shown(browser: &Client, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if text(browser).await.contains(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the page never showed {want:?}; it shows:\n{}",
            text(browser).await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        browser.refresh().await.expect("reload");
    }
}

/// Delivers the event `id` to `/hooks`, its business step failing as `fail`
/// says (the `--fail-on-header` hook's value), and checks it was accepted.
async fn deliver(http: &reqwest::Client, base: &str, id: &str, fail: Option<&str>) {
    let mut req = http
        .post(format!("{base}/hooks"))
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .body(format!(r#"{{"id":"{id}","type":"invoice.paid"}}"#));
    if let Some(fail) = fail {
        req = req.header("x-test-fail", fail);
    }
    let answer = req.send().await.expect("deliver");
    assert_eq!(answer.status().as_u16(), 202, "{id} was not accepted");
}

/// Reads with `probe` every 100 ms until it answers `Ok`, for at most 30
/// s; then fails, saying `what` and the last `Err` (the state it read).
async fn settled<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match probe().await {
            Ok(done) => return done,
            Err(state) => assert!(Instant::now() < deadline, "{what}: {state}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn api(http: &reqwest::Client, url: &str) -> Value {
    http.get(url)
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON")
}

/// The whole operator's path in a real browser: with `dedupe serve --inbox`
/// on SQLite and one poison delivery, the dashboard shows it dead with its
/// error, filters the dead letters by error text, replays the filtered set
/// after showing the dry run's count, and shows the item completed once the
/// business step is healed. A screenshot of each page is saved under
/// `target/tmp/dashboard-screenshots`; the test fails when any page misses
/// its expected text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_replays_a_poison_delivery_in_a_real_browser() {
    let dir = tempfile::tempdir().expect("dir");
    let healed = dir.path().join("healed");
    let store = format!("sqlite://{}", dir.path().join("dash.db").display());
    let serve = Serve::with(
        &store,
        0,
        &[
            "--inbox",
            "--retry-backoff-ms",
            "100",
            "--healed-when",
            healed.to_str().expect("a path"),
        ],
        &[],
    );
    let http = client();
    // One poison delivery (its business step fails for good), and one good.
    deliver(&http, &serve.base, "evt_poison_1", Some("permanent")).await;
    deliver(&http, &serve.base, "evt_good_1", None).await;
    let hooks_url = format!("{}/api/namespaces/hooks", serve.admin);
    settled("the poison item never died", || async {
        let hooks = api(&http, &hooks_url).await;
        match hooks["dead"] == 1 && hooks["pending"] == 0 && hooks["running"] == 0 {
            true => Ok(()),
            false => Err(hooks.to_string()),
        }
    })
    .await;

    let shots = shots();
    let (_driver, browser) = browser().await;
    // 1. The namespaces: one dead item in hooks.
    browser
        .goto(&format!("{}/ui", serve.admin))
        .await
        .expect("open /ui");
    check(
        &browser,
        &shots,
        "01-namespaces",
        &["Namespaces", "hooks", "stripe"],
    )
    .await;
    let dead = browser
        .find(Locator::Css("#ns-hooks td:nth-child(6)"))
        .await
        .expect("the dead count of hooks");
    assert_eq!(dead.text().await.expect("text"), "1");
    dead.find(Locator::Css("a"))
        .await
        .expect("its link")
        .click()
        .await
        .expect("open the dead letters");
    // 2. The dead letters: the item with its error.
    browser
        .wait()
        .for_element(Locator::Css("table.items"))
        .await
        .expect("the dead letters");
    check(
        &browser,
        &shots,
        "02-dead-letters",
        &[
            "evt_poison_1",
            "dead",
            "business step failed (--fail-on-header: permanent)",
        ],
    )
    .await;
    // 3. The item's page: dead, its error history, its delivery.
    browser
        .find(Locator::LinkText("evt_poison_1"))
        .await
        .expect("the item's link")
        .click()
        .await
        .expect("open the item");
    browser
        .wait()
        .for_element(Locator::Css("#last-error"))
        .await
        .expect("the item's page");
    check(
        &browser,
        &shots,
        "03-item-dead",
        &[
            "Item evt_poison_1",
            "dead",
            "Errors",
            "permanent",
            "webhook-id",
            "invoice.paid",
        ],
    )
    .await;
    // 4. The dead letters filtered by error text.
    browser
        .goto(&format!("{}/ui/namespaces/hooks?state=dead", serve.admin))
        .await
        .expect("back to the dead letters");
    let error = browser
        .find(Locator::Css("input[name=error]"))
        .await
        .expect("the error filter");
    error.send_keys("fail-on-header: perm").await.expect("type");
    browser
        .find(Locator::Css("form.filters button"))
        .await
        .expect("Filter")
        .click()
        .await
        .expect("filter");
    browser
        .wait()
        .for_element(Locator::Css("#bulk-replay"))
        .await
        .expect("the filtered page");
    assert!(browser
        .current_url()
        .await
        .expect("url")
        .as_str()
        .contains("error=fail-on-header"));
    check(
        &browser,
        &shots,
        "04-filtered",
        &["evt_poison_1", "1 shown"],
    )
    .await;
    // 5. The dry run: one item matches.
    browser
        .find(Locator::Css("#bulk-replay"))
        .await
        .expect("Replay matching items")
        .click()
        .await
        .expect("ask to replay");
    let matched = browser
        .wait()
        .for_element(Locator::Css("#matched"))
        .await
        .expect("the dry run's count");
    assert_eq!(matched.text().await.expect("text"), "1");
    check(
        &browser,
        &shots,
        "05-dry-run",
        &[
            "Replay by filter",
            "1 item of hooks matches",
            "error = fail-on-header: perm",
            "Replay 1 item",
        ],
    )
    .await;
    // 6. The business step is healed; the replay runs and finishes.
    std::fs::write(&healed, b"fixed").expect("heal");
    browser
        .find(Locator::Css("#confirm"))
        .await
        .expect("the confirm button")
        .click()
        .await
        .expect("replay");
    browser
        .wait()
        .for_element(Locator::Css("#job-state"))
        .await
        .expect("the job's page");
    until_shown(&browser, "done").await;
    check(
        &browser,
        &shots,
        "06-bulk-done",
        &["Bulk action #1", "Matched", "done"],
    )
    .await;
    assert_eq!(
        browser
            .find(Locator::Css("#job-done"))
            .await
            .expect("done count")
            .text()
            .await
            .expect("text"),
        "1"
    );
    // 7. The item ran again and completed.
    browser
        .goto(&format!(
            "{}/ui/namespaces/hooks/items/evt_poison_1",
            serve.admin
        ))
        .await
        .expect("the item again");
    until_shown(&browser, "completed").await;
    check(
        &browser,
        &shots,
        "07-item-completed",
        &["Item evt_poison_1", "completed"],
    )
    .await;
    // The ledger agrees: the poison event ran to its end exactly once.
    let ledger = api(&http, &format!("{}/hooks", serve.admin)).await;
    let runs = ledger["ledger"]
        .as_array()
        .expect("rows")
        .iter()
        .filter(|r| r["key"] == "hooks:evt_poison_1")
        .count();
    assert_eq!(runs, 1, "{ledger}");
    browser.close().await.expect("close the browser");
    eprintln!("screenshots in {}", shots.display());
}

/// The admin surface refuses: without its bearer token (401, the dashboard
/// sends the browser to sign in), a state-changing call without the
/// anti-forgery token (403, whatever the bearer), a GET on a state-changing
/// route (405); the sign-in sets a session cookie that works, a wrong token
/// does not; and the public listener serves none of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_surface_wants_its_token_and_the_anti_forgery_token() {
    let dir = tempfile::tempdir().expect("dir");
    let store = format!("sqlite://{}", dir.path().join("auth.db").display());
    let token = "admin-token-for-the-test";
    let serve = Serve::with(&store, 0, &["--inbox"], &[("DEDUPE_ADMIN_TOKEN", token)]);
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    deliver(&http, &serve.base, "evt_auth_1", Some("permanent")).await;
    let admin = &serve.admin;
    let replay = format!("{admin}/api/namespaces/hooks/items/evt_auth_1/replay");

    // No token: refused, nothing read or changed.
    for path in [
        "/api/namespaces",
        "/api/csrf",
        "/metrics",
        "/hooks",
        "/api/jobs",
    ] {
        let answer = http
            .get(format!("{admin}{path}"))
            .send()
            .await
            .expect("GET");
        assert_eq!(answer.status().as_u16(), 401, "{path} without the token");
    }
    let to_login = http
        .get(format!("{admin}/ui"))
        .send()
        .await
        .expect("GET /ui");
    assert_eq!(to_login.status().as_u16(), 303);
    assert_eq!(to_login.headers()["location"], "/ui/login");
    let health = http
        .get(format!("{admin}/healthz"))
        .send()
        .await
        .expect("GET");
    assert_eq!(health.status().as_u16(), 200);
    let wrong = http
        .get(format!("{admin}/api/csrf"))
        .bearer_auth("not-the-token")
        .send()
        .await
        .expect("GET");
    assert_eq!(wrong.status().as_u16(), 401);

    // The token, but no anti-forgery token: a POST is refused.
    let csrf: Value = http
        .get(format!("{admin}/api/csrf"))
        .bearer_auth(token)
        .send()
        .await
        .expect("GET /api/csrf")
        .json()
        .await
        .expect("JSON");
    let csrf = csrf["csrf_token"].as_str().expect("a token").to_string();
    settled("never dead", || async {
        let item: Value = http
            .get(format!("{admin}/api/namespaces/hooks/items/evt_auth_1"))
            .bearer_auth(token)
            .send()
            .await
            .expect("GET")
            .json()
            .await
            .expect("JSON");
        match item["state"] == "dead" {
            true => Ok(()),
            false => Err(item.to_string()),
        }
    })
    .await;
    for (what, csrf_header) in [("no", None), ("a wrong", Some("0".repeat(64)))] {
        let mut req = http.post(&replay).bearer_auth(token);
        if let Some(h) = csrf_header {
            req = req.header("x-csrf-token", h);
        }
        let answer = req.send().await.expect("POST");
        assert_eq!(answer.status().as_u16(), 403, "{what} anti-forgery token");
    }
    // A form without the field, as another site's page would send it.
    let forged = http
        .post(&replay)
        .bearer_auth(token)
        .header("content-type", "application/x-www-form-urlencoded")
        .body("action=replay")
        .send()
        .await
        .expect("POST");
    assert_eq!(forged.status().as_u16(), 403);
    let get = http
        .get(&replay)
        .bearer_auth(token)
        .send()
        .await
        .expect("GET");
    assert_eq!(
        get.status().as_u16(),
        405,
        "a state-changing route answered a GET"
    );
    let item: Value = http
        .get(format!("{admin}/api/namespaces/hooks/items/evt_auth_1"))
        .bearer_auth(token)
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON");
    assert_eq!(item["state"], "dead", "a refused call changed the item");

    // A browser's page of another site (or another port) is refused even
    // with both tokens; a misspelt bulk field, or an empty filter not said
    // to mean every item, is refused before anything runs.
    let cross = http
        .post(&replay)
        .bearer_auth(token)
        .header("x-csrf-token", &csrf)
        .header("sec-fetch-site", "same-site")
        .send()
        .await
        .expect("POST");
    assert_eq!(cross.status().as_u16(), 403, "a same-site page's POST");
    let bulk = format!("{admin}/api/namespaces/hooks/bulk");
    for (body, refused) in [
        (
            r#"{"action":"forget","dryrun":true,"state":"dead"}"#,
            "dryrun",
        ),
        (r#"{"action":"forget","dry_run":true}"#, "every item"),
    ] {
        let answer = http
            .post(&bulk)
            .bearer_auth(token)
            .header("x-csrf-token", &csrf)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("POST bulk");
        assert_eq!(answer.status().as_u16(), 400, "{body}");
        let said = answer.text().await.expect("text");
        assert!(said.contains(refused), "{body}: {said}");
    }
    let all: Value = http
        .post(&bulk)
        .bearer_auth(token)
        .header("x-csrf-token", &csrf)
        .header("content-type", "application/json")
        .body(r#"{"action":"forget","dry_run":true,"all":true}"#)
        .send()
        .await
        .expect("POST bulk")
        .json()
        .await
        .expect("JSON");
    assert_eq!(all["matched"], 1, "{all}");

    // Both tokens: the replay goes through.
    let done: Value = http
        .post(&replay)
        .bearer_auth(token)
        .header("x-csrf-token", &csrf)
        .send()
        .await
        .expect("POST")
        .json()
        .await
        .expect("JSON");
    assert_eq!(done["replayed"], true);

    // The dashboard's sign-in: a wrong token sets nothing, the right one a
    // cookie that opens the pages.
    let form = |t: &str| format!("csrf_token={csrf}&token={t}");
    let bad = http
        .post(format!("{admin}/ui/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form("nope"))
        .send()
        .await
        .expect("POST /ui/login");
    assert_eq!(bad.status().as_u16(), 401);
    assert!(bad.headers().get("set-cookie").is_none());
    let good = http
        .post(format!("{admin}/ui/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(token))
        .send()
        .await
        .expect("POST /ui/login");
    assert_eq!(good.status().as_u16(), 303);
    let cookie = good.headers()["set-cookie"]
        .to_str()
        .expect("cookie")
        .split(';')
        .next()
        .expect("name=value")
        .to_string();
    assert!(
        !cookie.contains(token),
        "the cookie carries the token itself"
    );
    let page = http
        .get(format!("{admin}/ui"))
        .header("cookie", &cookie)
        .send()
        .await
        .expect("GET /ui");
    assert_eq!(page.status().as_u16(), 200);
    assert!(page.text().await.expect("page").contains(&csrf));

    // The public listener serves none of the admin surface.
    for path in [
        "/ui",
        "/ui/login",
        "/api/namespaces",
        "/api/csrf",
        "/metrics",
        "/hooks/x/y",
    ] {
        let answer = http
            .get(format!("{}{path}", serve.base))
            .bearer_auth(token)
            .send()
            .await
            .expect("GET");
        assert!(
            matches!(answer.status().as_u16(), 404 | 405),
            "the public listener answered {path} with {}",
            answer.status()
        );
    }
    let answer = http
        .post(format!(
            "{}/api/namespaces/hooks/items/evt_auth_1/forget",
            serve.base
        ))
        .bearer_auth(token)
        .header("x-csrf-token", &csrf)
        .send()
        .await
        .expect("POST");
    assert_eq!(answer.status().as_u16(), 404);
}

/// Without a token the surface answers only requests naming a loopback
/// host: a page on another site cannot reach it through a name of its own
/// that resolves to 127.0.0.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_only_loopback_hosts_are_answered() {
    let dir = tempfile::tempdir().expect("dir");
    let store = format!("sqlite://{}", dir.path().join("hosts.db").display());
    let serve = Serve::with(&store, 0, &["--inbox"], &[]);
    let http = client();
    let port = serve.admin.rsplit(':').next().expect("a port").to_string();
    for (host, status) in [
        (format!("127.0.0.1:{port}"), 200),
        (format!("localhost:{port}"), 200),
        (format!("rebound.example:{port}"), 403),
    ] {
        let answer = http
            .get(format!("{}/api/csrf", serve.admin))
            .header("host", &host)
            .send()
            .await
            .expect("GET");
        assert_eq!(answer.status().as_u16(), status, "Host: {host}");
    }
    // A public address without a token is refused at start.
    let out = Command::new(env!("CARGO_BIN_EXE_dedupe"))
        .args(["serve", "--store", &store, "--listen", "127.0.0.1:0"])
        .args(["--admin-listen", "0.0.0.0:0"])
        .env_remove("DEDUPE_ADMIN_TOKEN")
        .output()
        .expect("run dedupe serve");
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("not a loopback address"), "{said}");
}

/// Queue health in Prometheus after a scripted sequence on SQLite: four
/// accepts (one completes, one is retried in an hour, one snoozed for an
/// hour, one dead), then the dead one replayed once the step is healed.
/// Each gauge and counter is read from `/metrics` at its expected value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_the_queue_after_a_scripted_sequence() {
    let dir = tempfile::tempdir().expect("dir");
    let healed = dir.path().join("healed");
    let store = format!("sqlite://{}", dir.path().join("metrics.db").display());
    let serve = Serve::with(
        &store,
        0,
        &[
            "--inbox",
            "--gauges-every-ms",
            "100",
            "--healed-when",
            healed.to_str().expect("a path"),
        ],
        &[],
    );
    let http = client();
    for (id, fail) in [
        ("evt_ok", None),
        ("evt_retry", Some("retry-after=3600")),
        ("evt_snooze", Some("snooze=3600")),
        ("evt_dead", Some("permanent")),
    ] {
        deliver(&http, &serve.base, id, fail).await;
    }
    let scrape = || async {
        http.get(format!("{}/metrics", serve.admin))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("text")
    };
    let hooks = [("namespace", "hooks")];
    let outcome = |text: &str, o: &str| {
        sample(
            text,
            "dedupe_inbox_outcomes_total",
            &[("namespace", "hooks"), ("outcome", o)],
        )
    };
    let items = |text: &str, state: &str| {
        sample(
            text,
            "dedupe_inbox_items",
            &[("namespace", "hooks"), ("state", state)],
        )
    };
    // Settled: each of the four ran once.
    let text = settled("the queue never settled", || async {
        let text = scrape().await;
        match items(&text, "dead") == 1.0
            && items(&text, "failed") == 1.0
            && items(&text, "pending") == 1.0
        {
            true => Ok(text),
            false => Err(text),
        }
    })
    .await;
    assert_eq!(outcome(&text, "completed"), 1.0, "{text}");
    assert_eq!(outcome(&text, "retried"), 1.0, "{text}");
    assert_eq!(outcome(&text, "snoozed"), 1.0, "{text}");
    assert_eq!(outcome(&text, "dead"), 1.0, "{text}");
    assert_eq!(outcome(&text, "replayed"), 0.0, "{text}");
    assert_eq!(items(&text, "running"), 0.0, "{text}");
    assert_eq!(sample(&text, "dedupe_inbox_paused", &hooks), 0.0, "{text}");
    assert_eq!(
        sample(&text, "dedupe_inbox_wait_seconds_count", &hooks),
        4.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "dedupe_inbox_processing_seconds_count", &hooks),
        4.0,
        "{text}"
    );

    // Healed, the dead one replayed: it completes.
    std::fs::write(&healed, b"fixed").expect("heal");
    let csrf: Value = api(&http, &format!("{}/api/csrf", serve.admin)).await;
    let replayed: Value = http
        .post(format!(
            "{}/api/namespaces/hooks/items/evt_dead/replay",
            serve.admin
        ))
        .header("x-csrf-token", csrf["csrf_token"].as_str().expect("token"))
        .send()
        .await
        .expect("POST replay")
        .json()
        .await
        .expect("JSON");
    assert_eq!(replayed["replayed"], true);
    let text = settled("the replay never completed", || async {
        let text = scrape().await;
        match items(&text, "dead") == 0.0 && outcome(&text, "completed") == 2.0 {
            true => Ok(text),
            false => Err(text),
        }
    })
    .await;
    assert_eq!(outcome(&text, "replayed"), 1.0, "{text}");
    assert_eq!(outcome(&text, "dead"), 1.0, "{text}");
    assert_eq!(outcome(&text, "retried"), 1.0, "{text}");
    assert_eq!(items(&text, "pending"), 1.0, "{text}");
    assert_eq!(items(&text, "failed"), 1.0, "{text}");
    // A replayed run is no first attempt: the wait is counted once an item.
    assert_eq!(
        sample(&text, "dedupe_inbox_wait_seconds_count", &hooks),
        4.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, "dedupe_inbox_processing_seconds_count", &hooks),
        5.0,
        "{text}"
    );
    // Both waiting items are due in an hour: nothing is overdue.
    assert_eq!(
        sample(&text, "dedupe_inbox_oldest_due_age_seconds", &hooks),
        0.0,
        "{text}"
    );
    // Paused: the gauge follows within a refresh.
    let paused = http
        .post(format!("{}/api/namespaces/hooks/pause", serve.admin))
        .header("x-csrf-token", csrf["csrf_token"].as_str().expect("token"))
        .send()
        .await
        .expect("POST pause");
    assert_eq!(paused.status().as_u16(), 200);
    settled("the paused gauge never moved", || async {
        let text = scrape().await;
        match sample(&text, "dedupe_inbox_paused", &hooks) == 1.0 {
            true => Ok(()),
            false => Err(text),
        }
    })
    .await;
}

//! The example on a NATS server of its own (`nats-server -js` on a free
//! loopback port, in a temporary directory) and a SQLite inbox: 60 messages
//! published, the first delivery of every third one accepted but its ack
//! "lost" (held back, as a consumer that crashed between the accept and the
//! ack); JetStream redelivers those after the consumer's `ack_wait`, the
//! accept answers them as known, and the worker's handler runs once per
//! message, counted by the test.

use std::collections::HashMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use dedupe_core::{Accepted, Deduper, Inbox, InboxWorker};
use dedupe_example_nats_inbox::accept_messages;

struct NatsServer {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl NatsServer {
    fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir = tempfile::tempdir().expect("dir");
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server (scripts/test installs it)");
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "nats-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Self {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            _dir: dir,
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivered_messages_run_once() {
    const MESSAGES: usize = 60;
    let server = NatsServer::start();
    let dir = tempfile::tempdir().expect("dir");
    let inbox: Arc<dyn Inbox> = Arc::new(
        dedupe_sqlite::SqliteStore::open(dir.path().join("inbox.db"))
            .await
            .expect("store"),
    );
    let js = jetstream::new(async_nats::connect(&server.url).await.expect("connect"));
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: "ORDERS".into(),
            subjects: vec!["orders.>".into()],
            ..Default::default()
        })
        .await
        .expect("stream");
    for i in 0..MESSAGES {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("ord-{i}").as_str(),
        );
        js.publish_with_headers("orders.created", headers, format!("order {i}").into())
            .await
            .expect("publish")
            .await
            .expect("stored");
    }
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("inbox".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await
        .expect("consumer");

    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let deduper = Deduper::new(Arc::clone(&inbox));
    let worker = InboxWorker::new(&deduper, Arc::clone(&inbox), "orders")
        .with_poll_interval(Duration::from_millis(10));
    let working = tokio::spawn({
        let (worker, runs) = (worker.clone(), Arc::clone(&runs));
        async move {
            worker
                .run(move |taken| {
                    let runs = Arc::clone(&runs);
                    async move {
                        *runs
                            .lock()
                            .expect("runs")
                            .entry(taken.lease.key.id().to_string())
                            .or_default() += 1;
                        Ok::<_, std::io::Error>(taken.payload)
                    }
                })
                .await
        }
    });

    let messages = consumer.messages().await.expect("messages");
    let held_back: Arc<Mutex<Vec<String>>> = Arc::default();
    let accepting = tokio::spawn({
        let (inbox, held_back) = (Arc::clone(&inbox), Arc::clone(&held_back));
        async move {
            accept_messages(
                inbox.as_ref(),
                "orders",
                messages,
                Duration::from_millis(100),
                move |message, answer| {
                    let id = message
                        .headers
                        .as_ref()
                        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                        .map(|v| v.as_str().to_string())
                        .unwrap_or_default();
                    let n: usize = id.trim_start_matches("ord-").parse().unwrap_or(1);
                    // The first delivery of every third message: accepted,
                    // then "crashed" before the ack.
                    let lose = n.is_multiple_of(3) && matches!(answer, Ok(Accepted::New));
                    if lose {
                        held_back.lock().expect("held").push(id);
                    }
                    !lose
                },
            )
            .await
        }
    });

    let started = Instant::now();
    loop {
        let info = js
            .get_stream("ORDERS")
            .await
            .expect("stream")
            .consumer_info("inbox")
            .await
            .expect("consumer info")
            .clone();
        let done = runs.lock().expect("runs").len() == MESSAGES;
        if done && info.num_ack_pending == 0 && info.num_pending == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "not every message was processed and acked: {} runs, {} awaiting an ack",
            runs.lock().expect("runs").len(),
            info.num_ack_pending
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let runs = runs.lock().expect("runs").clone();
    assert_eq!(runs.len(), MESSAGES);
    assert!(
        runs.values().all(|n| *n == 1),
        "a message ran twice: {runs:?}"
    );
    assert_eq!(held_back.lock().expect("held").len(), MESSAGES / 3);
    accepting.abort();
    worker.shutdown(Duration::from_secs(1)).await;
    working.abort();
}

//! The worker-crash run of a store crate as one macro: the parent test and
//! the ignored child test it starts as worker processes.

/// Expands into the pair of tests every store crate runs for
/// [`dedupe_conformance::crashes`]: `killed_workers_complete_every_event_exactly_once`
/// (three worker processes work through 40 events while eight of them are
/// killed with SIGKILL, most between a claim and its completion; every event
/// must end done exactly once, takeovers counted, stale completions refused)
/// and the ignored `crash_worker` that the run starts in each child process.
///
/// - `setup` is an expression of a function `() -> (G, Vec<(&'static str, String)>)`:
///   it makes the shared store ready (empty of `crash:` keys) and answers a
///   guard that keeps its server alive for the run and the environment that
///   tells a worker where it is.
/// - `worker` is an expression of an async function
///   `() -> Arc<dyn DedupeStore>` that opens the store from that
///   environment, in the child.
///
/// ```ignore
/// dedupe_testkit::crash_tests! {
///     setup: || {
///         let server = RedisServer::start();
///         let env = vec![("DEDUPE_CHILD_REDIS", server.url())];
///         (server, env)
///     },
///     worker: || async {
///         let url = std::env::var("DEDUPE_CHILD_REDIS").expect("child job");
///         Arc::new(store(&url).await) as Arc<dyn DedupeStore>
///     },
/// }
/// ```
///
/// With `inbox_worker:` (an async function `() -> Arc<dyn Inbox>` on the same
/// store), also `killed_inbox_workers_complete_every_item_exactly_once` and
/// its child `inbox_crash_worker`: the same run on the inbox
/// ([`CrashPlan::inbox`](dedupe_conformance::crashes::CrashPlan::inbox), 200
/// items accepted by every worker, taken three at a time), and
/// `inbox_deploys_spend_no_attempts` with its child `inbox_deploy_worker`
/// (worker processes stopped with SIGTERM and replaced twenty times under
/// load: every item done at attempt 1), and
/// `an_item_that_kills_its_workers_is_quarantined` with its child
/// `inbox_poison_worker` (an item that aborts its worker every time is dead
/// after three takeovers).
///
/// With `ordering_keys: true` after `inbox_worker:` (a store that keeps
/// ordering keys), also `killed_inbox_workers_keep_each_keys_order` and its
/// child `inbox_ordered_crash_worker`: the inbox's run with its items under
/// eight ordering keys
/// ([`CrashPlan::inbox_ordered`](dedupe_conformance::crashes::CrashPlan::inbox_ordered)),
/// judged also on each key's items running one at a time in accept order;
/// and `a_poison_item_holds_its_key_until_quarantined` with its child
/// `inbox_ordered_poison_worker`: the poison run with every item under one
/// ordering key, the poison item first
/// ([`PoisonPlan::ordered`](dedupe_conformance::poison::PoisonPlan::ordered)).
#[macro_export]
macro_rules! crash_tests {
    (setup: $setup:expr, worker: $worker:expr, inbox_worker: $inbox:expr, ordering_keys: true $(,)?) => {
        $crate::crash_tests!(setup: $setup, worker: $worker, inbox_worker: $inbox);

        /// Inbox workers killed with SIGKILL mid-item, the items under
        /// ordering keys: every item done exactly once, and no item of a key
        /// taken before the one before it was completed.
        #[test]
        fn killed_inbox_workers_keep_each_keys_order() {
            let (_guard, env) = ($setup)();
            let report = $crate::__conformance::crashes::crash_workers(
                "inbox_ordered_crash_worker",
                &$crate::__conformance::crashes::CrashPlan::inbox_ordered(),
                &env,
            )
            .unwrap_or_else(|failure| panic!("{failure}"));
            eprintln!("{report}");
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "run by killed_inbox_workers_keep_each_keys_order in a child process"]
        async fn inbox_ordered_crash_worker() {
            let inbox = ($inbox)().await;
            $crate::__conformance::crashes::run_inbox_crash_worker(inbox).await;
        }

        /// An item that aborts its worker every time, first of an ordering
        /// key whose items are skipped when dead: quarantined after three
        /// takeovers, and only then the key's other items run, in order
        /// (see `dedupe_conformance::poison`).
        #[test]
        fn a_poison_item_holds_its_key_until_quarantined() {
            let (_guard, env) = ($setup)();
            let report = $crate::__conformance::poison::poison_workers(
                "inbox_ordered_poison_worker",
                &$crate::__conformance::poison::PoisonPlan::ordered(),
                &env,
            )
            .unwrap_or_else(|failure| panic!("{failure}"));
            eprintln!("{report}");
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "run by a_poison_item_holds_its_key_until_quarantined in a child process"]
        async fn inbox_ordered_poison_worker() {
            let inbox = ($inbox)().await;
            $crate::__conformance::poison::run_poison_worker(inbox).await;
        }
    };
    (setup: $setup:expr, worker: $worker:expr, inbox_worker: $inbox:expr $(,)?) => {
        $crate::crash_tests!(setup: $setup, worker: $worker);

        /// Inbox workers killed with SIGKILL mid-item: every item ends done
        /// exactly once (see `dedupe_conformance::crashes`).
        #[test]
        fn killed_inbox_workers_complete_every_item_exactly_once() {
            let (_guard, env) = ($setup)();
            let report = $crate::__conformance::crashes::crash_workers(
                "inbox_crash_worker",
                &$crate::__conformance::crashes::CrashPlan::inbox(),
                &env,
            )
            .unwrap_or_else(|failure| panic!("{failure}"));
            eprintln!("{report}");
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "run by killed_inbox_workers_complete_every_item_exactly_once in a child process"]
        async fn inbox_crash_worker() {
            let inbox = ($inbox)().await;
            $crate::__conformance::crashes::run_inbox_crash_worker(inbox).await;
        }

        /// Inbox worker processes stopped gracefully (SIGTERM) and replaced
        /// twenty times under load: no item gains an attempt from a deploy
        /// (see `dedupe_conformance::deploys`).
        #[test]
        fn inbox_deploys_spend_no_attempts() {
            let (_guard, env) = ($setup)();
            let report = $crate::__conformance::deploys::deploy_workers(
                "inbox_deploy_worker",
                &$crate::__conformance::deploys::DeployPlan::default(),
                &env,
            )
            .unwrap_or_else(|failure| panic!("{failure}"));
            eprintln!("{report}");
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "run by inbox_deploys_spend_no_attempts in a child process"]
        async fn inbox_deploy_worker() {
            let inbox = ($inbox)().await;
            $crate::__conformance::deploys::run_deploy_worker(inbox).await;
        }

        /// An item that aborts its worker process every time it runs is
        /// quarantined after three takeovers, and the other items are done
        /// (see `dedupe_conformance::poison`).
        #[test]
        fn an_item_that_kills_its_workers_is_quarantined() {
            let (_guard, env) = ($setup)();
            let report = $crate::__conformance::poison::poison_workers(
                "inbox_poison_worker",
                &$crate::__conformance::poison::PoisonPlan::default(),
                &env,
            )
            .unwrap_or_else(|failure| panic!("{failure}"));
            eprintln!("{report}");
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "run by an_item_that_kills_its_workers_is_quarantined in a child process"]
        async fn inbox_poison_worker() {
            let inbox = ($inbox)().await;
            $crate::__conformance::poison::run_poison_worker(inbox).await;
        }
    };
    (setup: $setup:expr, worker: $worker:expr $(,)?) => {
        /// Worker processes killed with SIGKILL mid-work: every event ends done
        /// exactly once (see `dedupe_conformance::crashes`).
        #[test]
        fn killed_workers_complete_every_event_exactly_once() {
            let (_guard, env) = ($setup)();
            let report = $crate::__conformance::crashes::crash_workers(
                "crash_worker",
                &$crate::__conformance::crashes::CrashPlan::default(),
                &env,
            )
            .unwrap_or_else(|failure| panic!("{failure}"));
            eprintln!("{report}");
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "run by killed_workers_complete_every_event_exactly_once in a child process"]
        async fn crash_worker() {
            let store = ($worker)().await;
            $crate::__conformance::crashes::run_crash_worker(store).await;
        }
    };
}

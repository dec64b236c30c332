//! # dedupe-conformance
//!
//! The store contract of dedupe (`CONTRACT.md`) turned into checks that any store
//! runs: ours and third parties'. A store that passes can be swapped for any other
//! without the application noticing.
//!
//! Three ways in:
//! - [`suite!`]: one line in a store's test file expands to one `#[tokio::test]`
//!   per check, so failures name the rule that broke;
//! - [`checks`]: the check functions themselves, to call one by one;
//! - [`run_all`]: runs every check and returns a [`Report`] (the CLI uses it);
//!   [`run_selected`] runs the checks a filter picks.
//!
//! A store plugs in through a [`StoreFactory`] that makes one isolated, empty
//! store per check, and a [`Fixture`] that opens further handles onto it (each with
//! its own connection) for the races.
//!
//! The whole suite takes twenty seconds or so (its checks wait for leases to
//! pass), so this example is compiled but not run here (`conformance/tests/
//! memory.rs` runs the suite on the same store, a test per check):
//!
//! ```no_run
//! use dedupe_conformance::{run_all, MemoryFactory};
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
//! let report = run_all(&MemoryFactory).await;
//! assert!(report.all_passed(), "{report}");
//! # });
//! ```

pub mod bulk;
pub mod checks;
mod children;
pub mod crashes;
#[cfg(unix)]
pub mod deploys;
mod harness;
pub mod history;
#[cfg(unix)]
pub mod poison;
pub mod processes;
mod report;

pub use harness::{
    CheckResult, Failure, FaultSwitch, FaultyHandle, Fixture, MemoryFactory, Scale, StoreFactory,
    Verdict,
};
pub use report::{assert_check, run_all, run_check, run_selected, CheckReport, Report};

#[doc(hidden)]
pub use tokio as __tokio;

/// Hands the name of every check, in suite order, to a macro of this crate:
/// `__with_check_names!(callback! args)` expands to
/// `callback! { args ; name, name, ... }`. The one list of checks: [`CHECKS`]
/// and [`suite!`] are both generated from it.
///
/// [`CHECKS`]: crate::checks::CHECKS
#[doc(hidden)]
#[macro_export]
macro_rules! __with_check_names {
    ($callback:ident ! $($args:tt)*) => {
        $crate::$callback! { $($args)* ;
            fresh_claim,
            in_flight_answer,
            duplicate_returns_exact_outcome,
            release_then_reclaim,
            lease_expiry_takeover,
            stale_holder_is_fenced,
            passed_lease_is_lost,
            lease_is_lost_at_its_deadline,
            takeover_resets_holder_keeps_record,
            extend_pushes_deadline,
            deadlines_are_exact,
            retention_expiry,
            retention_counts_from_completion,
            expire_removes_exactly_expired,
            expire_spares_done_past_its_lease,
            fingerprint_mismatch,
            reentrant_claim_id,
            claim_ids_compare_whole,
            claim_many_matches_claim,
            namespaces_isolate,
            key_case_unicode_and_max_length,
            encoded_keys_stay_distinct,
            outcomes_up_to_the_limit,
            durations_at_their_limits,
            bad_input_rejected_nothing_written,
            forget_removes_any_state,
            ten_thousand_distinct_keys,
            oversized_batches_are_refused,
            errors_are_not_answers,
            resent_requests_answer_as_the_first,
            single_winner_race,
            single_winner_takeover_race,
            stale_holders_race_takeovers,
            batches_race_batches,
            expire_races_takeovers,
            forget_races_claims,
            lease_rules_across_handles,
            deadline_edge_races,
            near_identical_keys_race,
            outcome_bytes_round_trip,
            key_twice_in_a_batch_outlasting_its_lease,
            claim_many_matches_reference_claims,
            cancelled_calls_leave_a_sound_store,
            matches_reference_store,
            inbox_accepts_once,
            inbox_one_taker_race,
            inbox_takes_oldest_first,
            inbox_fences_stale_workers,
            inbox_failures_and_replay,
            inbox_items_never_expire,
            inbox_list_and_counts,
            inbox_accepts_race_claims,
            inbox_calls_asked_twice,
            inbox_hand_back_is_free,
            inbox_takeovers_are_counted,
            inbox_accept_options,
            inbox_snooze,
            inbox_pause,
            inbox_wake,
            inbox_ordering,
            inbox_dead_retention,
            inbox_error_history,
            inbox_forget_if,
        }
    };
}

/// Builds [`CHECKS`](crate::checks::CHECKS) from the list.
#[doc(hidden)]
#[macro_export]
macro_rules! __check_table {
    (; $($name:ident),* $(,)?) => {
        /// Every check, in the order the runner runs them.
        pub const CHECKS: &[Check] = &[$(Check {
            name: stringify!($name),
            run: |factory| Box::pin($crate::checks::$name(factory)),
        }),*];
    };
}

/// Expands to one `#[tokio::test]` per conformance check, each creating its store
/// from `$factory` (an expression whose value implements [`StoreFactory`]).
///
/// ```
/// // tests/conformance.rs of a store crate (here: the memory store's factory).
/// dedupe_conformance::suite!(dedupe_conformance::MemoryFactory);
/// # fn main() {}
/// ```
///
/// Put it at the top level of an integration test file (or inside a module); the
/// crate needs `tokio` as a dev-dependency. A skipped check prints `SKIPPED` with
/// the reason and passes; [`run_all`] lists skips in its report.
///
/// `suite!(current_thread, factory)` runs every check on Tokio's current-thread
/// runtime instead, for a store whose calls take another path there (SQLite's
/// run on its connection threads, never in place):
///
/// ```
/// mod on_one_thread {
///     dedupe_conformance::suite!(current_thread, dedupe_conformance::MemoryFactory);
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! suite {
    (current_thread, $factory:expr) => {
        $crate::__with_check_names!(suite! @current_thread ($factory));
    };
    (@current_thread ($factory:expr) ; $($name:ident),* $(,)?) => {
        $(
            #[$crate::__tokio::test(flavor = "current_thread")]
            async fn $name() {
                let factory = $factory;
                $crate::assert_check(&factory, stringify!($name)).await;
            }
        )*
    };
    ($factory:expr) => {
        $crate::__with_check_names!(suite! @tests ($factory));
    };
    (@tests ($factory:expr) ; $($name:ident),* $(,)?) => {
        $(
            #[$crate::__tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let factory = $factory;
                $crate::assert_check(&factory, stringify!($name)).await;
            }
        )*
    };
}

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

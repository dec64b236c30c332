//! The condition and update expressions of every request, and the attribute
//! names each request uses.

/// How many times a claim re-reads a record that changed under it.
pub(crate) const CLAIM_ROUNDS: usize = 8;

/// A fresh claim: the key is absent, or done and past its retention (an
/// in-flight record past its lease is taken over by [`TAKEOVER`] instead, so
/// the attempt count carries on).
pub(crate) const FRESH: &str = "attribute_not_exists(#pk) OR (#st = :done AND #dl <= :now)";

/// A takeover: the record is still exactly the one read (its token and
/// deadline), whose lease has passed.
pub(crate) const TAKEOVER: &str = "#tk = :tk AND #dl = :dl";

/// Every holder's write: this token, in flight, deadline ahead of `:now`.
pub(crate) const HELD: &str = "#tk = :tk AND #st = :zero AND #dl > :now";

/// A completion asked again: the record is done, by this token.
pub(crate) const DONE_BY: &str = "#tk = :tk AND #st = :one";

/// `forget`'s delete: the record is still the one read.
pub(crate) const FENCED: &str = "#tk = :tk";

pub(crate) const COMPLETE: &str = "SET #st = :one, #dl = :until, #cm = :now, #oc = :oc, #ex = :exp";
pub(crate) const EXTEND: &str = "SET #dl = :until, #ex = :exp";

/// `expire()`'s scan filter, projection, and delete condition (never a record
/// claimed again since the scan).
pub(crate) const SCAN: &str = "#dl <= :now";
pub(crate) const PROJECTION: &str = "#pk, #tk, #dl";
pub(crate) const UNCHANGED: &str = "#tk = :tk AND #dl = :dl AND #dl <= :now";

/// Every set of expressions one request carries: their attribute names are
/// worked out once, when the store is built, not on every request.
pub(crate) const REQUESTS: [&[&str]; 9] = [
    &[FRESH],
    &[TAKEOVER],
    &[COMPLETE, HELD],
    &[HELD],
    &[EXTEND, HELD],
    &[SCAN, PROJECTION],
    &[UNCHANGED],
    &[FENCED],
    &[DONE_BY],
];

//! The condition and update expressions of every request, and the attribute
//! names each request uses.

/// How many times a claim re-reads a record that changed under it.
pub(crate) const CLAIM_ROUNDS: usize = 8;

/// A fresh claim: the key is absent, or done and past its retention (an
/// in-flight record past its lease is taken over by [`TAKEOVER`] instead, so
/// the attempt count carries on).
/// A namespace's pause marker (I13) written only when it is not there.
pub(crate) const NO_MARKER: &str = "attribute_not_exists(#pk)";
/// A pause marker read for its key alone.
pub(crate) const NO_MARKER_PROJECTION: &str = "#pk";
pub(crate) const FRESH: &str = "attribute_not_exists(#pk) OR (#st = :done AND #dl <= :now)";

/// A takeover: the record is still exactly the one read (its token and
/// deadline), whose lease has passed.
pub(crate) const TAKEOVER: &str = "#tk = :tk AND #dl = :dl";

/// Every holder's write: this token, in flight, deadline ahead of `:now`
/// (an inbox item: and held by a worker, not waiting with a worker's token).
pub(crate) const HELD: &str =
    "#tk = :tk AND #st = :zero AND #dl > :now AND (attribute_not_exists(#wt) OR #wt = :zero)";

/// A claim's holder (release deletes, extend keeps the TTL): as [`HELD`], and
/// not an inbox item (those are given back and extended by the inbox's own
/// updates, which keep them out of the TTL).
pub(crate) const CLAIM_HELD: &str =
    "#tk = :tk AND #st = :zero AND #dl > :now AND attribute_not_exists(#wt)";

/// A completion asked again: the record is done, by this token.
pub(crate) const DONE_BY: &str = "#tk = :tk AND #st = :one";

/// `forget`'s delete: the record is still the one read.
pub(crate) const FENCED: &str = "#tk = :tk";
/// An item exactly as it was read (I17): each change of an item moves its
/// wait, its attempts or its deadline, or gives it a new token.
pub(crate) const AS_READ: &str = "#tk = :tk AND #wt = :wt AND #at = :at AND #dl = :dl";

/// A completion: the done record; an inbox item's attributes go (removing
/// what a claim's record never had costs nothing).
pub(crate) const COMPLETE: &str =
    "SET #st = :one, #dl = :until, #cm = :now, #oc = :oc, #ex = :exp \
     REMOVE #wt, #pl, #le, #iq, #il, #ik, #to, #ma, #ok, #oe, #os";
pub(crate) const EXTEND: &str = "SET #dl = :until, #ex = :exp";

/// `expire()`'s scan filter, projection, and delete condition (never a record
/// claimed again since the scan). Inbox items expire only dead, past their
/// retention (I16): [`DEAD_UNCHANGED`] deletes one, never one replayed since.
/// An ordering key's queue item is scanned too (its version read): `expire()`
/// drops its finished entries, and the item once they all are.
pub(crate) const SCAN: &str = "(#dl <= :now AND attribute_not_exists(#wt)) \
     OR (#wt = :two AND #du <= :now) OR attribute_exists(#ov)";
pub(crate) const PROJECTION: &str = "#pk, #tk, #dl, #wt, #ov";
pub(crate) const UNCHANGED: &str =
    "#tk = :tk AND #dl = :dl AND #dl <= :now AND attribute_not_exists(#wt)";
pub(crate) const DEAD_UNCHANGED: &str = "#tk = :tk AND #wt = :two AND #du <= :now";

/// An inbox item held by this token: running, its deadline ahead.
pub(crate) const ITEM_HELD: &str = "#tk = :tk AND #wt = :zero AND #dl > :now";

/// A take: the item is due now and still as the index showed it, waiting
/// or held past its lease (a takeover, counted, I10).
/// (Waiting, never an ordered item: an index entry read before the item was
/// forgotten and accepted again with an ordering key must not lease it
/// past its queue.)
pub(crate) const DUE_WAITING: &str =
    "attribute_exists(#iq) AND #dl <= :now AND #wt = :one AND attribute_not_exists(#ok)";
pub(crate) const DUE_HELD: &str = "attribute_exists(#iq) AND #dl <= :now AND #wt = :zero";
/// The take of an ordering key's next item: due, waiting, and the very
/// item its queue's entry names (I15).
pub(crate) const DUE_ORDERED: &str =
    "attribute_exists(#iq) AND #dl <= :now AND #wt = :one AND #oe = :oe";
pub(crate) const LEASE: &str =
    "SET #tk = :tk, #dl = :until, #at = #at + :one, #wt = :zero, #iq = :q, #ik = :lk";
pub(crate) const LEASE_TAKEOVER: &str = "SET #tk = :tk, #dl = :until, #at = #at + :one, \
     #wt = :zero, #iq = :q, #ik = :lk, #to = if_not_exists(#to, :zero) + :one";

/// An item made due again by a replay: waiting, its dead retention gone.
pub(crate) const WAITING: &str = "SET #wt = :one, #dl = :due, #iq = :q, #ik = :lk REMOVE #du, #ex";
/// An item given back by its worker (a release): waiting, the attempt its
/// take counted taken back (I9).
pub(crate) const GIVEN_BACK: &str =
    "SET #wt = :one, #dl = :due, #iq = :q, #ik = :lk, #at = #at - :one";
/// A failure with a retry, and a dead one (out of the due index).
pub(crate) const FAIL_RETRY: &str =
    "SET #wt = :one, #dl = :due, #iq = :q, #ik = :lk, #le = :le, #eh = :eh";
/// Dead kept until forgotten, or until `:du` (`expire()`, and the TTL at
/// `:exp`, I16).
pub(crate) const FAIL_DEAD: &str =
    "SET #wt = :two, #dl = :due, #ik = :lk, #le = :le, #eh = :eh REMOVE #iq";
pub(crate) const FAIL_DEAD_UNTIL: &str = "SET #wt = :two, #dl = :due, #ik = :lk, #le = :le, \
     #eh = :eh, #du = :du, #ex = :exp REMOVE #iq";
/// A heartbeat of a held item (no TTL: items never expire).
pub(crate) const ITEM_EXTEND: &str = "SET #dl = :until, #iq = :q";
/// What replay makes due: a dead item, or a failed one not due yet (one
/// due already, a replay a moment ago, is left alone), without an ordering
/// key (one with a key is replayed with its queue, [`REPLAYABLE_ORDERED`]).
pub(crate) const REPLAYABLE: &str =
    "(#wt = :two OR (#wt = :one AND attribute_exists(#le) AND #dl > :due)) AND attribute_not_exists(#ok)";
/// An ordered item replayed: still the queue's entry read, and not dead
/// past its retention (its entry may be gone from the queue by then).
pub(crate) const REPLAYABLE_ORDERED: &str =
    "(#wt = :two OR (#wt = :one AND attribute_exists(#le) AND #dl > :due)) AND #oe = :oe \
     AND (attribute_not_exists(#du) OR #du > :now)";

/// An ordering key's queue (I15): an accept appends its entry; a take
/// rewrites it whole, on condition that it is the version read; a replay
/// gives it a new version (so a take that read the item as passable fails).
pub(crate) const QUEUE_APPEND: &str = "SET #oq = list_append(if_not_exists(#oq, :empty), :entry), \
     #ov = :v, #oh = if_not_exists(#oh, :nobody)";
pub(crate) const QUEUE_UNCHANGED: &str = "#ov = :v";
pub(crate) const QUEUE_RENEW: &str = "SET #ov = :new";
/// What the queue's walk reads of each item it names.
pub(crate) const ORDER_PROJECTION: &str = "#pk, #st, #wt, #dl, #du, #ok, #oe, #os";

/// The inbox's index queries.
pub(crate) const DUE_QUERY: &str = "#iq = :q AND #dl <= :now";
pub(crate) const LIST_QUERY: &str = "#il = :ns AND begins_with(#ik, :p)";
pub(crate) const OLDEST_QUERY: &str = "#iq = :q";

/// Every set of expressions one request carries: their attribute names are
/// worked out once, when the store is built, not on every request.
pub(crate) const REQUESTS: [&[&str]; 29] = [
    &[FRESH],
    &[TAKEOVER],
    &[COMPLETE, HELD],
    &[HELD],
    &[CLAIM_HELD],
    &[EXTEND, CLAIM_HELD],
    &[DUE_WAITING, LEASE],
    &[DUE_HELD, LEASE_TAKEOVER],
    &[GIVEN_BACK, ITEM_HELD],
    &[WAITING, REPLAYABLE],
    &[FAIL_RETRY, ITEM_HELD],
    &[FAIL_DEAD, ITEM_HELD],
    &[FAIL_DEAD_UNTIL, ITEM_HELD],
    &[DEAD_UNCHANGED],
    &[ITEM_EXTEND, ITEM_HELD],
    &[DUE_QUERY],
    &[LIST_QUERY],
    &[OLDEST_QUERY],
    &[SCAN, PROJECTION],
    &[UNCHANGED],
    &[FENCED],
    &[AS_READ],
    &[DONE_BY],
    &[LEASE, DUE_ORDERED],
    &[WAITING, REPLAYABLE_ORDERED],
    &[QUEUE_APPEND],
    &[QUEUE_UNCHANGED],
    &[QUEUE_RENEW, QUEUE_UNCHANGED],
    &[ORDER_PROJECTION],
];

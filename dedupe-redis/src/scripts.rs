//! The Lua scripts the store runs: one per operation, each one round trip, each
//! deciding with Redis' own clock (`TIME`) and writing in the same atomic step.
//! No read-modify-write ever happens on the client.
//!
//! A record is one string key holding the record encoded as in `codec.rs`:
//! `d1:<state>:<deadline ms>:<completed ms or ->:<attempts>:<first seen ms>:`
//! followed by four length-prefixed fields (`<len>:<bytes>`): token, claim id,
//! fingerprint, outcome. The scripts parse only what they decide on and write
//! whole records; a value they cannot parse is answered as corrupt (`-1`), never
//! as absent.
//!
//! An inbox item is the same key holding `i3:<wait>:<due ms>:<attempts>:<accepted
//! ms>:<has error>:<takeovers>:<attempt limit or ->:` and four length-prefixed
//! fields: token, last error, payload, and its failure history (a JSON array of
//! `[attempt, ms, error]`, the last `ERROR_HISTORY`, built with `cjson` by
//! FAIL; empty when none). An `i2:` item, written before the history was kept, has the
//! first three fields; an `i1:` item, written before takeovers were counted,
//! has neither count either and reads as 0 and `-`. (`wait` 0 held by a
//! worker, 1 due, 2 dead.) No TTL while it may run (a dead item expires with
//! its retention). Beside the records, each namespace has four index keys, kept
//! by the same scripts in the same atomic step (see `inbox.rs`): `<base>|wait`
//! (pending and failed items scored by due time), `<base>|held` (running items
//! scored by lease deadline), `<base>|ids` (every item as `<status>:<id>`,
//! score 0, for listing in id order and counting by status) and `<base>|dead`
//! (dead items scored by their retention's deadline).

use std::sync::LazyLock;

use redis::Script;

/// Shared by every script: the clock, the decoder and the encoder.
const PRELUDE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function num(n) return string.format('%.0f', n) end
local function decode(v)
  local st, ex, co, at, fs, pos = string.match(v, '^d1:([01]):(%d+):([%d%-]+):(%d+):(%d+):()')
  if not st then return nil end
  local f = {}
  for i = 1, 4 do
    local len, p = string.match(v, '^(%d+):()', pos)
    if not len then return nil end
    len = tonumber(len)
    f[i] = string.sub(v, p, p + len - 1)
    if string.len(f[i]) ~= len then return nil end
    pos = p + len
  end
  if pos ~= string.len(v) + 1 then return nil end
  return { state = st, expires = tonumber(ex), completed = co, attempts = tonumber(at),
           first = tonumber(fs), token = f[1], claim = f[2], fp = f[3], outcome = f[4] }
end
local function field(s) return string.len(s) .. ':' .. s end
local function encode(st, ex, co, at, fs, token, claim, fp, outcome)
  return 'd1:' .. st .. ':' .. num(ex) .. ':' .. co .. ':' .. num(at) .. ':' .. num(fs) .. ':'
    .. field(token) .. field(claim) .. field(fp) .. field(outcome)
end
"#;

/// Shared by every script: inbox items, their decoder, encoder and index.
/// `ks` are the namespace's index keys `{waiting, held, ids, dead, order,
/// seq}`: `order` is a hash naming each ordering key's held item, and
/// `<order>|<ordering key>` that key's queue (I15).
const ITEM: &str = r#"
local function is_item(v)
  local p = string.sub(v, 1, 3)
  return p == 'i3:' or p == 'i2:' or p == 'i1:'
end
local function idecode(v)
  local nf = 3
  local seq, sk = '-', '0'
  local w, du, at, ac, he, to, ma, sq, skp, p3 =
    string.match(v, '^i3:([012]):(%d+):(%d+):(%d+):([01]):(%d+):([%d%-]+):([%d%-]+):([01]):()')
  local pos
  if w then
    seq, sk, pos, nf = sq, skp, p3, 5
  else
    w, du, at, ac, he, to, ma, pos =
      string.match(v, '^i2:([012]):(%d+):(%d+):(%d+):([01]):(%d+):([%d%-]+):()')
  end
  if w then
    if ma == '-' then ma = false else ma = tonumber(ma); if not ma or ma < 1 then return nil end end
  else
    w, du, at, ac, he, pos = string.match(v, '^i1:([012]):(%d+):(%d+):(%d+):([01]):()')
    if not w then return nil end
    to, ma = '0', false
  end
  local f = {}
  for i = 1, nf do
    local len, p = string.match(v, '^(%d+):()', pos)
    if not len then return nil end
    len = tonumber(len)
    f[i] = string.sub(v, p, p + len - 1)
    if string.len(f[i]) ~= len then return nil end
    pos = p + len
  end
  if pos ~= string.len(v) + 1 then return nil end
  local err = false
  if he == '1' then err = f[2] elseif f[2] ~= '' then return nil end
  -- An ordering key has its place (seq); no key, none.
  local okey = false
  if f[5] and f[5] ~= '' then okey = f[5] end
  if (okey and seq == '-') or (not okey and (seq ~= '-' or sk ~= '0')) then return nil end
  if seq == '-' then seq = false else seq = tonumber(seq); if not seq then return nil end end
  return { wait = tonumber(w), due = tonumber(du), attempts = tonumber(at), accepted = tonumber(ac),
           token = f[1], err = err, payload = f[3], takeovers = tonumber(to), max = ma,
           hist = f[4] or '', okey = okey, seq = seq, skip = sk == '1' }
end
local function iencode(r)
  local he = '0'
  if r.err then he = '1' end
  local ma = '-'
  if r.max then ma = num(r.max) end
  local seq, sk = '-', '0'
  if r.okey then seq = num(r.seq) end
  if r.okey and r.skip then sk = '1' end
  return 'i3:' .. r.wait .. ':' .. num(r.due) .. ':' .. num(r.attempts) .. ':' .. num(r.accepted)
    .. ':' .. he .. ':' .. num(r.takeovers) .. ':' .. ma .. ':' .. seq .. ':' .. sk .. ':'
    .. field(r.token) .. field(r.err or '') .. field(r.payload) .. field(r.hist or '')
    .. field(r.okey or '')
end
local function icopy(r)
  return { wait = r.wait, due = r.due, attempts = r.attempts, accepted = r.accepted,
           token = r.token, err = r.err, payload = r.payload, takeovers = r.takeovers, max = r.max,
           hist = r.hist, okey = r.okey, seq = r.seq, skip = r.skip }
end
local function istatus(r)
  if not r then return nil end
  if r.wait == 0 then return 'r' elseif r.wait == 2 then return 'd' elseif r.err then return 'f' end
  return 'p'
end
local function reindex(ks, id, old, new)
  if not ks[3] then return error('dedupe: an inbox item met without its index keys') end
  local so, sn = istatus(old), istatus(new)
  if so ~= sn then
    if so then redis.call('ZREM', ks[3], so .. ':' .. id) end
    if sn then redis.call('ZADD', ks[3], 0, sn .. ':' .. id) end
  end
  if new and new.wait == 1 then redis.call('ZADD', ks[1], num(new.due), id)
  else redis.call('ZREM', ks[1], id) end
  if new and new.wait == 0 then redis.call('ZADD', ks[2], num(new.due), id)
  else redis.call('ZREM', ks[2], id) end
  -- A dead item's retention entry (see FAIL) goes when it stops being dead.
  if old and old.wait == 2 and not (new and new.wait == 2) then redis.call('ZREM', ks[4], id) end
  -- Per-key order (I15): the key's queue holds its items by accept order,
  -- but for a dead one accepted to be skipped; the order hash names each
  -- key's held item (one at most).
  local ok = (old and old.okey) or (new and new.okey)
  if ok then
    local function queued(r) return r and not (r.wait == 2 and r.skip) end
    local q = ks[5] .. '|' .. ok
    local qo, qn = queued(old), queued(new)
    if qn and not qo then redis.call('ZADD', q, num(new.seq), id)
    elseif qo and not qn then redis.call('ZREM', q, id) end
    local ho, hn = old and old.wait == 0, new and new.wait == 0
    if hn and not ho then redis.call('HSET', ks[5], ok, id)
    elseif ho and not hn and redis.call('HGET', ks[5], ok) == id then
      redis.call('HDEL', ks[5], ok)
    end
  end
end
-- The item at the record key `KEYS[1]`, written with its index
-- (`KEYS[2..7]`), `id` its id. The write drops any TTL the key had (a dead
-- item's retention).
local function iput(id, old, new)
  if new then redis.call('SET', KEYS[1], iencode(new)) else redis.call('DEL', KEYS[1]) end
  reindex({KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, id, old, new)
end
-- The inbox item `v` (a record key's value) as a call under token `tk`
-- finds it: the decoded item when it carries that token, else nil and the
-- call's answer: `0` none or another's, `-1` corrupt, `-2` a claim's lease.
local function leased_item(v, tk)
  if not v then return nil, 0 end
  if not is_item(v) then
    local d = decode(v)
    if not d then return nil, -1 end
    if d.state == '0' and d.token == tk and d.expires > now then return nil, -2 end
    return nil, 0
  end
  local r = idecode(v)
  if not r then return nil, -1 end
  if r.token ~= tk then return nil, 0 end
  return r, 1
end
"#;

/// For the claim scripts: the answer code of a live record `v` met by a claim
/// sending token `tk` (`1` when the record is this claim's own, written by an
/// earlier sending of the same call; `0` another's), or `nil` when `v` is not
/// live (or its header does not parse: the caller decodes it in full).
const LIVE: &str = r#"
local function live_answer(v, tk)
  local st, ex, tl, tp = string.match(v, '^d1:([01]):(%d+):[%d%-]+:%d+:%d+:(%d+):()')
  if not st or tonumber(ex) <= now then return nil end
  if st == '0' and string.sub(v, tp, tp + tonumber(tl) - 1) == tk then return 1 end
  return 0
end
"#;

/// KEYS[1] record; ARGV claim id ('' for none), fingerprint ('' for none),
/// lease ms, grace ms (how long the key outlives the lease, so a takeover still
/// finds it), token (the arguments of [`CLAIM_MANY`], for one key). Answers `{1, record}` when this claim won, `{0, record}` with the
/// live record that stopped it, `{-1, value}` for a value that does not decode.
///
/// The key is read first: a live record (a duplicate, a claim in flight) is
/// answered as stored after reading only its header and token (the client
/// decodes the whole value and refuses a malformed one), so a duplicate builds
/// nothing and writes nothing. A live record holding this call's own token is
/// this very claim, sent again by the driver after its answer was lost: it is
/// answered won (`1`), as the first sending would have been. An absent key is claimed with `SET NX PX`; an expired record
/// is taken over with `SET XX PX` (one more attempt when it was in flight; a
/// fresh start when it was done). The script runs atomically, so nothing comes
/// between its read and its write; should `SET NX` ever find the key anyway,
/// the script fails with an error rather than answer a claim it did not make.
const CLAIM: &str = r#"
local old = redis.call('GET', KEYS[1])
local attempts, first = 1, now
if old then
  -- An inbox item holds its key until it is done: answered as in flight.
  if is_item(old) then
    if idecode(old) then return {0, old} end
    return {-1, old}
  end
  local code = live_answer(old, ARGV[5])
  if code then return {code, old} end
  local r = decode(old)
  if not r then return {-1, old} end
  if r.state == '0' then attempts, first = r.attempts + 1, r.first end
end
local lease = tonumber(ARGV[3])
local record = encode('0', now + lease, '-', attempts, first, ARGV[5], ARGV[1], ARGV[2], '')
if old then
  redis.call('SET', KEYS[1], record, 'XX', 'PX', lease + tonumber(ARGV[4]))
elseif not redis.call('SET', KEYS[1], record, 'NX', 'PX', lease + tonumber(ARGV[4])) then
  return redis.error_reply('dedupe: the key appeared inside the claim script')
end
return {1, record}
"#;

/// The batch form of [`CLAIM`], for distinct keys that share a server:
/// KEYS the records; ARGV claim id, fingerprint, lease ms, grace ms, then one
/// token per key. Answers `{code, record}` for each key in order, the codes
/// and records of [`CLAIM`].
///
/// Every key is read and decoded in full before any is written: a value that
/// does not decode, live or expired, answers the whole call `{-1, i, value}`
/// (the i-th key) with nothing written, so a batch meeting a corrupt record
/// claims none of its keys.
/// Then each key with no live record is claimed as [`CLAIM`] claims it. One
/// script call instead of one per key: the server's cost of a call (finding
/// the script, its clock, its set-up) is paid once per batch.
const CLAIM_MANY: &str = r#"
local lease, grace = tonumber(ARGV[3]), tonumber(ARGV[4])
local plan = {}
for i = 1, #KEYS do
  local old = redis.call('GET', KEYS[i])
  local attempts, first, live = 1, now, false
  if old then
    -- Decoded in full, live or not: the client would refuse a live record
    -- that does not decode after the other keys had been claimed.
    if is_item(old) then
      if not idecode(old) then return {-1, i, old} end
      live = 0
    else
      local r = decode(old)
      if not r then return {-1, i, old} end
      live = live_answer(old, ARGV[4 + i])
      if not live and r.state == '0' then attempts, first = r.attempts + 1, r.first end
    end
  end
  plan[i] = {old, attempts, first, live}
end
local answers = {}
for i = 1, #KEYS do
  local old, attempts, first, live = plan[i][1], plan[i][2], plan[i][3], plan[i][4]
  if live then
    answers[2 * i - 1], answers[2 * i] = live, old
  else
    local record = encode('0', now + lease, '-', attempts, first, ARGV[4 + i], ARGV[1], ARGV[2], '')
    if old then
      redis.call('SET', KEYS[i], record, 'XX', 'PX', lease + grace)
    elseif not redis.call('SET', KEYS[i], record, 'NX', 'PX', lease + grace) then
      return redis.error_reply('dedupe: the key appeared inside the claim script')
    end
    answers[2 * i - 1], answers[2 * i] = 1, record
  end
end
return answers
"#;

/// Whether the record `v` is held by token ARGV[1]: in flight, same token, its
/// deadline ahead. Answers the decoded record, or the script's answer code.
const HELD: &str = r#"
local function held(v)
  if not v then return nil, 0 end
  local r = decode(v)
  if not r then return nil, -1 end
  if r.state ~= '0' or r.token ~= ARGV[1] or r.expires <= now then return nil, 0 end
  return r, 1
end
"#;

/// An inbox item held by token ARGV[1]: running, same token, its deadline
/// ahead. Answers the decoded item, or the script's answer code.
const IHELD: &str = r#"
local function iheld(v)
  local r = idecode(v)
  if not r then return nil, -1 end
  if r.wait ~= 0 or r.token ~= ARGV[1] or r.due <= now then return nil, 0 end
  return r, 1
end
"#;

/// KEYS[1] (then, where the store keeps an inbox, the namespace's index
/// keys); ARGV token, retention ms, outcome, id. `1` done, `0` lease lost,
/// `-1` corrupt. The key then lives exactly the retention. A live record this
/// token already completed with this outcome (the same complete sent again)
/// answers `1` and is left as it is. A held inbox item becomes the done
/// record, and leaves the index.
const COMPLETE: &str = r#"
local v = redis.call('GET', KEYS[1])
local keep = tonumber(ARGV[2])
if v and is_item(v) then
  local r, code = iheld(v)
  if not r then return code end
  redis.call('SET', KEYS[1], encode('1', now + keep, num(now), r.attempts, r.accepted, r.token, '', '', ARGV[3]), 'PX', keep)
  reindex({KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, ARGV[4], r, nil)
  return 1
end
local r, code = held(v)
if not r then
  local d = code == 0 and v and decode(v)
  if d and d.state == '1' and d.token == ARGV[1] and d.outcome == ARGV[3] and d.expires > now then
    return 1
  end
  return code
end
redis.call('SET', KEYS[1], encode('1', now + keep, num(now), r.attempts, r.first, r.token, r.claim, r.fp, ARGV[3]), 'PX', keep)
return 1
"#;

/// KEYS[1] (and the index keys); ARGV token, id, the wake-up channel, the
/// namespace. `1` removed, or no live
/// record under the key (the lease passed, or the same release sent again
/// finds its work done; an expired record is left for its attempt count); `0`
/// a live record of another lease, or a done one; `-1` corrupt. A held inbox
/// item is given back due now, the attempt its take counted taken back (I9),
/// and its namespace's workers woken (I14); one this token gave back already (the same release sent again) answers
/// `1` and changes nothing.
const RELEASE: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and is_item(v) then
  local r, code = iheld(v)
  if not r then
    local d = code == 0 and idecode(v)
    if d and d.wait == 1 and d.token == ARGV[1] and d.due <= now then return 1 end
    return code
  end
  local back = icopy(r)
  back.wait, back.due, back.attempts = 1, now, r.attempts - 1
  iput(ARGV[2], r, back)
  redis.call('PUBLISH', ARGV[3], ARGV[4])
  return 1
end
local r, code = held(v)
if r then
  redis.call('DEL', KEYS[1])
  return 1
end
if code == -1 then return -1 end
if not v or decode(v).expires <= now then return 1 end
return 0
"#;

/// KEYS[1] (and the index keys); ARGV token, lease ms, grace ms, id. `{1,
/// deadline}` extended, `{0}` lease lost, `{-1}` corrupt.
const EXTEND: &str = r#"
local v = redis.call('GET', KEYS[1])
local lease = tonumber(ARGV[2])
local deadline = now + lease
if v and is_item(v) then
  local r, code = iheld(v)
  if not r then return {code} end
  local kept = icopy(r)
  kept.due = deadline
  iput(ARGV[4], r, kept)
  return {1, num(deadline)}
end
local r, code = held(v)
if not r then return {code} end
redis.call('SET', KEYS[1], encode('0', deadline, '-', r.attempts, r.first, r.token, r.claim, r.fp, ''), 'PX', lease + tonumber(ARGV[3]))
return {1, num(deadline)}
"#;

/// KEYS[1]. `{1, record}` live (an inbox item always is), `{0}` absent or
/// expired, `{-1, value}` corrupt.
const GET: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return {0} end
if is_item(v) then
  if idecode(v) then return {1, v} end
  return {-1, v}
end
local r = decode(v)
if not r then return {-1, v} end
if r.expires <= now then return {0} end
return {1, v}
"#;

/// KEYS[1]. What `forget` removes: `{0}` nothing is there, `{1, token, live}`
/// the record's token and whether it is live (`1`) or expired (`0`), `{-1}`
/// corrupt.
const PEEK: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return {0} end
if is_item(v) then
  local r = idecode(v)
  if not r then return {-1} end
  return {1, r.token, 1}
end
local r = decode(v)
if not r then return {-1} end
if r.expires > now then return {1, r.token, 1} end
return {1, r.token, 0}
"#;

/// KEYS[1] (and the index keys); ARGV the token [`PEEK`] read, id. `1` the
/// record of that token was removed (an item: and its index entries); `2`
/// it is gone already (another forget, or its expiry, since the peek: that
/// one answers that it found it); `0` another record is there
/// now (a newer claim, which a forget asked before it never removes); `-1`
/// corrupt (left in place).
const FORGET: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return 2 end
if is_item(v) then
  local r = idecode(v)
  if not r then return -1 end
  if r.token ~= ARGV[1] then return 0 end
  iput(ARGV[2], r, nil)
  return 1
end
local r = decode(v)
if not r then return -1 end
if r.token ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"#;

/// KEYS record, then the index keys {waiting, held, ids, dead, order, seq};
/// ARGV id, payload, token, delay ms (0: due now; else its `not_before`), the
/// item's attempt limit (`-`: none), the wake-up channel, the namespace
/// (published when the item is due now, I14), the ordering key (`''`: none;
/// the item takes the namespace's next `seq` and joins the key's queue) and
/// whether it is skipped when dead (`1`). `{1}` stored, due after the delay (or this very accept's item, sent again by
/// the driver: the item still holds its token); `{2, value}` an item holds
/// the key; `{3, value}` a live record (done, or a claim in flight); `{-1,
/// value}` corrupt. An expired claim's attempts and first sight are kept, as
/// a takeover keeps them.
const ACCEPT: &str = r#"
local old = redis.call('GET', KEYS[1])
local attempts, first = 0, now
if old then
  if is_item(old) then
    local r = idecode(old)
    if not r then return {-1, old} end
    if r.token == ARGV[3] then return {1} end
    return {2, old}
  end
  local r = decode(old)
  if not r then return {-1, old} end
  if r.expires > now then return {3, old} end
  if r.state == '0' then attempts, first = r.attempts, r.first end
end
-- A dead item of this id that expired leaves its index entries: dropped.
if not old and redis.call('ZSCORE', KEYS[5], ARGV[1]) then
  redis.call('ZREM', KEYS[5], ARGV[1])
  redis.call('ZREM', KEYS[4], 'd:' .. ARGV[1])
end
local max = false
if ARGV[5] ~= '-' then max = tonumber(ARGV[5]) end
local okey, seq = false, false
if ARGV[8] ~= '' then okey, seq = ARGV[8], redis.call('INCR', KEYS[7]) end
iput(ARGV[1], nil, { wait = 1, due = now + tonumber(ARGV[4]), attempts = attempts, accepted = first,
                     token = ARGV[3], err = false, payload = ARGV[2], takeovers = 0, max = max,
                     hist = '', okey = okey, seq = seq, skip = okey and ARGV[9] == '1' })
if tonumber(ARGV[4]) == 0 then redis.call('PUBLISH', ARGV[6], ARGV[7]) end
return {1}
"#;

/// KEYS the index keys {waiting, held, ids}, the namespace's pause key
/// (`<base>|paused`: a paused namespace hands out nothing, I13), its `dead`
/// set (up to 16 entries past their retention are dropped, with their `ids`
/// entries: their keys expired, I16) and its `order` hash (an item of an
/// ordering key is handed out only at the head of its key's queue, no other
/// of the key held: I15; the take reads up to `max + 100` due entries,
/// `ORDER_SCAN`); ARGV the record keys' base
/// (`<prefix><namespace>:`), max, lease ms, then `max` tokens. Leases the
/// due items, oldest due first: the first `max` (and a few more, so that
/// items that do not decode cannot hold the queue) of the waiting set due by
/// now and of the held set past their deadline, merged by score. An item
/// that does not decode is left in place and named in the answer; an index
/// entry whose key holds no item (written around the scripts) is dropped.
/// A held item (its worker's lease passed) is a takeover, counted. Answers
/// the count of items that did not decode and their ids, then ten values
/// per item taken: id, token, deadline, attempt, payload, last error (nil
/// when none), takeovers, attempt limit (`-` when none), accept time,
/// ordering key (`''` when none).
const TAKE: &str = r#"
-- Redis expires a key once its time has passed (`now > deadline`): so
-- does this.
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', '(' .. num(now), 'LIMIT', 0, 16)) do
  redis.call('ZREM', KEYS[5], id)
  redis.call('ZREM', KEYS[3], 'd:' .. id)
end
if redis.call('EXISTS', KEYS[4]) == 1 then return {0} end
local ks = {KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[6], KEYS[7]}
local max, lease = tonumber(ARGV[2]), tonumber(ARGV[3])
local function due(k, from, n)
  return redis.call('ZRANGEBYSCORE', k, '-inf', num(now), 'WITHSCORES', 'LIMIT', from, n)
end
-- Whether item `id` of ordering key `ok` may be handed out (I15): it heads
-- its key's queue (entries whose item is gone, expired or of another key
-- are dropped on the way) and no other item of the key is held.
-- Per ordering key, what this take learnt: `used` keys it picked an item
-- of, `holders` each key's held item (false: none), `heads` the first item
-- of its queue. Items of one key may come in any order here (due times tie
-- and move; a held one comes by its lease), so only the item a memo names
-- is let through, never the key barred.
local used, holders, heads = {}, {}, {}
local function free(id, r)
  local ok = r.okey
  if not ok then return true end
  if used[ok] then return false end
  -- Another item of the key held (one whose record went outside the
  -- scripts, evicted or deleted, holds nothing: its entry goes; a held
  -- item's record cannot become anything else without the scripts, which
  -- clear the entry).
  local holder = holders[ok]
  if holder == nil then
    holder = redis.call('HGET', KEYS[6], ok) or false
    if holder and redis.call('EXISTS', ARGV[1] .. holder) == 0 then
      redis.call('HDEL', KEYS[6], ok)
      holder = false
    end
    holders[ok] = holder
  end
  if holder and holder ~= id then return false end
  -- Held itself, past its lease: the takeover comes first, whatever waits
  -- before it (an earlier item replayed while it ran).
  if r.wait == 0 then return true end
  local head = heads[ok]
  if head == nil then
    local q = KEYS[6] .. '|' .. ok
    for _ = 1, 16 do
      head = redis.call('ZRANGE', q, 0, 0)[1]
      if not head or head == id then break end
      local hv = redis.call('GET', ARGV[1] .. head)
      local hr = hv and is_item(hv) and idecode(hv)
      if hr and hr.okey == ok then break end
      if hv and is_item(hv) and not hr then break end
      redis.call('ZREM', q, head)
    end
    heads[ok] = head or false
  end
  return head == id
end
-- The due entries of both sets merged by score: a few past `max` first
-- (items that do not decode cannot hold the queue), and the next ones up to
-- ORDER_SCAN (100) past it only when items of ordering keys were passed over
-- and a set had more: reading 100 entries on every take cost the server 10
-- µs a call against under 2 for 9 (Redis 16-task take-and-complete 8,965 a
-- second against 13,987, bench/README.md 2026-12-07).
local first = max + 8
local a, b = due(KEYS[1], 0, first), due(KEYS[2], 0, first)
local ia, ib, picked, corrupt, passed, extended = 1, 1, {}, {}, false, false
while #picked < max do
  if ia > #a and ib > #b then
    if extended or not passed or (#a < 2 * first and #b < 2 * first) then break end
    extended = true
    for _, more in ipairs({{a, KEYS[1]}, {b, KEYS[2]}}) do
      if #more[1] >= 2 * first then
        for _, v in ipairs(due(more[2], first, 92)) do more[1][#more[1] + 1] = v end
      end
    end
    if ia > #a and ib > #b then break end
  end
  local id
  if ib > #b or (ia <= #a and tonumber(a[ia + 1]) <= tonumber(b[ib + 1])) then
    id = a[ia]; ia = ia + 2
  else
    id = b[ib]; ib = ib + 2
  end
  local v = redis.call('GET', ARGV[1] .. id)
  if v and is_item(v) then
    local r = idecode(v)
    if not r then corrupt[#corrupt + 1] = id
    elseif r.wait ~= 2 and r.due <= now then
      if free(id, r) then
        picked[#picked + 1] = {id, r}
        if r.okey then used[r.okey] = true end
      else
        passed = true
      end
    end
  else
    for _, st in ipairs({'p', 'r', 'f', 'd'}) do redis.call('ZREM', KEYS[3], st .. ':' .. id) end
    redis.call('ZREM', KEYS[1], id)
    redis.call('ZREM', KEYS[2], id)
  end
end
local out = {#corrupt}
for _, id in ipairs(corrupt) do out[#out + 1] = id end
for i, pick in ipairs(picked) do
  local id, r = pick[1], pick[2]
  local new = icopy(r)
  new.wait, new.due, new.attempts, new.token = 0, now + lease, r.attempts + 1, ARGV[3 + i]
  if r.wait == 0 then new.takeovers = r.takeovers + 1 end
  redis.call('SET', ARGV[1] .. id, iencode(new))
  reindex(ks, id, r, new)
  local max = '-'
  if new.max then max = num(new.max) end
  -- Six values then three, by index: a nil error would end an ipairs walk.
  local vals = {id, new.token, num(new.due), new.attempts, new.payload, r.err}
  for j = 1, 6 do out[#out + 1] = vals[j] end
  out[#out + 1] = num(new.takeovers)
  out[#out + 1] = max
  out[#out + 1] = num(new.accepted)
  out[#out + 1] = new.okey or ''
end
return out
"#;

/// KEYS record, then the index keys; ARGV id, token, error, delay ms (`''`:
/// dead), a dead item's retention ms (`''`: kept until forgotten), the
/// failures the history keeps (`ERROR_HISTORY`). `1`
/// failed as asked (or failed so by this lease already: the same fail sent
/// again), `0` lease lost, `-1` corrupt, `-2` the lease is a claim's, not an
/// item's. A dead item with a retention expires with it (`PEXPIREAT`, I16)
/// and is entered in the namespace's `dead` set at its deadline (`+inf`
/// when kept): COUNTS leaves out the entries past their deadline, and TAKE
/// and ACCEPT drop them with the `ids` entry of the key that expired.
const FAIL: &str = r#"
local r, code = leased_item(redis.call('GET', KEYS[1]), ARGV[2])
if not r then return code end
if r.wait ~= 0 then
  if r.err == ARGV[3] and ((ARGV[4] == '') == (r.wait == 2)) then return 1 end
  return 0
end
if r.due <= now then return 0 end
local new = icopy(r)
new.err = ARGV[3]
-- The failure joins the item's history, the oldest past ARGV[6] dropped.
local h = {}
if r.hist ~= '' then
  local ok, old = pcall(cjson.decode, r.hist)
  if not ok or type(old) ~= 'table' then return -1 end
  h = old
end
h[#h + 1] = {r.attempts, now, ARGV[3]}
while #h > tonumber(ARGV[6]) do table.remove(h, 1) end
new.hist = cjson.encode(h)
if ARGV[4] == '' then new.wait, new.due = 2, now
else new.wait, new.due = 1, now + tonumber(ARGV[4]) end
iput(ARGV[1], r, new)
if new.wait == 2 then
  if ARGV[5] == '' then redis.call('ZADD', KEYS[5], '+inf', ARGV[1])
  else
    local until_ms = now + tonumber(ARGV[5])
    redis.call('PEXPIREAT', KEYS[1], num(until_ms))
    redis.call('ZADD', KEYS[5], num(until_ms), ARGV[1])
  end
end
return 1
"#;

/// KEYS record, then the index keys; ARGV id, token, delay ms. `1` the held
/// item snoozed: due the delay from now, the attempt its take counted taken
/// back (I12), or one waiting under this token already (the same snooze sent
/// again, left as it is); `0` lease lost, `-1` corrupt, `-2` the lease is a
/// claim's, not an item's.
const SNOOZE: &str = r#"
local r, code = leased_item(redis.call('GET', KEYS[1]), ARGV[2])
if not r then return code end
if r.wait == 1 then return 1 end
if r.wait ~= 0 or r.due <= now then return 0 end
local new = icopy(r)
new.wait, new.due, new.attempts = 1, now + tonumber(ARGV[3]), r.attempts - 1
iput(ARGV[1], r, new)
return 1
"#;

/// KEYS record, then the index keys; ARGV id, the wake-up channel, the
/// namespace. `1` a dead or failed item made due now, its attempts and error
/// kept, its namespace's workers woken; `0` no such item; `-1` corrupt.
const REPLAY: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
if not is_item(v) then
  if decode(v) then return 0 end
  return -1
end
local r = idecode(v)
if not r then return -1 end
if not (r.wait == 2 or (r.wait == 1 and r.err and r.due > now)) then return 0 end
local new = icopy(r)
new.wait, new.due = 1, now
iput(ARGV[1], r, new)
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"#;

/// KEYS as `REPLAY`'s; ARGV id, status code (0 pending, 1 running, 2
/// failed, 3 dead), attempts. The item removed, as a forget removes it,
/// only while it is in that status at that attempt (I17): `1` removed, `0`
/// not (moved on, a record, or nothing), `-1` corrupt.
const FORGET_IF: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
if not is_item(v) then
  if decode(v) then return 0 end
  return -1
end
local r = idecode(v)
if not r then return -1 end
local st = 0
if r.wait == 0 then st = 1 elseif r.wait == 2 then st = 3 elseif r.err then st = 2 end
if st ~= tonumber(ARGV[2]) or r.attempts ~= tonumber(ARGV[3]) then return 0 end
iput(ARGV[1], r, nil)
return 1
"#;

/// KEYS ids; ARGV statuses (some of `prfd`), after (`''` from the start),
/// limit. Up to `limit` ids of each status after `after`, in the set's
/// (byte) order, as `<status>:<id>`; the caller merges them.
const LIST: &str = r#"
local out = {}
for i = 1, string.len(ARGV[1]) do
  local st = string.sub(ARGV[1], i, i)
  local from = '[' .. st .. ':'
  if ARGV[2] ~= '' then from = '(' .. st .. ':' .. ARGV[2] end
  for _, m in ipairs(redis.call('ZRANGEBYLEX', KEYS[1], from, '(' .. st .. ';', 'LIMIT', 0, tonumber(ARGV[3]))) do
    out[#out + 1] = m
  end
end
return out
"#;

/// KEYS ids (routes the call to the namespace's node); ARGV the record
/// keys' base, then ids. Each id's value (nil when absent).
const VALUES: &str = r#"
local out = {}
for i = 2, #ARGV do out[#out + 1] = redis.call('GET', ARGV[1] .. ARGV[i]) end
return out
"#;

/// KEYS waiting, ids, dead. Pending, running, failed and dead counts, then
/// the oldest due time of a waiting item (nil when none). The dead items
/// past their retention have expired but may keep their `ids` entries until
/// a take drops them: they are not counted.
const COUNTS: &str = r#"
local out = {}
for _, st in ipairs({'p', 'r', 'f', 'd'}) do
  out[#out + 1] = redis.call('ZLEXCOUNT', KEYS[2], '[' .. st .. ':', '(' .. st .. ';')
end
out[4] = out[4] - redis.call('ZCOUNT', KEYS[3], '-inf', '(' .. num(now))
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
out[5] = first[2] or false
return out
"#;

fn script(body: &str) -> Script {
    Script::new(&format!("{PRELUDE}{ITEM}{LIVE}{HELD}{IHELD}{body}"))
}

/// The scripts, built once (each carries its SHA1 for `EVALSHA`).
pub(crate) struct Scripts {
    pub(crate) claim: Script,
    pub(crate) claim_many: Script,
    pub(crate) complete: Script,
    pub(crate) release: Script,
    pub(crate) extend: Script,
    pub(crate) get: Script,
    pub(crate) peek: Script,
    pub(crate) forget: Script,
    pub(crate) forget_if: Script,
    pub(crate) accept: Script,
    pub(crate) take: Script,
    pub(crate) fail: Script,
    pub(crate) snooze: Script,
    pub(crate) replay: Script,
    pub(crate) list: Script,
    pub(crate) values: Script,
    pub(crate) counts: Script,
    pub(crate) pause: Script,
    pub(crate) resume: Script,
    pub(crate) paused: Script,
}

pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: script(CLAIM),
    claim_many: script(CLAIM_MANY),
    complete: script(COMPLETE),
    release: script(RELEASE),
    extend: script(EXTEND),
    get: script(GET),
    peek: script(PEEK),
    forget: script(FORGET),
    forget_if: script(FORGET_IF),
    accept: script(ACCEPT),
    take: script(TAKE),
    fail: script(FAIL),
    snooze: script(SNOOZE),
    replay: script(REPLAY),
    list: script(LIST),
    values: script(VALUES),
    counts: script(COUNTS),
    pause: script(PAUSE),
    resume: script(RESUME),
    paused: script(PAUSED),
});

/// KEYS the namespace's pause key: set (to the time of the pause) unless it
/// is; 1 when this call set it. No TTL: a pause lasts until a resume.
const PAUSE: &str = r#"
if redis.call('SET', KEYS[1], num(now), 'NX') then return 1 end
return 0
"#;

/// KEYS the namespace's pause key; ARGV the wake-up channel and the
/// namespace. Removed (its namespace's workers woken); 1 when it was there.
const RESUME: &str = r#"
local gone = redis.call('DEL', KEYS[1])
if gone == 1 then redis.call('PUBLISH', ARGV[1], ARGV[2]) end
return gone
"#;

/// KEYS the namespace's pause key: 1 when it is there.
const PAUSED: &str = r#"
return redis.call('EXISTS', KEYS[1])
"#;

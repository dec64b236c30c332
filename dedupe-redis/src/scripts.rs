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
    local r = decode(old)
    if not r then return {-1, i, old} end
    live = live_answer(old, ARGV[4 + i])
    if not live and r.state == '0' then attempts, first = r.attempts + 1, r.first end
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

/// KEYS[1]; ARGV token, retention ms, outcome. `1` done, `0` lease lost, `-1`
/// corrupt. The key then lives exactly the retention. A live record this token
/// already completed with this outcome (the same complete sent again) answers
/// `1` and is left as it is.
const COMPLETE: &str = r#"
local v = redis.call('GET', KEYS[1])
local r, code = held(v)
if not r then
  local d = code == 0 and v and decode(v)
  if d and d.state == '1' and d.token == ARGV[1] and d.outcome == ARGV[3] and d.expires > now then
    return 1
  end
  return code
end
local keep = tonumber(ARGV[2])
redis.call('SET', KEYS[1], encode('1', now + keep, num(now), r.attempts, r.first, r.token, r.claim, r.fp, ARGV[3]), 'PX', keep)
return 1
"#;

/// KEYS[1]; ARGV token. `1` removed, or no live record under the key (the
/// lease passed, or the same release sent again finds its work done; an expired
/// record is left for its attempt count); `0` a live record of another lease,
/// or a done one; `-1` corrupt.
const RELEASE: &str = r#"
local v = redis.call('GET', KEYS[1])
local r, code = held(v)
if r then
  redis.call('DEL', KEYS[1])
  return 1
end
if code == -1 then return -1 end
if not v or decode(v).expires <= now then return 1 end
return 0
"#;

/// KEYS[1]; ARGV token, lease ms, grace ms. `{1, deadline}` extended, `{0}` lease
/// lost, `{-1}` corrupt.
const EXTEND: &str = r#"
local r, code = held(redis.call('GET', KEYS[1]))
if not r then return {code} end
local lease = tonumber(ARGV[2])
local deadline = now + lease
redis.call('SET', KEYS[1], encode('0', deadline, '-', r.attempts, r.first, r.token, r.claim, r.fp, ''), 'PX', lease + tonumber(ARGV[3]))
return {1, num(deadline)}
"#;

/// KEYS[1]. `{1, record}` live, `{0}` absent or expired, `{-1, value}` corrupt.
const GET: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return {0} end
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
local r = decode(v)
if not r then return {-1} end
if r.expires > now then return {1, r.token, 1} end
return {1, r.token, 0}
"#;

/// KEYS[1]; ARGV the token [`PEEK`] read. `1` the record of that token was
/// removed, or is gone already (the same forget sent again); `0` another
/// record is there now (a newer claim, which a forget asked before it never
/// removes); `-1` corrupt (left in place).
const FORGET: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v then return 1 end
local r = decode(v)
if not r then return -1 end
if r.token ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"#;

fn script(body: &str) -> Script {
    Script::new(&format!("{PRELUDE}{LIVE}{HELD}{body}"))
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
});

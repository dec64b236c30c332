//! What the server is and promises, read at connect and on demand: its
//! version, whether it may evict records, what it keeps across a restart.

use dedupe_core::{Error, Result};
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::Value;

use crate::conn::Conn;

/// The oldest Redis the store runs on: its scripts rely on effects
/// replication of scripts reading `TIME` and on the error replies of 7.0.
pub(crate) const MIN_MAJOR_VERSION: u32 = 7;

/// Runs `cmd` on the server, or on every primary of a Cluster; one answer per
/// server, with its address.
pub(crate) async fn on_every_server(
    conn: &mut Conn,
    cmd: &redis::Cmd,
) -> redis::RedisResult<Vec<(String, Value)>> {
    match conn {
        Conn::Single(c) => Ok(vec![("the server".to_string(), cmd.query_async(c).await?)]),
        Conn::Cluster(c) => {
            let answer = c
                .route_command(
                    cmd.clone(),
                    RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
                )
                .await?;
            let Value::Map(pairs) = answer else {
                return Ok(vec![("a Cluster node".to_string(), answer)]);
            };
            Ok(pairs
                .into_iter()
                .map(|(addr, v)| {
                    let addr = match addr {
                        Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                        other => format!("{other:?}"),
                    };
                    (addr, v)
                })
                .collect())
        }
    }
}

/// The `field:value` of an `INFO` answer.
pub(crate) fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines().find_map(|line| {
        let (name, value) = line.trim_end().split_once(':')?;
        (name == field).then(|| value.to_string())
    })
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) | Value::VerbatimString { text: s, .. } => Some(s.clone()),
        _ => None,
    }
}

/// Refuses a server older than [`MIN_MAJOR_VERSION`], from its `INFO server`.
pub(crate) fn check_version(server: &str, info: &str) -> Result<()> {
    let version = info_field(info, "redis_version")
        .ok_or_else(|| Error::config(format!("{server} did not say its redis_version in INFO")))?;
    let major: u32 = version
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .ok_or_else(|| Error::config(format!("{server} reports redis_version {version:?}")))?;
    if major < MIN_MAJOR_VERSION {
        return Err(Error::config(format!(
            "{server} runs Redis {version}; the store needs Redis {MIN_MAJOR_VERSION}.0 or later"
        )));
    }
    Ok(())
}

/// Refuses a server that may evict records (`maxmemory` set with a
/// `maxmemory-policy` other than `noeviction`), from its `CONFIG GET`
/// answers, unless the caller allowed it.
pub(crate) fn check_eviction(
    server: &str,
    maxmemory: &str,
    policy: &str,
    allowed: bool,
) -> Result<()> {
    let limited = maxmemory.trim() != "0";
    if limited && policy != "noeviction" && !allowed {
        return Err(Error::config(format!(
            "{server} has maxmemory-policy {policy} with maxmemory {maxmemory}: it may evict \
             records (every record has a TTL, so volatile-* policies evict them too), and an \
             evicted record lets a second claim win. Set maxmemory-policy noeviction, or \
             opt in with allow_eviction (URL: ?allow_eviction=true)"
        )));
    }
    Ok(())
}

/// At connect: the version and eviction checks on every server. A server that
/// refuses `CONFIG` (managed services) is let through: it cannot say, and
/// the README says what to ask the provider.
pub(crate) async fn preflight(
    conn: &mut Conn,
    allow_eviction: bool,
    map: impl Fn(redis::RedisError) -> Error,
) -> Result<()> {
    let mut info = redis::cmd("INFO");
    info.arg("server");
    for (server, answer) in on_every_server(conn, &info).await.map_err(&map)? {
        let info = text(&answer)
            .ok_or_else(|| Error::config(format!("{server} answered INFO with {answer:?}")))?;
        check_version(&server, &info)?;
    }
    let mut config = redis::cmd("CONFIG");
    config.arg("GET").arg("maxmemory*");
    let Ok(answers) = on_every_server(conn, &config).await else {
        tracing::warn!(
            "CONFIG GET refused: the store cannot tell whether the server may evict records"
        );
        return Ok(());
    };
    for (server, answer) in answers {
        let pairs = config_pairs(&answer);
        let (Some(max), Some(policy)) = (pairs.get("maxmemory"), pairs.get("maxmemory-policy"))
        else {
            tracing::warn!(%server, "CONFIG GET maxmemory* unanswered: eviction unknown");
            continue;
        };
        check_eviction(&server, max, policy, allow_eviction)?;
    }
    Ok(())
}

/// The name/value pairs of a `CONFIG GET` answer (an array in RESP2, a map in
/// RESP3).
pub(crate) fn config_pairs(answer: &Value) -> std::collections::HashMap<String, String> {
    let mut out = std::collections::HashMap::new();
    match answer {
        Value::Array(items) => {
            for pair in items.chunks(2) {
                if let [k, v] = pair {
                    if let (Some(k), Some(v)) = (text(k), text(v)) {
                        out.insert(k, v);
                    }
                }
            }
        }
        Value::Map(pairs) => {
            for (k, v) in pairs {
                if let (Some(k), Some(v)) = (text(k), text(v)) {
                    out.insert(k, v);
                }
            }
        }
        _ => {}
    }
    out
}

/// `evicted_keys` of `INFO stats`, summed over every server.
pub(crate) async fn evicted_keys(conn: &mut Conn) -> Option<u64> {
    let mut info = redis::cmd("INFO");
    info.arg("stats");
    let answers = on_every_server(conn, &info).await.ok()?;
    let mut total = 0;
    for (_, answer) in answers {
        total += info_field(&text(&answer)?, "evicted_keys")?
            .parse::<u64>()
            .ok()?;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_older_than_seven_is_refused_by_name() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_mode:standalone\r\n");
        assert!(check_version("s", &info("7.0.15")).is_ok());
        assert!(check_version("s", &info("8.2.1")).is_ok());
        let old = check_version("s", &info("6.2.14"))
            .expect_err("6.2 refused")
            .to_string();
        assert!(old.contains("6.2.14") && old.contains("7.0"), "{old}");
        assert!(check_version("s", "# Server\r\n").is_err());
    }

    #[test]
    fn an_evicting_policy_is_refused_unless_allowed() {
        for policy in [
            "allkeys-lru",
            "volatile-lru",
            "allkeys-random",
            "volatile-ttl",
        ] {
            let e = check_eviction("s", "4194304", policy, false)
                .expect_err("an evicting policy refused")
                .to_string();
            assert!(e.contains(policy) && e.contains("noeviction"), "{e}");
            assert!(check_eviction("s", "4194304", policy, true).is_ok());
            // No memory limit: nothing is ever evicted.
            assert!(check_eviction("s", "0", policy, false).is_ok());
        }
        assert!(check_eviction("s", "4194304", "noeviction", false).is_ok());
    }
}

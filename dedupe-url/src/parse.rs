//! Parsing a store URL: no I/O, and every mistake named before anything is
//! created.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

/// What is wrong with a store URL. Credentials never appear in the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Not `scheme:...` at all.
    #[error("{url:?} is not a store URL: {reason}")]
    Malformed {
        /// The URL, password hidden.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// A scheme no store answers to.
    #[error(
        "unknown store scheme {scheme:?}: use memory:, sqlite://, postgres://, mysql://, \
         mariadb://, redis://, rediss://, redis+cluster://, rediss+cluster:// or dynamodb://"
    )]
    UnknownScheme {
        /// The scheme given.
        scheme: String,
    },
    /// A query option this scheme does not take.
    #[error("{scheme} URLs take no option {option:?} (they take: {known})")]
    UnknownOption {
        /// The URL's scheme.
        scheme: &'static str,
        /// The option given.
        option: String,
        /// The options it takes.
        known: String,
    },
    /// An option with a value it cannot have.
    #[error("option {option}={value:?}: {reason}")]
    BadValue {
        /// The option.
        option: String,
        /// Its value.
        value: String,
        /// Why it is refused.
        reason: String,
    },
    /// The scheme's store crate is not compiled in.
    #[error("{scheme} stores are not built into this program (enable the `{feature}` feature of dedupe-url)")]
    NotBuilt {
        /// The URL's scheme.
        scheme: &'static str,
        /// The cargo feature that adds it.
        feature: &'static str,
    },
}

/// Which store a URL names, and where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Target {
    /// `memory:` — records in this process.
    Memory,
    /// `sqlite:///abs/file.db`, `sqlite://relative.db`, or `sqlite:` for a new
    /// file in a temporary directory (`path` is `None`).
    Sqlite {
        /// The database file.
        path: Option<PathBuf>,
        /// `?table=` (default `dedupe_records`).
        table: Option<String>,
        /// `?connections=`: connections (each on a thread of its own) per handle.
        connections: Option<u32>,
    },
    /// `postgres://user:pass@host:port/db?schema=...&table=...`.
    Postgres {
        /// The connection URL handed to sqlx (without the options dedupe reads).
        url: String,
        /// `?schema=` (default: the store's, `public`).
        schema: Option<String>,
        /// `?table=` (default `dedupe_records`).
        table: Option<String>,
        /// `?connections=`: pool size per handle.
        connections: Option<u32>,
    },
    /// `mysql://user:pass@host:port/db?table=...` (or `mariadb://`).
    Mysql {
        /// The connection URL handed to sqlx (`mysql://`, without the options
        /// dedupe reads).
        url: String,
        /// `?table=` (default `dedupe_records`).
        table: Option<String>,
        /// `?connections=`: pool size per handle.
        connections: Option<u32>,
    },
    /// `redis://host:port/N`, `rediss://...`, or a Cluster:
    /// `redis+cluster://host:port,host:port`.
    Redis {
        /// One URL per node given (one for a standalone server).
        urls: Vec<String>,
        /// A Cluster.
        cluster: bool,
        /// `?prefix=` (default `dedupe:`).
        prefix: Option<String>,
        /// `?allow_eviction=true`: open on a server whose `maxmemory-policy`
        /// may evict records (refused otherwise).
        allow_eviction: bool,
        /// `?wait_replicas=N&wait_timeout=DURATION` (default 500ms): every
        /// write waits until N replicas have it (`WAIT`).
        wait_replicas: Option<(u32, Duration)>,
        /// `?namespace_hash_tags=true`: each namespace's keys under a hash
        /// tag (the inbox on a Cluster needs it).
        namespace_hash_tags: bool,
    },
    /// `dynamodb://TABLE?region=...&endpoint=http://127.0.0.1:8000`.
    Dynamo {
        /// The table (default `dedupe_records` when the URL names none).
        table: String,
        /// `?region=` (default: the AWS chain's).
        region: Option<String>,
        /// `?endpoint=`: an emulator or a compatible service.
        endpoint: Option<String>,
        /// `?max_clock_skew=` (default 1s): the skew from the service's clock
        /// claims go through with.
        max_clock_skew: Option<Duration>,
        /// `?min_lease=` (default 4 x (max_clock_skew + 1 s)).
        min_lease: Option<Duration>,
        /// `?allow_global_table=true`: claim on an eventually consistent
        /// global table (refused otherwise).
        allow_global_table: bool,
    },
}

/// A parsed store URL: which store, and the options every store shares.
///
/// ```
/// use std::time::Duration;
/// let url: dedupe_url::StoreUrl = "memory:?lease=30s&retention=7d".parse()?;
/// assert_eq!(url.scheme(), "memory");
/// assert_eq!(url.lease(), Some(Duration::from_secs(30)));
/// assert_eq!(url.retention(), Some(Duration::from_secs(7 * 86_400)));
/// # Ok::<(), dedupe_url::UrlError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreUrl {
    target: Target,
    lease: Option<Duration>,
    retention: Option<Duration>,
    timeout: Option<Duration>,
    shown: String,
}

/// Options every scheme takes.
const COMMON: &[&str] = &["lease", "retention", "timeout"];
/// Connection options sqlx reads from a Postgres URL, passed through.
const POSTGRES_PASS: &[&str] = &[
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "application_name",
    "options",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
];
/// Connection options sqlx reads from a MySQL URL, passed through.
const MYSQL_PASS: &[&str] = &[
    "ssl-mode",
    "ssl-ca",
    "charset",
    "collation",
    "statement-cache-capacity",
    "socket",
];

/// Connection options redis-rs reads from a Redis URL, passed through.
const REDIS_PASS: &[&str] = &["protocol"];

impl StoreUrl {
    /// Parses `url`, checking every part; no I/O.
    pub fn parse(url: &str) -> Result<Self, UrlError> {
        let shown = redact(url);
        let malformed = |reason: &str| UrlError::Malformed {
            url: shown.clone(),
            reason: reason.to_string(),
        };
        let (scheme, rest) = url
            .split_once(':')
            .ok_or_else(|| malformed("no scheme (memory:, sqlite://, postgres://, ...)"))?;
        let scheme_lower = scheme.to_ascii_lowercase();
        let (before_query, query) = match rest.split_once('?') {
            Some((b, q)) => (b, q),
            None => (rest, ""),
        };
        if before_query.contains('#') || query.contains('#') {
            return Err(malformed("fragments (#...) are not allowed"));
        }
        let mut options = Options::parse(query, &shown)?;
        let body = before_query.strip_prefix("//");
        let target = match scheme_lower.as_str() {
            "memory" => {
                if !matches!(before_query, "" | "//") {
                    return Err(malformed("memory: takes no host or path"));
                }
                options.only("memory", &[])?;
                Target::Memory
            }
            "sqlite" => {
                built("sqlite", cfg!(feature = "sqlite"))?;
                options.only("sqlite", &["table", "connections"])?;
                let path = match body.unwrap_or(before_query) {
                    "" => None,
                    path => Some(PathBuf::from(percent_decode(path, &shown)?)),
                };
                Target::Sqlite {
                    path,
                    table: options.take("table"),
                    connections: options.take_number("connections", 1, 1000)?,
                }
            }
            "postgres" | "postgresql" => {
                built("postgres", cfg!(feature = "postgres"))?;
                let body = body.ok_or_else(|| malformed("expected postgres://host/db"))?;
                options.only_or_pass(
                    "postgres",
                    &["schema", "table", "connections"],
                    POSTGRES_PASS,
                )?;
                let schema = options.take("schema");
                let table = options.take("table");
                let connections = options.take_number("connections", 1, 1000)?;
                Target::Postgres {
                    url: format!("{scheme_lower}://{body}{}", options.passed_query()),
                    schema,
                    table,
                    connections,
                }
            }
            "mysql" | "mariadb" => {
                built("mysql", cfg!(feature = "mysql"))?;
                let body = body.ok_or_else(|| malformed("expected mysql://host/db"))?;
                options.only_or_pass("mysql", &["table", "connections"], MYSQL_PASS)?;
                let table = options.take("table");
                let connections = options.take_number("connections", 1, 1000)?;
                Target::Mysql {
                    url: format!("mysql://{body}{}", options.passed_query()),
                    table,
                    connections,
                }
            }
            "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => {
                built("redis", cfg!(feature = "redis"))?;
                let body = body.ok_or_else(|| malformed("expected redis://host:port"))?;
                options.only_or_pass(
                    scheme_label(&scheme_lower),
                    &[
                        "prefix",
                        "allow_eviction",
                        "wait_replicas",
                        "wait_timeout",
                        "namespace_hash_tags",
                    ],
                    REDIS_PASS,
                )?;
                let cluster = scheme_lower.ends_with("+cluster");
                let base = scheme_lower.trim_end_matches("+cluster");
                let passed = options.passed_query();
                let urls: Vec<String> = if cluster {
                    let (hosts, path) = match body.split_once('/') {
                        Some((h, p)) => (h, p),
                        None => (body, ""),
                    };
                    if !path.is_empty() {
                        return Err(malformed("a Cluster has no database number"));
                    }
                    let userinfo_hosts: Vec<&str> = hosts.split(',').collect();
                    if userinfo_hosts.iter().any(|h| h.trim().is_empty()) {
                        return Err(malformed("a Cluster URL lists host:port,host:port"));
                    }
                    userinfo_hosts
                        .iter()
                        .map(|h| format!("{base}://{}{passed}", h.trim()))
                        .collect()
                } else {
                    if body.is_empty() || body.contains(',') {
                        return Err(malformed(
                            "expected redis://host:port/N (several nodes: redis+cluster://)",
                        ));
                    }
                    vec![format!("{base}://{body}{passed}")]
                };
                Target::Redis {
                    urls,
                    cluster,
                    prefix: options.take("prefix"),
                    allow_eviction: options.take_bool("allow_eviction")?.unwrap_or(false),
                    namespace_hash_tags: options.take_bool("namespace_hash_tags")?.unwrap_or(false),
                    wait_replicas: match (
                        options.take_number("wait_replicas", 1, 64)?,
                        options.duration("wait_timeout")?,
                    ) {
                        (Some(n), wait) => Some((n, wait.unwrap_or(Duration::from_millis(500)))),
                        (None, None) => None,
                        (None, Some(_)) => {
                            return Err(malformed("wait_timeout needs wait_replicas"))
                        }
                    },
                }
            }
            "dynamodb" => {
                built("dynamodb", cfg!(feature = "dynamodb"))?;
                let body = body.ok_or_else(|| malformed("expected dynamodb://TABLE"))?;
                options.only(
                    "dynamodb",
                    &[
                        "region",
                        "endpoint",
                        "max_clock_skew",
                        "min_lease",
                        "allow_global_table",
                    ],
                )?;
                let table = match body.trim_end_matches('/') {
                    "" => "dedupe_records".to_string(),
                    t if t.contains('/') => {
                        return Err(malformed(
                            "a DynamoDB URL names one table: dynamodb://TABLE",
                        ))
                    }
                    t => t.to_string(),
                };
                if !(3..=255).contains(&table.len())
                    || !table
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
                {
                    return Err(malformed(
                        "a DynamoDB table name is 3 to 255 characters of [A-Za-z0-9_.-]",
                    ));
                }
                let endpoint = options.take("endpoint");
                if let Some(e) = &endpoint {
                    if !(e.starts_with("http://") || e.starts_with("https://")) {
                        return Err(UrlError::BadValue {
                            option: "endpoint".into(),
                            value: e.clone(),
                            reason: "must start with http:// or https://".into(),
                        });
                    }
                }
                Target::Dynamo {
                    table,
                    region: options.take("region"),
                    endpoint,
                    max_clock_skew: options.duration("max_clock_skew")?,
                    min_lease: options.duration("min_lease")?,
                    allow_global_table: options.take_bool("allow_global_table")?.unwrap_or(false),
                }
            }
            _ => {
                return Err(UrlError::UnknownScheme {
                    scheme: scheme.to_string(),
                })
            }
        };
        Ok(Self {
            target,
            lease: options.duration("lease")?,
            retention: options.duration("retention")?,
            timeout: options.duration("timeout")?,
            shown,
        })
    }

    /// Which store, and where.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// `memory`, `sqlite`, `postgres`, `mysql`, `redis`, `redis cluster` or `dynamodb`.
    pub fn scheme(&self) -> &'static str {
        match &self.target {
            Target::Memory => "memory",
            Target::Sqlite { .. } => "sqlite",
            Target::Postgres { .. } => "postgres",
            Target::Mysql { .. } => "mysql",
            Target::Redis { cluster: false, .. } => "redis",
            Target::Redis { cluster: true, .. } => "redis cluster",
            Target::Dynamo { .. } => "dynamodb",
        }
    }

    /// `?lease=`: how long a claim holds the key (for a `Deduper`).
    pub fn lease(&self) -> Option<Duration> {
        self.lease
    }

    /// `?retention=`: how long a done record answers duplicates.
    pub fn retention(&self) -> Option<Duration> {
        self.retention
    }

    /// A [`Deduper`](dedupe_core::Deduper) over `store` with this URL's
    /// `?lease=` and `?retention=` (the deduper's defaults where the URL
    /// names none): the lifecycle every front door takes.
    ///
    /// ```
    /// use std::time::Duration;
    /// let url: dedupe_url::StoreUrl = "memory:?lease=30s&retention=7d".parse()?;
    /// let deduper = url.deduper(dedupe_core::MemoryStore::new())?;
    /// assert_eq!(deduper.lease_ttl(), Duration::from_secs(30));
    /// assert_eq!(deduper.retention().for_namespace("stripe"), Duration::from_secs(7 * 86_400));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn deduper<S: dedupe_core::DedupeStore>(
        &self,
        store: S,
    ) -> Result<dedupe_core::Deduper, dedupe_core::Error> {
        let mut deduper = dedupe_core::Deduper::new(store);
        if let Some(lease) = self.lease {
            deduper = deduper.with_lease_ttl(lease);
        }
        if let Some(keep) = self.retention {
            deduper = deduper.with_retention(dedupe_core::Retention::new(keep)?);
        }
        deduper.validate()?;
        Ok(deduper)
    }

    /// `?timeout=`: the bound on every store call.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The same store in a namespace of its own (a new SQLite table, Postgres
    /// schema, Redis prefix or DynamoDB table, named `name`), for a run that
    /// must not touch the records already there.
    pub fn in_namespace(&self, name: &str) -> Self {
        let mut url = self.clone();
        match &mut url.target {
            Target::Memory => {}
            Target::Sqlite { table, .. } => *table = Some(name.to_string()),
            Target::Postgres { schema, .. } => *schema = Some(name.to_string()),
            Target::Mysql { table, .. } => *table = Some(name.to_string()),
            Target::Redis { prefix, .. } => *prefix = Some(format!("{name}:")),
            Target::Dynamo { table, .. } => *table = name.to_string(),
        }
        url
    }

    /// The same URL for a run whose leases are milliseconds long (the
    /// conformance suite, a soak): a DynamoDB URL without `min_lease` gets
    /// the shortest lease there is, with the clock guard still on. Other
    /// stores have no minimum lease.
    pub fn with_short_leases(&self) -> Self {
        let mut url = self.clone();
        if let Target::Dynamo { min_lease, .. } = &mut url.target {
            min_lease.get_or_insert(dedupe_core::MIN_TTL);
        }
        url
    }
}

impl FromStr for StoreUrl {
    type Err = UrlError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The URL as given, with any password replaced by `***`.
impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

fn scheme_label(scheme: &str) -> &'static str {
    match scheme {
        "redis" => "redis",
        "rediss" => "rediss",
        "redis+cluster" => "redis+cluster",
        _ => "rediss+cluster",
    }
}

fn built(scheme: &'static str, yes: bool) -> Result<(), UrlError> {
    if yes {
        Ok(())
    } else {
        Err(UrlError::NotBuilt {
            scheme,
            feature: scheme,
        })
    }
}

/// `scheme://user:secret@host` → `scheme://user:***@host`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let hidden: Vec<String> = authority
        .split(',')
        .map(|part| match part.rsplit_once('@') {
            Some((userinfo, host)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***@{host}"),
                None => format!("{userinfo}@{host}"),
            },
            None => part.to_string(),
        })
        .collect();
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                    _ => pair.to_string(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_string(),
    };
    format!("{scheme}://{}{tail}", hidden.join(","))
}

fn percent_decode(text: &str, shown: &str) -> Result<String, UrlError> {
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|_| UrlError::Malformed {
            url: shown.to_string(),
            reason: "the path is not UTF-8 once percent-decoded".into(),
        })
}

/// The query, as given, with what has been taken out.
struct Options {
    values: BTreeMap<String, String>,
    passed: Vec<(String, String)>,
}

impl Options {
    fn parse(query: &str, shown: &str) -> Result<Self, UrlError> {
        let mut values = BTreeMap::new();
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            if k.is_empty() {
                return Err(UrlError::Malformed {
                    url: shown.to_string(),
                    reason: "an option without a name".into(),
                });
            }
            if values.insert(k.to_string(), v.to_string()).is_some() {
                return Err(UrlError::BadValue {
                    option: k.to_string(),
                    value: v.to_string(),
                    reason: "given twice".into(),
                });
            }
        }
        Ok(Self {
            values,
            passed: Vec::new(),
        })
    }

    /// Every option is common or one of `own`.
    fn only(&mut self, scheme: &'static str, own: &[&str]) -> Result<(), UrlError> {
        self.only_or_pass(scheme, own, &[])
    }

    /// Every option is common, one of `own`, or one of `pass` (set aside for
    /// the driver's URL).
    fn only_or_pass(
        &mut self,
        scheme: &'static str,
        own: &[&str],
        pass: &[&str],
    ) -> Result<(), UrlError> {
        let keys: Vec<String> = self.values.keys().cloned().collect();
        for k in keys {
            if COMMON.contains(&k.as_str()) || own.contains(&k.as_str()) {
                continue;
            }
            if pass.contains(&k.as_str()) {
                if let Some(v) = self.values.remove(&k) {
                    self.passed.push((k, v));
                }
                continue;
            }
            let known: Vec<&str> = COMMON.iter().chain(own).chain(pass).copied().collect();
            return Err(UrlError::UnknownOption {
                scheme,
                option: k,
                known: known.join(", "),
            });
        }
        Ok(())
    }

    fn passed_query(&self) -> String {
        if self.passed.is_empty() {
            return String::new();
        }
        let mut query = form_urlencoded::Serializer::new(String::new());
        for (k, v) in &self.passed {
            query.append_pair(k, v);
        }
        format!("?{}", query.finish())
    }

    fn take(&mut self, key: &str) -> Option<String> {
        self.values.remove(key)
    }

    fn take_bool(&mut self, key: &str) -> Result<Option<bool>, UrlError> {
        let Some(v) = self.values.remove(key) else {
            return Ok(None);
        };
        match v.as_str() {
            "true" => Ok(Some(true)),
            "false" => Ok(Some(false)),
            _ => Err(UrlError::BadValue {
                option: key.into(),
                value: v,
                reason: "must be true or false".into(),
            }),
        }
    }

    fn take_number(&mut self, key: &str, min: u32, max: u32) -> Result<Option<u32>, UrlError> {
        let Some(v) = self.values.remove(key) else {
            return Ok(None);
        };
        match v.parse::<u32>() {
            Ok(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(UrlError::BadValue {
                option: key.into(),
                value: v,
                reason: format!("must be a whole number from {min} to {max}"),
            }),
        }
    }

    fn duration(&mut self, key: &str) -> Result<Option<Duration>, UrlError> {
        let Some(v) = self.values.remove(key) else {
            return Ok(None);
        };
        parse_duration(&v)
            .map(Some)
            .ok_or_else(|| UrlError::BadValue {
                option: key.into(),
                value: v,
                reason: "must be a number with a unit: ms, s, m, h or d (e.g. 30s)".into(),
            })
    }
}

/// A duration as the URLs and the CLI write it: `250ms`, `30s`, `5m`,
/// `2h`, `7d`; above zero.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(dedupe_url::parse_duration("2h"), Some(Duration::from_secs(7200)));
/// assert_eq!(dedupe_url::parse_duration("2 hours"), None);
/// ```
pub fn parse_duration(text: &str) -> Option<Duration> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().ok()?;
    let millis = match unit {
        "ms" => n,
        "s" => n.checked_mul(1_000)?,
        "m" => n.checked_mul(60_000)?,
        "h" => n.checked_mul(3_600_000)?,
        "d" => n.checked_mul(86_400_000)?,
        _ => return None,
    };
    (millis > 0).then(|| Duration::from_millis(millis))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(url: &str) -> StoreUrl {
        StoreUrl::parse(url).expect(url)
    }

    fn err(url: &str) -> String {
        StoreUrl::parse(url).expect_err(url).to_string()
    }

    #[test]
    fn every_scheme_parses() {
        assert_eq!(parsed("memory:").target(), &Target::Memory);
        assert_eq!(
            parsed("sqlite:///var/lib/x.db").target(),
            &Target::Sqlite {
                path: Some("/var/lib/x.db".into()),
                table: None,
                connections: None
            }
        );
        assert_eq!(
            parsed("sqlite://rel.db?table=t1").target(),
            &Target::Sqlite {
                path: Some("rel.db".into()),
                table: Some("t1".into()),
                connections: None
            }
        );
        assert_eq!(
            parsed("sqlite:").target(),
            &Target::Sqlite {
                path: None,
                table: None,
                connections: None
            }
        );
        assert_eq!(
            parsed("postgres://u:pw@h:5432/db?schema=s&table=t&sslmode=disable&timeout=2s")
                .target(),
            &Target::Postgres {
                url: "postgres://u:pw@h:5432/db?sslmode=disable".into(),
                schema: Some("s".into()),
                table: Some("t".into()),
                connections: None,
            }
        );
        for scheme in ["mysql", "mariadb"] {
            assert_eq!(
                parsed(&format!(
                    "{scheme}://u:pw@h:3306/db?table=t&ssl-mode=disabled&connections=3"
                ))
                .target(),
                &Target::Mysql {
                    url: "mysql://u:pw@h:3306/db?ssl-mode=disabled".into(),
                    table: Some("t".into()),
                    connections: Some(3),
                }
            );
        }
        assert_eq!(
            parsed("redis+cluster://a:1,b:2?prefix=p").target(),
            &Target::Redis {
                urls: vec!["redis://a:1".into(), "redis://b:2".into()],
                cluster: true,
                prefix: Some("p".into()),
                allow_eviction: false,
                wait_replicas: None,
                namespace_hash_tags: false,
            }
        );
        assert_eq!(
            parsed("redis://a:1/0?allow_eviction=true").target(),
            &Target::Redis {
                urls: vec!["redis://a:1/0".into()],
                cluster: false,
                prefix: None,
                allow_eviction: true,
                wait_replicas: None,
                namespace_hash_tags: false,
            }
        );
        assert!(err("redis://a:1/0?allow_eviction=yes").contains("true or false"));
        assert_eq!(
            parsed("redis://a:1/0?wait_replicas=2&wait_timeout=250ms").target(),
            &Target::Redis {
                urls: vec!["redis://a:1/0".into()],
                cluster: false,
                prefix: None,
                allow_eviction: false,
                wait_replicas: Some((2, Duration::from_millis(250))),
                namespace_hash_tags: false,
            }
        );
        assert!(matches!(
            parsed("redis+cluster://a:1,b:2?namespace_hash_tags=true").target(),
            Target::Redis {
                namespace_hash_tags: true,
                cluster: true,
                ..
            }
        ));
        assert!(err("redis://a:1/0?namespace_hash_tags=1").contains("true or false"));
        assert!(matches!(
            parsed("redis://a:1/0?wait_replicas=1").target(),
            Target::Redis { wait_replicas: Some((1, w)), .. } if *w == Duration::from_millis(500)
        ));
        assert!(err("redis://a:1/0?wait_replicas=0").contains("from 1 to 64"));
        assert!(err("redis://a:1/0?wait_timeout=1s").contains("needs wait_replicas"));
        assert_eq!(
            parsed("dynamodb://events.v1?region=eu-west-1&endpoint=http://127.0.0.1:8000").target(),
            &Target::Dynamo {
                table: "events.v1".into(),
                region: Some("eu-west-1".into()),
                endpoint: Some("http://127.0.0.1:8000".into()),
                max_clock_skew: None,
                min_lease: None,
                allow_global_table: false,
            }
        );
        assert_eq!(
            parsed("dynamodb://t12?max_clock_skew=500ms&min_lease=5s&allow_global_table=true")
                .target(),
            &Target::Dynamo {
                table: "t12".into(),
                region: None,
                endpoint: None,
                max_clock_skew: Some(Duration::from_millis(500)),
                min_lease: Some(Duration::from_secs(5)),
                allow_global_table: true,
            }
        );
    }

    #[test]
    fn mistakes_are_named() {
        assert!(err("oracle://x").contains("unknown store scheme \"oracle\""));
        assert!(err("no scheme here").contains("no scheme"));
        assert!(err("memory:?lease=5").contains("option lease=\"5\""));
        assert!(err("memory:?lease=0s").contains("option lease"));
        assert!(err("sqlite:?tabel=x").contains("no option \"tabel\""));
        assert!(err("postgres://h/db?schema=a&schema=b").contains("given twice"));
        assert!(err("redis://a:1,b:2").contains("redis+cluster://"));
        assert!(err("dynamodb://ab").contains("3 to 255"));
        assert!(err("dynamodb://t123?endpoint=localhost:8000").contains("http://"));
        assert!(err("postgres://h/db#x").contains("fragments"));
    }

    #[test]
    fn passwords_never_show() {
        let e = err("postgres://user:hunter2@h/db?bogus=1");
        assert!(!e.contains("hunter2"), "{e}");
        let e = err("postgres://user:hunter2@h/db?password=hunter2&nope=1");
        assert!(!e.contains("hunter2"), "{e}");
        let url = parsed("redis://:hunter2@h:6379/0");
        assert!(!url.to_string().contains("hunter2"), "{url}");
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("2h"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_duration("2"), None);
        assert_eq!(parse_duration("s"), None);
        assert_eq!(parse_duration("99999999999999999999d"), None);
    }
}

//! From the flags to the routes: each route's provider, key rule, secrets
//! and receiver, all on one deduper.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dedupe_core::{DedupeStore, Deduper, Error, Inbox};
use dedupe_url::Opener;
use dedupe_webhook::{KeyRule, Scheme, Webhook};

use super::args::ServeArgs;
use super::secrets;

/// A provider a route can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Provider {
    Standard,
    Stripe,
    GitHub,
    Shopify,
}

impl Provider {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "standard" | "svix" => Provider::Standard,
            "stripe" => Provider::Stripe,
            "github" => Provider::GitHub,
            "shopify" => Provider::Shopify,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        self.scheme().name()
    }

    fn scheme(self) -> Scheme {
        match self {
            Provider::Standard => Scheme::StandardWebhooks,
            Provider::Stripe => Scheme::Stripe,
            Provider::GitHub => Scheme::GitHub,
            Provider::Shopify => Scheme::Shopify,
        }
    }

    fn rule(self, namespace: &str) -> KeyRule {
        match self {
            Provider::Standard => KeyRule::generic(namespace),
            Provider::Stripe => KeyRule::stripe(namespace),
            Provider::GitHub => KeyRule::github(namespace),
            Provider::Shopify => KeyRule::shopify(namespace),
        }
    }
}

/// The receivers of every route, whether every route is open (no secret at
/// all: a local demo), and the deduper they and the inbox workers share.
pub(super) struct Receivers {
    /// Route name (`hooks`, `standard`, a provider, a --route name) to its
    /// receiver; `None` when secrets are configured but none for it.
    pub(super) routes: HashMap<String, Option<Webhook>>,
    pub(super) open: bool,
    pub(super) deduper: Deduper,
}

/// The routes the flags ask for, each with its receiver (in inbox mode on
/// `inbox`).
pub(super) fn receivers(
    args: &ServeArgs,
    opener: &Opener,
    store: &Arc<dyn DedupeStore>,
    inbox: Option<&Arc<dyn Inbox>>,
) -> Result<Receivers, Error> {
    // Routes: the built-in ones, then the named ones.
    let mut routes: Vec<(String, Provider)> = vec![
        ("hooks".into(), Provider::Standard),
        ("stripe".into(), Provider::Stripe),
        ("github".into(), Provider::GitHub),
        ("shopify".into(), Provider::Shopify),
    ];
    for spec in &args.routes {
        let (name, provider) = spec
            .split_once('=')
            .ok_or_else(|| Error::config(format!("--route {spec}: expected NAME=PROVIDER")))?;
        let provider = Provider::parse(provider).ok_or_else(|| {
            Error::config(format!(
                "--route {spec}: providers are stripe, github, shopify, standard"
            ))
        })?;
        dedupe_core::Key::new(name, "x")
            .map_err(|e| Error::config(format!("--route {spec}: {e}")))?;
        if routes.iter().any(|(n, _)| n == name) || name == "standard" {
            return Err(Error::config(format!(
                "--route {spec}: /hooks/{name} is already a route"
            )));
        }
        routes.push((name.to_string(), provider));
    }
    let route_names: Vec<&str> = routes.iter().map(|(n, _)| n.as_str()).collect();
    let secrets = secrets::collect(&args.secrets, &args.secret_file, &route_names)?;
    if let Some(bad) = args
        .unsigned
        .iter()
        .find(|r| !route_names.contains(&r.as_str()))
    {
        return Err(Error::config(format!(
            "--unsigned {bad}: routes are {}",
            route_names.join(", ")
        )));
    }
    // With no secret at all every route is open (a local demo); once secrets
    // are given, a route without one is not served unless --unsigned says so.
    let open = secrets.is_empty();
    if open {
        eprintln!("warning: no secret given: signatures are not checked on any route");
    }
    // One lifecycle for every route and worker: the URL's lease and
    // retention, then the flags.
    let mut deduper = opener.url().deduper(Arc::clone(store))?;
    match args.lease_ms {
        Some(0) => return Err(Error::config("--lease-ms 0: a lease is at least 1 ms")),
        Some(ms) => deduper = deduper.with_lease_ttl(Duration::from_millis(ms)),
        None => {}
    }
    if let Some(secs) = args.max_handler_secs {
        deduper = deduper.with_max_work_time(secs_arg("--max-handler-secs", secs)?);
    }
    let limit = args
        .max_concurrency
        .map(dedupe_webhook::ConcurrencyLimit::new);
    let mut receivers = HashMap::new();
    for (name, provider) in &routes {
        let mut hook = if let Some(inbox) = inbox {
            // Each item carries the limit, so that servers started with other
            // settings agree on when it is dead.
            let hook = Webhook::inbox(Arc::clone(inbox), provider.rule(name))
                .with_item_attempts(args.max_attempts);
            match &args.order_by {
                Some(pointer) => hook.order_by(
                    pointer,
                    if args.skip_dead {
                        dedupe_core::WhenDead::Skip
                    } else {
                        dedupe_core::WhenDead::Block
                    },
                ),
                None => hook,
            }
        } else {
            Webhook::new(deduper.clone(), provider.rule(name))
        };
        if let Some(limit) = args.body_limit {
            hook = hook.body_limit(limit);
        }
        if let Some(limit) = &limit {
            hook = hook.concurrency_limit(limit.clone());
        }
        // A named route's own secrets, else its provider's.
        let own = secrets.get(name.as_str()).or_else(|| match name.as_str() {
            "hooks" => secrets.get("standard"),
            _ => secrets.get(provider.name()),
        });
        let hook = match own {
            Some(list) => {
                let verifier = dedupe_webhook::Verifier::new(provider.scheme(), list)
                    .map_err(|e| Error::config(format!("secret for {name}: {e}")))?
                    .with_tolerance(Duration::from_secs(args.tolerance_secs));
                Some(hook.verifier(verifier))
            }
            None if open || args.unsigned.contains(name) => Some(hook),
            None => None,
        };
        receivers.insert(name.clone(), hook);
    }
    // /hooks/standard is /hooks under another name: one namespace, so a signed
    // message replayed on the other route is the same key.
    let generic = receivers.get("hooks").cloned().flatten();
    receivers.insert("standard".into(), generic);
    Ok(Receivers {
        routes: receivers,
        open,
        deduper,
    })
}

pub(super) fn secs_arg(flag: &str, secs: f64) -> Result<Duration, Error> {
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| Error::config(format!("{flag} {secs}: a positive number of seconds")))
}

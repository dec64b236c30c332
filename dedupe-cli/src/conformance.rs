//! `dedupe conformance`: the suite against a store given by URL (a live
//! deployment too), each check in a namespace of its own, removed afterwards.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use dedupe_conformance::{CheckReport, Fixture, Report, Scale, StoreFactory};
use dedupe_core::{DedupeStore, Error, Inbox};
use dedupe_url::{Opener, StoreUrl};

#[derive(clap::Args, Debug)]
pub struct ConformanceArgs {
    /// The store, as a URL (see `dedupe help`); each check runs in a new
    /// namespace of it (table, schema, prefix), removed afterwards.
    #[arg(long, value_name = "URL", default_value = "sqlite:")]
    pub store: String,
    /// How much work the heaviest checks do: `reduced` for emulators that
    /// serve a few hundred requests a second.
    #[arg(long, value_enum, default_value_t = ScaleArg::Full)]
    pub scale: ScaleArg,
    /// Run only this check (repeatable; default: every check).
    #[arg(long = "only", value_name = "CHECK")]
    pub only: Vec<String>,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ScaleArg {
    Full,
    Reduced,
}

impl From<ScaleArg> for Scale {
    fn from(scale: ScaleArg) -> Self {
        match scale {
            ScaleArg::Full => Scale::Full,
            ScaleArg::Reduced => Scale::Reduced,
        }
    }
}

/// One new namespace per check; remembers them to remove after the run.
struct CliFactory {
    url: StoreUrl,
    scale: Scale,
    created: Mutex<Vec<Arc<Opener>>>,
}

struct CliFixture {
    opener: Arc<Opener>,
    main: Arc<dyn DedupeStore>,
    inbox: Option<Arc<dyn Inbox>>,
}

#[async_trait]
impl StoreFactory for CliFactory {
    async fn create(&self) -> Result<Box<dyn Fixture>, Error> {
        let url = self.url.in_namespace(&crate::fresh_namespace());
        let opener = Arc::new(Opener::new(url).await?);
        if let Ok(mut created) = self.created.lock() {
            created.push(Arc::clone(&opener));
        }
        let main = opener.handle().await?;
        let inbox = opener.inbox_handle().await?;
        Ok(Box::new(CliFixture {
            opener,
            main,
            inbox,
        }))
    }

    fn scale(&self) -> Scale {
        self.scale
    }
}

#[async_trait]
impl Fixture for CliFixture {
    fn store(&self) -> Arc<dyn DedupeStore> {
        Arc::clone(&self.main)
    }

    async fn open_handle(&self) -> Result<Arc<dyn DedupeStore>, Error> {
        self.opener.handle().await
    }

    fn inbox(&self) -> Option<Arc<dyn Inbox>> {
        self.inbox.clone()
    }

    async fn open_inbox(&self) -> Result<Option<Arc<dyn Inbox>>, Error> {
        self.opener.inbox_handle().await
    }
}

pub async fn conformance(args: ConformanceArgs) -> Result<bool, Error> {
    let ConformanceArgs { store, scale, only } = args;
    let checks = dedupe_conformance::checks::CHECKS;
    if let Some(unknown) = only
        .iter()
        .find(|name| !checks.iter().any(|c| c.name == name.as_str()))
    {
        let names: Vec<&str> = checks.iter().map(|c| c.name).collect();
        return Err(Error::config(format!(
            "no check is named {unknown:?}; the checks are: {}",
            names.join(", ")
        )));
    }
    let factory = CliFactory {
        // The checks' leases are milliseconds long.
        url: crate::store_url(&store)?.with_short_leases(),
        scale: scale.into(),
        created: Mutex::new(Vec::new()),
    };
    {
        let probe = Opener::new(factory.url.in_namespace(&crate::fresh_namespace())).await?;
        println!("conformance of {} ({})", factory.url, factory.url.scheme());
        if let Some(durability) = probe.durability().await {
            println!("durability: {durability}");
        }
        probe.remove_namespace().await?;
    }
    let mut report = Report {
        checks: Vec::new(),
        scale: factory.scale,
    };
    for check in checks {
        if !only.is_empty() && !only.iter().any(|name| name == check.name) {
            continue;
        }
        let started = Instant::now();
        let result = (check.run)(&factory).await;
        report.checks.push(CheckReport {
            name: check.name,
            result,
            elapsed: started.elapsed(),
        });
    }
    println!("{report}");
    let created = factory
        .created
        .lock()
        .map(|c| c.clone())
        .unwrap_or_default();
    for opener in created {
        opener.remove_namespace().await?;
    }
    Ok(report.all_passed())
}

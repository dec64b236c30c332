//! The benchmark's figures: an aligned table, JSON, CSV.

use std::time::Duration;

use dedupe_core::Error;
use serde::Serialize;

use super::args::{BenchArgs, Workload};
use super::load::Purge;
use super::run::Measured;

/// One store, one workload, one concurrency, measured through the store and
/// through its raw driver. A store the benchmark has no raw driver for is
/// measured alone: its `raw_*` fields and `store_over_raw` are `null`.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub store: String,
    pub kind: &'static str,
    pub workload: Workload,
    pub concurrency: usize,
    /// Records stored before measuring (`--prefill`).
    pub stored_keys: u64,
    pub ops_per_sec: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub errors: u64,
    pub raw_ops_per_sec: Option<f64>,
    pub raw_p50_us: Option<u64>,
    pub raw_p99_us: Option<u64>,
    pub raw_errors: Option<u64>,
    /// ops/s through the store over ops/s through the raw driver.
    pub store_over_raw: Option<f64>,
}

pub(super) fn rate(m: &Measured, elapsed: Duration) -> f64 {
    m.ops as f64 / elapsed.as_secs_f64().max(1e-9)
}

fn pct(m: &Measured, q: f64) -> u64 {
    m.latency.as_ref().map_or(0, |h| h.value_at_quantile(q))
}

impl Row {
    pub(super) fn new(
        store: &str,
        kind: &'static str,
        workload: Workload,
        concurrency: usize,
        (s, s_elapsed): &(Measured, Duration),
        raw: Option<&(Measured, Duration)>,
    ) -> Self {
        let ops = rate(s, *s_elapsed);
        let raw_rate = raw.map(|(r, r_elapsed)| rate(r, *r_elapsed));
        Self {
            store: store.to_string(),
            kind,
            workload,
            concurrency,
            stored_keys: 0,
            ops_per_sec: ops,
            p50_us: pct(s, 0.5),
            p99_us: pct(s, 0.99),
            p999_us: pct(s, 0.999),
            errors: s.errors,
            raw_ops_per_sec: raw_rate,
            raw_p50_us: raw.map(|(r, _)| pct(r, 0.5)),
            raw_p99_us: raw.map(|(r, _)| pct(r, 0.99)),
            raw_errors: raw.map(|(r, _)| r.errors),
            store_over_raw: raw_rate.filter(|&r| r > 0.0).map(|r| ops / r),
        }
    }
}

const HEADER: [&str; 11] = [
    "store",
    "workload",
    "conc",
    "ops/s",
    "p50 µs",
    "p99 µs",
    "p99.9 µs",
    "raw ops/s",
    "raw p99 µs",
    "store/raw",
    "errors",
];

/// A figure, or `-` where there is none (no raw driver).
fn shown(figure: Option<String>) -> String {
    figure.unwrap_or_else(|| "-".into())
}

fn cells(row: &Row) -> [String; 11] {
    [
        row.kind.to_string(),
        match row.workload {
            Workload::Batch => "batch".into(),
            w => w.name().into(),
        },
        row.concurrency.to_string(),
        format!("{:.0}", row.ops_per_sec),
        row.p50_us.to_string(),
        row.p99_us.to_string(),
        row.p999_us.to_string(),
        shown(row.raw_ops_per_sec.map(|r| format!("{r:.0}"))),
        shown(row.raw_p99_us.map(|p| p.to_string())),
        shown(row.store_over_raw.map(|r| format!("{r:.2}"))),
        (row.errors + row.raw_errors.unwrap_or(0)).to_string(),
    ]
}

/// The table: one line per row, columns aligned.
pub fn table(rows: &[Row]) -> String {
    let lines: Vec<[String; 11]> = std::iter::once(HEADER.map(String::from))
        .chain(rows.iter().map(cells))
        .collect();
    let widths: Vec<usize> = (0..HEADER.len())
        .map(|c| {
            lines
                .iter()
                .map(|l| l[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for line in &lines {
        let mut text = String::new();
        for (c, cell) in line.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c < 2 {
                text.push_str(cell);
                text.push_str(&" ".repeat(pad + 2));
            } else {
                text.push_str(&" ".repeat(pad));
                text.push_str(cell);
                text.push_str("  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    }
    out
}

/// A CSV cell: empty where there is no figure.
fn cell(figure: Option<String>) -> String {
    figure.unwrap_or_default()
}

fn csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "store,kind,workload,concurrency,stored_keys,ops_per_sec,p50_us,p99_us,p999_us,errors,\
         raw_ops_per_sec,raw_p50_us,raw_p99_us,raw_errors,store_over_raw\n",
    );
    for r in rows {
        out.push_str(&format!(
            "\"{}\",{},{},{},{},{:.1},{},{},{},{},{},{},{},{},{}\n",
            r.store.replace('"', "\"\""),
            r.kind,
            r.workload.name(),
            r.concurrency,
            r.stored_keys,
            r.ops_per_sec,
            r.p50_us,
            r.p99_us,
            r.p999_us,
            r.errors,
            cell(r.raw_ops_per_sec.map(|v| format!("{v:.1}"))),
            cell(r.raw_p50_us.map(|v| v.to_string())),
            cell(r.raw_p99_us.map(|v| v.to_string())),
            cell(r.raw_errors.map(|v| v.to_string())),
            cell(r.store_over_raw.map(|v| format!("{v:.3}")))
        ));
    }
    out
}

fn purge_line(p: &Purge) -> String {
    if p.native_expiry {
        return format!(
            "purge  {}: expires records itself, nothing to purge",
            p.kind
        );
    }
    format!(
        "purge  {}: expire() removed {} of {} expired records in {:.0} ms ({:.0}/s); \
         claims beside it: {:.0} ops/s at concurrency {}, p99 {} µs, {} errors",
        p.kind,
        p.removed,
        p.expired,
        p.purge_ms,
        p.removed as f64 / (p.purge_ms / 1e3).max(1e-9),
        p.claims_per_sec,
        p.concurrency,
        p.claims_p99_us,
        p.errors
    )
}

pub(super) fn print(rows: &[Row], purges: &[Purge], args: &BenchArgs) -> Result<(), Error> {
    let everything = serde_json::json!({ "rows": rows, "purges": purges });
    let json = serde_json::to_string_pretty(&everything)
        .map_err(|e| Error::fatal("results as JSON", Some(Box::new(e) as _)))?;
    if args.json {
        println!("{json}");
    } else {
        print!("{}", table(rows));
        for p in purges {
            println!("{}", purge_line(p));
        }
    }
    if let Some(dir) = &args.out {
        let write = |name: &str, text: &str| {
            std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(dir.join(name), text))
                .map_err(|e| Error::fatal(format!("writing {name}"), Some(Box::new(e) as _)))
        };
        write("results.json", &json)?;
        write("results.csv", &csv(rows))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(ops: u64) -> (Measured, Duration) {
        (
            Measured {
                ops,
                errors: 1,
                ..Measured::default()
            },
            Duration::from_secs(1),
        )
    }

    /// A row with a raw driver shows its figures and the ratio; one without
    /// shows `-` in the table, nothing in CSV and `null` in JSON, never a
    /// ratio of 0 or a raw rate it did not measure.
    #[test]
    fn a_row_without_a_raw_driver_shows_no_raw_figures() {
        let both = Row::new(
            "a",
            "memory",
            Workload::Mixed,
            1,
            &measured(900),
            Some(&measured(1000)),
        );
        assert_eq!(both.store_over_raw, Some(0.9));
        assert_eq!(both.raw_ops_per_sec, Some(1000.0));
        let alone = Row::new("b", "memory", Workload::Mixed, 1, &measured(900), None);
        assert_eq!(alone.store_over_raw, None);
        let json = serde_json::to_value(&alone).expect("json");
        for field in [
            "raw_ops_per_sec",
            "raw_p50_us",
            "raw_p99_us",
            "raw_errors",
            "store_over_raw",
        ] {
            assert_eq!(json[field], serde_json::Value::Null, "{field}");
        }
        let table = table(&[both, alone.clone()]);
        let last = table.lines().last().expect("a line");
        assert_eq!(
            last.split_whitespace().collect::<Vec<_>>(),
            ["memory", "mixed", "1", "900", "0", "0", "0", "-", "-", "-", "1"]
        );
        let csv = csv(&[alone]);
        assert!(
            csv.lines().nth(1).expect("a row").ends_with(",1,,,,,"),
            "{csv}"
        );
    }
}

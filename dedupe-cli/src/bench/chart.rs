//! SVG charts of a run (plotters): throughput against concurrency, and p99
//! latency against concurrency, one line per store and workload, the raw
//! driver dashed beside it.

use std::collections::BTreeMap;
use std::path::Path;

use dedupe_core::Error;
use plotters::prelude::*;

use super::report::Row;

/// Per store and workload: concurrency, the store's figure and the raw
/// driver's (none for a store measured alone).
type Series = BTreeMap<(String, &'static str), Vec<(usize, f64, Option<f64>)>>;

fn series(rows: &[Row], figure: impl Fn(&Row) -> (f64, Option<f64>)) -> Series {
    let mut lines: Series = BTreeMap::new();
    for row in rows {
        let (store, raw) = figure(row);
        lines
            .entry((row.kind.to_string(), row.workload.name()))
            .or_default()
            .push((row.concurrency, store, raw));
    }
    for points in lines.values_mut() {
        points.sort_by_key(|p| p.0);
    }
    lines
}

fn draw_one(path: &Path, title: &str, y_desc: &str, lines: &Series) -> Result<(), String> {
    let max_c = lines
        .values()
        .flatten()
        .map(|p| p.0)
        .max()
        .unwrap_or(1)
        .max(2);
    let max_y = lines
        .values()
        .flatten()
        .map(|p| p.1.max(p.2.unwrap_or(0.0)))
        .fold(1.0, f64::max);
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(80)
        .build_cartesian_2d((1usize..max_c).log_scale(), 0f64..max_y * 1.1)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("concurrency (tasks, each with its own connection)")
        .y_desc(y_desc)
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, ((kind, workload), points)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.0, p.1)),
                color.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?
            .label(format!("{kind} {workload}"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        // The raw driver: the same color, thin, with points.
        let raw: Vec<(usize, f64)> = points
            .iter()
            .filter_map(|p| p.2.map(|r| (p.0, r)))
            .collect();
        chart
            .draw_series(LineSeries::new(
                raw.iter().copied(),
                color.mix(0.5).stroke_width(1),
            ))
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(
                raw.iter()
                    .map(|&p| Circle::new(p, 3, color.mix(0.5).filled())),
            )
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// Writes `throughput.svg` and `latency.svg` into `dir`.
pub fn draw(rows: &[Row], dir: &Path) -> Result<(), Error> {
    let fail = |what: &str, e: String| Error::fatal(format!("drawing {what}: {e}"), None);
    draw_one(
        &dir.join("throughput.svg"),
        "ops/s: store (thick) and its raw driver (thin, dotted)",
        "ops/s",
        &series(rows, |r| (r.ops_per_sec, r.raw_ops_per_sec)),
    )
    .map_err(|e| fail("throughput.svg", e))?;
    draw_one(
        &dir.join("latency.svg"),
        "p99 latency: store (thick) and its raw driver (thin, dotted)",
        "p99 latency (µs)",
        &series(rows, |r| (r.p99_us as f64, r.raw_p99_us.map(|p| p as f64))),
    )
    .map_err(|e| fail("latency.svg", e))
}

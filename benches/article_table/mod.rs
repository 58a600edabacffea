//! An article's table reproduced: rows of our measurements beside the article's figures, both
//! also as ratios to the table's first row (the ratios are what compare across machines),
//! printed and written as CSV, JSON and an SVG bar chart of the ratios under
//! `target/article-tables/` (or `$CARGO_TARGET_DIR/article-tables/`).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use burnscale::train::accelerator::{Accelerator, gpu_count};
use burnscale::train::plan::off;
use burnscale::train::{RunSummary, TrainArgs};
use serde_json::{Value, json};

/// Where a table's runs go (`--accelerator`; by default a GPU in a `cuda` build on a machine
/// with one, else the CPU). On the CPU a run is planned (`--plan`) and its peak is the
/// counting allocator's; on a cubecl device its peak is the pools' reserved bytes and its plan
/// the device plan's dry run (not for `16-mixed`, whose steps a dry run does not compute;
/// README, The device plan); LibTorch's runs are not planned.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Machine(pub Accelerator);

// The one-device tables (hf_bert_large, fabric_vit) run where they are told; sharded_ddp's
// rows need 2 and 4 GPUs and deepspeed_mingpt's search plans its candidates, so those two run
// on the CPU and leave this unused.
#[allow(dead_code)]
impl Machine {
    pub fn of(chosen: Option<Accelerator>) -> Self {
        Self(Accelerator::or_default(chosen))
    }

    /// Whether the runs take the article's own sizes: on a GPU. (cubecl's CPU runtime, far
    /// slower than Flex, takes the CPU's.)
    pub fn at_article_size(self) -> bool {
        self.0 == Accelerator::Cuda
    }

    /// The flags a driver hands its workers.
    pub fn worker_flags(self) -> Vec<String> {
        vec!["--accelerator".into(), self.0.name()]
    }

    /// The runner's arguments for a run of `flags` here, planned wherever its plan can be read.
    pub fn train_args(self, flags: &[&str]) -> Result<TrainArgs> {
        let here = self.worker_flags();
        let here: Vec<&str> = here.iter().map(String::as_str).collect();
        let mut args = TrainArgs::from_flags(&[flags, &here].concat())?;
        args.plan = args.unplannable().is_none();
        Ok(args)
    }

    /// Steps a run takes (`quick`: a smoke run's): a few on a CPU, more at the article's size
    /// for steady-state times.
    pub fn steps(self, quick: bool) -> usize {
        match (quick, self.at_article_size()) {
            (true, _) => 2,
            (false, false) => 3,
            (false, true) => 5,
        }
    }

    /// Why a run of `ranks` ranks cannot run on this machine's GPUs (one a rank), if it has
    /// some but too few. Without any, the run goes ahead and its error says why.
    pub fn cannot_run(self, ranks: usize) -> Option<String> {
        let gpus = gpu_count();
        (self.0 == Accelerator::Cuda && gpus > 0 && ranks > gpus)
            .then(|| format!("needs {ranks} GPUs, this machine has {gpus}"))
    }

    /// What the peak and planned columns are.
    pub fn peak_note(self) -> String {
        let planned = match self.0 {
            Accelerator::Cpu => {
                return "peak: the counting allocator's process peak; planned: the planner's, before the first step".into();
            }
            Accelerator::Libtorch => "none (LibTorch allocates in C++)",
            _ => "the device plan's, a dry run of the steps before the first (none for 16-mixed)",
        };
        format!(
            "peak: the device pool's reserved bytes ({}; PyTorch's memory reserved); planned: {planned}",
            self.0.name()
        )
    }
}

/// A table: `columns` name the cells of each row (the first is the row's label); `plotted`
/// names the ratio columns drawn as bars, one group of bars per row.
pub struct Table {
    /// File stem under `target/article-tables/`.
    pub name: &'static str,
    pub title: String,
    /// Where the article's figures come from, and how our sizes scale down from its.
    pub notes: Vec<String>,
    pub columns: Vec<&'static str>,
    pub rows: Vec<Vec<Value>>,
    pub plotted: Vec<&'static str>,
}

/// A worker's last line: the run's summary as JSON, with `rank_peak` and `rank_planned`, the
/// largest over the ranks (each MPI process's own; thread ranks share their process's), from
/// the first process only. The peak is the device's: off the CPU its pool's reserved bytes.
/// Fails where a peak that can be read was not (a bench without the counting allocator): a
/// table's measured cell is empty only where the article's row was not run.
pub fn print_summary(summary: &RunSummary) -> Result<()> {
    if burnscale::collective::launcher_rank() != 0 {
        return Ok(());
    }
    let mut out = serde_json::to_value(summary)?;
    let (peaks, plans): (Vec<_>, Vec<_>) = summary
        .ranks
        .iter()
        .map(|r| match summary.accelerator {
            Accelerator::Cpu => (r.peak_mem_bytes, r.planned_peak_mem_bytes),
            _ => (r.device_peak_mem_bytes, r.planned_device_peak_mem_bytes),
        })
        .unzip();
    let peak = peaks.into_iter().flatten().max();
    if peak.is_none() && summary.accelerator != Accelerator::Libtorch {
        anyhow::bail!(
            "the run on {} measured no peak memory (is the bench's global allocator burnscale's CountingAllocator?)",
            summary.accelerator.name()
        );
    }
    out["rank_peak"] = json!(peak);
    out["rank_planned"] = json!(plans.into_iter().flatten().max());
    println!("{out}");
    Ok(())
}

/// `values` as ratios to the first one (None where a value, or the first, is missing).
pub fn ratios(values: &[Option<f64>]) -> Vec<Option<f64>> {
    let first = values.first().copied().flatten();
    values
        .iter()
        .map(|v| Some((*v)? / first?).filter(|r| r.is_finite()))
        .collect()
}

/// A figure of a worker's JSON line, by JSON pointer (`/model_state/optimizer`).
pub fn num(line: &Value, pointer: &str) -> Option<f64> {
    line.pointer(pointer).and_then(Value::as_f64)
}

/// The planner's error in percent of the measured peak ([`off`]), as a cell.
pub fn planned_off(planned: Option<f64>, measured: Option<f64>) -> Value {
    cell(
        planned
            .zip(measured)
            .map(|(p, m)| 100.0 * off(p as usize, m as usize)),
    )
}

/// A cell from an optional figure.
pub fn cell(value: Option<f64>) -> Value {
    value.map_or(Value::Null, |v| json!(v))
}

/// Mebibytes, the unit of every memory column.
pub fn mib(bytes: f64) -> f64 {
    bytes / (1u64 << 20) as f64
}

fn shown(value: &Value) -> String {
    match value {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Number(n) => match n.as_f64() {
            Some(x) if x.fract() == 0.0 && x.abs() < 1e15 => format!("{x:.0}"),
            Some(x) if x.abs() >= 100.0 => format!("{x:.1}"),
            Some(x) => format!("{x:.3}"),
            None => n.to_string(),
        },
        other => other.to_string(),
    }
}

impl Table {
    /// Prints the table and writes its CSV, JSON and SVG; returns the directory.
    pub fn finish(&self) -> Result<PathBuf> {
        if let Some(row) = self.rows.iter().find(|r| r.len() != self.columns.len()) {
            anyhow::bail!(
                "{}: a row of {} cells for {} columns: {row:?}",
                self.name,
                row.len(),
                self.columns.len()
            );
        }
        print!("{}", self.text());
        let dir = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
            .join("article-tables");
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {dir:?}"))?;
        let write = |ext: &str, text: String| {
            let path = dir.join(format!("{}.{ext}", self.name));
            std::fs::write(&path, text).with_context(|| format!("cannot write {path:?}"))
        };
        write("csv", self.csv())?;
        write("json", serde_json::to_string_pretty(&self.json())?)?;
        write("svg", self.svg())?;
        println!("wrote {}/{}.{{csv,json,svg}}", dir.display(), self.name);
        Ok(dir)
    }

    fn text(&self) -> String {
        let cells: Vec<Vec<String>> = std::iter::once(self.columns.iter().map(|c| c.to_string()))
            .map(Iterator::collect)
            .chain(self.rows.iter().map(|r| r.iter().map(shown).collect()))
            .collect();
        let widths: Vec<usize> = (0..self.columns.len())
            .map(|c| cells.iter().map(|r| r[c].len()).max().unwrap_or(0))
            .collect();
        let mut out = format!("{}\n", self.title);
        for note in &self.notes {
            let _ = writeln!(out, "  {note}");
        }
        for row in &cells {
            out.push(' ');
            for (c, text) in row.iter().enumerate() {
                let _ = match c {
                    0 => write!(out, " {text:<w$}", w = widths[c]),
                    _ => write!(out, "  {text:>w$}", w = widths[c]),
                };
            }
            out.push('\n');
        }
        out
    }

    fn csv(&self) -> String {
        let field = |text: String| match text.contains([',', '"']) {
            true => format!("\"{}\"", text.replace('"', "\"\"")),
            false => text,
        };
        let line = |cells: Vec<String>| cells.into_iter().map(field).collect::<Vec<_>>().join(",");
        let mut out = line(self.columns.iter().map(|c| c.to_string()).collect()) + "\n";
        for row in &self.rows {
            let cells = row.iter().map(|v| match v {
                Value::Null => String::new(),
                Value::String(s) => s.clone(),
                other => other.to_string(),
            });
            out += &(line(cells.collect()) + "\n");
        }
        out
    }

    fn json(&self) -> Value {
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|row| {
                let pairs = self.columns.iter().zip(row);
                Value::Object(pairs.map(|(c, v)| (c.to_string(), v.clone())).collect())
            })
            .collect();
        json!({ "title": self.title, "notes": self.notes, "columns": self.columns, "rows": rows })
    }

    /// The plotted ratio columns as grouped bars, one group per row, with a line at 1.
    fn svg(&self) -> String {
        const COLORS: [&str; 4] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"];
        let index = |name: &str| self.columns.iter().position(|c| *c == name);
        let series: Vec<(&str, Vec<Option<f64>>)> = self
            .plotted
            .iter()
            .filter_map(|name| {
                let c = index(name)?;
                Some((*name, self.rows.iter().map(|r| r[c].as_f64()).collect()))
            })
            .collect();
        let top = series
            .iter()
            .flat_map(|(_, v)| v.iter().flatten())
            .fold(1.0f64, |m, &v| m.max(v))
            * 1.1;
        let (left, plot_w, plot_h, base) =
            (60.0, 90.0 * self.rows.len().max(1) as f64, 300.0, 340.0);
        let (width, height) = (left + plot_w + 20.0, base + 170.0);
        let y = |v: f64| base - v / top * plot_h;
        let mut out = format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">
<text x="{left}" y="16" font-size="13">{}</text>
<line x1="{left}" y1="{base}" x2="{}" y2="{base}" stroke="black"/>
<line x1="{left}" y1="{base}" x2="{left}" y2="{}" stroke="black"/>
"#,
            escape(&self.title),
            left + plot_w,
            base - plot_h
        );
        for tick in 0..=4 {
            let v = top * tick as f64 / 4.0;
            let _ = writeln!(
                out,
                r#"<text x="{}" y="{:.1}" text-anchor="end">{v:.2}</text>"#,
                left - 4.0,
                y(v) + 4.0
            );
        }
        let _ = writeln!(
            out,
            r#"<line x1="{left}" y1="{:.1}" x2="{}" y2="{:.1}" stroke="gray" stroke-dasharray="4"/>"#,
            y(1.0),
            left + plot_w,
            y(1.0)
        );
        let bar = 70.0 / series.len().max(1) as f64;
        for (r, row) in self.rows.iter().enumerate() {
            let x0 = left + 90.0 * r as f64 + 10.0;
            for (s, (_, values)) in series.iter().enumerate() {
                if let Some(v) = values[r] {
                    let _ = writeln!(
                        out,
                        r#"<rect x="{:.1}" y="{:.1}" width="{bar:.1}" height="{:.1}" fill="{}"/>"#,
                        x0 + bar * s as f64,
                        y(v),
                        base - y(v),
                        COLORS[s % COLORS.len()]
                    );
                }
            }
            let _ = writeln!(
                out,
                r#"<text transform="translate({:.1},{}) rotate(45)">{}</text>"#,
                x0 + 10.0,
                base + 12.0,
                escape(&shown(&row[0]))
            );
        }
        for (s, (name, _)) in series.iter().enumerate() {
            let ly = 30.0 + 14.0 * s as f64;
            let _ = writeln!(
                out,
                r#"<rect x="{}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{}">{}</text>"#,
                left + plot_w - 150.0,
                ly,
                COLORS[s % COLORS.len()],
                left + plot_w - 136.0,
                ly + 9.0,
                escape(name)
            );
        }
        out + "</svg>\n"
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

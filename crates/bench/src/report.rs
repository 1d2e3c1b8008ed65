//! The common benchmark report: one table on the terminal, one JSON file, the same rows.
//!
//! Format (`docs/architecture.md`, "Measurements"):
//! `{"bench": NAME, "lanbus": VERSION, "command": "lanbus bench ...", "date": "YYYY-MM-DD",
//! "machine": {"cpus": N, "model": "...", ...}, "rows": [...]}` (`vring` adds the caches to `machine`) where each row has `name` (peers are `peer:<program>`), `metric` (unit in the name), `value` (the
//! median of the runs) and the parameters that make it unique (`size_bytes`, `block_size`, `mode`...).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The configuration measured; peers are `peer:<program>`.
    pub name: String,
    /// What was measured, unit in the name (`mpps`, `p50_us`, `ns_per_elem`...).
    pub metric: String,
    /// The median over the runs.
    pub value: f64,
    /// Parameters that make the row unique, flattened into the row's JSON object.
    #[serde(flatten)]
    pub params: BTreeMap<String, Value>,
}

impl Row {
    /// A row without parameters.
    pub fn new(name: impl Into<String>, metric: impl Into<String>, value: f64) -> Self {
        Row { name: name.into(), metric: metric.into(), value, params: BTreeMap::new() }
    }

    /// Adds a parameter (`size_bytes`, `burst`, `mode`...).
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.params.insert(key.to_string(), value.into());
        self
    }
}

/// The machine a report was measured on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// Logical CPUs available to the process.
    pub cpus: usize,
    /// The CPU model from /proc/cpuinfo.
    pub model: String,
    /// Cache sizes and vector width, for benches whose figures depend on them (`vring`).
    #[serde(skip_serializing_if = "Option::is_none", flatten)]
    pub caches: Option<Caches>,
}

/// The caches of one CPU (from /sys/devices/system/cpu/cpuN/cache) and the widest vector store
/// it has.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Caches {
    /// L1 data cache of the CPU, bytes (0 if not found).
    pub l1d_bytes: u64,
    /// L2 cache, bytes (0 if not found).
    pub l2_bytes: u64,
    /// Last-level (L3) cache, bytes (0 if not found or none).
    pub l3_bytes: u64,
    /// The widest vector store the CPU has: 64 (AVX-512), 32 (AVX2), 16 (SSE2), 8 otherwise.
    pub vector_bytes: u64,
}

impl Caches {
    /// Reads CPU `cpu`'s caches from sysfs and this CPU's vector extensions.
    pub fn of_cpu(cpu: usize) -> Self {
        let dir = format!("/sys/devices/system/cpu/cpu{cpu}/cache");
        let mut c = Caches { l1d_bytes: 0, l2_bytes: 0, l3_bytes: 0, vector_bytes: vector_bytes() };
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let read = |f: &str| std::fs::read_to_string(entry.path().join(f)).unwrap_or_default();
            let (level, kind, size) = (read("level"), read("type"), read("size"));
            let Some(bytes) = parse_cache_size(size.trim()) else { continue };
            match (level.trim(), kind.trim()) {
                ("1", "Data") => c.l1d_bytes = bytes,
                ("2", "Unified" | "Data") => c.l2_bytes = bytes,
                ("3", "Unified") => c.l3_bytes = bytes,
                _ => {}
            }
        }
        c
    }

    /// One line for the terminal: `L1d 48 KiB, L2 1 MiB, L3 32 MiB per CPU; vector stores 64 B`.
    pub fn describe(&self) -> String {
        let size = |b: u64| match b {
            0 => "?".to_string(),
            b if b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
            b => format!("{} KiB", b >> 10),
        };
        let vector = match self.vector_bytes {
            64 => "AVX-512",
            32 => "AVX2",
            16 => "SSE2",
            _ => "none",
        };
        format!(
            "L1d {}, L2 {}, L3 {}; widest vector store {} B ({vector})",
            size(self.l1d_bytes),
            size(self.l2_bytes),
            size(self.l3_bytes),
            self.vector_bytes
        )
    }
}

/// `48K` / `1024K` / `32M` (sysfs cache sizes) to bytes.
fn parse_cache_size(s: &str) -> Option<u64> {
    let (digits, mult) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits.parse::<u64>().ok().map(|n| n * mult)
}

/// The widest vector store this CPU has, in bytes.
fn vector_bytes() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return 64;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return 32;
        }
        16
    }
    #[cfg(not(target_arch = "x86_64"))]
    8
}

impl Machine {
    /// Reads this machine's description. The CPUs are the machine's, from /proc/cpuinfo: a bench
    /// that pinned its threads (`ring`, `vring`) has fewer in its affinity mask.
    pub fn this() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let listed = cpuinfo.lines().filter(|l| l.starts_with("processor")).count();
        let cpus = if listed > 0 {
            listed
        } else {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        };
        let model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, m)| m.trim().to_string())
            .unwrap_or_else(|| "unknown".to_string());
        Machine { cpus, model, caches: None }
    }
}

/// A whole benchmark report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The benchmark's name (`vring`, `ring`, `transport`...).
    pub bench: String,
    /// The lanbus version that ran it (`git describe` when built from a checkout).
    pub lanbus: String,
    /// The command line that ran it, the program shown as `lanbus` (`lanbus bench ring --runs 9`).
    pub command: String,
    /// The day it ran, UTC, `YYYY-MM-DD`.
    pub date: String,
    /// Where it ran.
    pub machine: Machine,
    /// The figures.
    pub rows: Vec<Row>,
}

impl Report {
    /// An empty report for benchmark `bench` on this machine.
    pub fn new(bench: &str) -> Self {
        let describe = env!("LANBUS_GIT_DESCRIBE");
        let lanbus =
            if describe.is_empty() { env!("CARGO_PKG_VERSION").to_string() } else { describe.to_string() };
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Report {
            bench: bench.to_string(),
            lanbus,
            command: command_line(std::env::args()),
            date: utc_date(secs),
            machine: Machine::this(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn push(&mut self, row: Row) {
        self.rows.push(row);
    }

    /// Writes the JSON form to `path`.
    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(path, text + "\n")
    }

    /// The rows as an aligned text table: name, parameters, metric, value.
    pub fn table(&self) -> String {
        let cells: Vec<[String; 4]> = self
            .rows
            .iter()
            .map(|r| {
                let params = r
                    .params
                    .iter()
                    .map(|(k, v)| match v {
                        Value::String(s) => format!("{k}={s}"),
                        other => format!("{k}={other}"),
                    })
                    .collect::<Vec<_>>()
                    .join(" ");
                [r.name.clone(), params, r.metric.clone(), format_value(r.value)]
            })
            .collect();
        let header = ["name", "params", "metric", "value"].map(String::from);
        let mut widths = header.clone().map(|h| h.len());
        for row in &cells {
            for (w, c) in widths.iter_mut().zip(row) {
                *w = (*w).max(c.len());
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&header).chain(&cells) {
            let _ = writeln!(
                out,
                "{:<w0$}  {:<w1$}  {:<w2$}  {:>w3$}",
                row[0],
                row[1],
                row[2],
                row[3],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2],
                w3 = widths[3]
            );
        }
        out
    }

    /// Prints the table and, if asked, writes the JSON file (saying where).
    pub fn finish(&self, json: Option<&Path>) -> std::io::Result<()> {
        print!("{}", self.table());
        if let Some(path) = json {
            self.write_json(path)?;
            println!("wrote {}", path.display());
        }
        Ok(())
    }
}

/// The command line from the process's arguments, the program shown as `lanbus`; an argument
/// with spaces or shell characters in single quotes.
fn command_line(args: impl Iterator<Item = String>) -> String {
    let quoted = |a: String| {
        let plain = !a.is_empty() && a.chars().all(|c| c.is_ascii_alphanumeric() || "-_=.,:/@%+".contains(c));
        if plain {
            a
        } else {
            format!("'{}'", a.replace('\'', r"'\''"))
        }
    };
    std::iter::once("lanbus".to_string()).chain(args.skip(1).map(quoted)).collect::<Vec<_>>().join(" ")
}

/// The UTC date `YYYY-MM-DD` of `secs` seconds after the Unix epoch.
fn utc_date(secs: u64) -> String {
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The proleptic Gregorian date of a count of days since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Three significant figures, without exponent for everyday magnitudes.
fn format_value(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = (3 - 1 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.digits$}")
}

/// The median of some runs (the mean of the middle two for an even count). `None` if empty or
/// any value is NaN.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 { v[mid] } else { (v[mid - 1] + v[mid]) / 2.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse() {
        assert_eq!(parse_cache_size("48K"), Some(48 << 10));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("x"), None);
        let c = Caches { l1d_bytes: 48 << 10, l2_bytes: 1 << 20, l3_bytes: 32 << 20, vector_bytes: 64 };
        assert_eq!(c.describe(), "L1d 48 KiB, L2 1 MiB, L3 32 MiB; widest vector store 64 B (AVX-512)");
        let mut r = Report::new("vring");
        r.machine.caches = Some(c);
        let v: Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["machine"]["l3_bytes"], 32 << 20);
        assert_eq!(v["machine"]["vector_bytes"], 64);
    }

    #[test]
    fn median_of_runs() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn json_has_the_common_shape() {
        let mut r = Report::new("ring");
        r.push(Row::new("lanbus", "ns_per_elem", 1.25).with("burst", 8));
        r.push(Row::new("peer:rte_ring", "ns_per_elem", 1.5).with("burst", 8));
        let v: Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["bench"], "ring");
        assert!(v["command"].as_str().unwrap().starts_with("lanbus"));
        let date = v["date"].as_str().unwrap();
        assert!(date.len() == 10 && date.as_bytes()[4] == b'-' && date.as_bytes()[7] == b'-', "{date}");
        assert!(v["machine"]["cpus"].as_u64().unwrap() >= 1);
        assert_eq!(v["rows"][0]["name"], "lanbus");
        assert_eq!(v["rows"][0]["burst"], 8);
        assert_eq!(v["rows"][1]["value"], 1.5);
        let table = r.table();
        assert!(table.contains("peer:rte_ring") && table.contains("burst=8") && table.contains("1.25"));
    }

    #[test]
    fn dates_from_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(11_017), (2000, 3, 1));
        assert_eq!(utc_date(1_796_169_600), "2026-12-02");
        assert_eq!(utc_date(1_796_169_600 - 1), "2026-12-01");
        assert_eq!(utc_date(951_782_400), "2000-02-29");
    }

    #[test]
    fn command_shows_lanbus() {
        let args = ["/x/target/debug/lanbus", "bench", "nvme", "--only", "afpacket,peer:nbd-tcp", "a b"];
        assert_eq!(
            command_line(args.iter().map(|s| s.to_string())),
            "lanbus bench nvme --only afpacket,peer:nbd-tcp 'a b'"
        );
    }

    #[test]
    fn values_keep_three_figures() {
        assert_eq!(format_value(13.456), "13.5");
        assert_eq!(format_value(0.01234), "0.0123");
        assert_eq!(format_value(1234.4), "1234");
    }
}

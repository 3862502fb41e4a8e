//! The side-by-side figures the benches record for the one table
//! (`benches/side-by-side` renders it, and its chart): one JSON line per
//! comparison, appended to the file FERROVOL_BENCH_RESULTS names; nothing
//! when it is unset. Each line is one call (or figure) of one backend:
//! ferrovol's value beside a peer driver's or the floor's (the bare tools
//! doing the same work), measured in the same run.

// Two benches include this file, and each uses its own part of it.
#![allow(dead_code)]

use std::io::Write;
use std::time::Duration;

/// What ferrovol is put beside.
#[derive(Clone, Copy)]
pub enum Against {
    /// Another driver users run instead.
    Peer,
    /// The bare tools (or library) doing the same work.
    Floor,
}

/// Which way is better for a figure.
#[derive(Clone, Copy)]
pub enum Better {
    Lower,
    Higher,
}

/// One figure: its p50 (or the value itself) and its p99 when it has one.
#[derive(Clone, Copy)]
pub struct Value {
    pub p50: f64,
    pub p99: Option<f64>,
}

impl Value {
    /// Milliseconds from two percentiles.
    pub fn ms(p50: Duration, p99: Duration) -> Self {
        Value {
            p50: p50.as_secs_f64() * 1e3,
            p99: Some(p99.as_secs_f64() * 1e3),
        }
    }

    /// One value with no spread (a rate, a peak).
    pub fn one(v: f64) -> Self {
        Value { p50: v, p99: None }
    }
}

/// One comparison.
pub struct Row<'a> {
    pub backend: &'a str,
    pub call: &'a str,
    /// `ms`, `MiB`, `pairs/s`...
    pub unit: &'a str,
    pub better: Better,
    pub ours: Value,
    /// Who or what: `csi-driver-nfs`, `lvcreate`, `librbd`...
    pub against: &'a str,
    pub kind: Against,
    pub theirs: Value,
}

impl<'a> Row<'a> {
    /// A call's times in milliseconds (lower is better) beside another's.
    pub fn times(
        backend: &'a str,
        call: &'a str,
        ours: Value,
        against: &'a str,
        kind: Against,
        theirs: Value,
    ) -> Self {
        Row {
            backend,
            call,
            unit: "ms",
            better: Better::Lower,
            ours,
            against,
            kind,
            theirs,
        }
    }

    /// The driver's peak RSS in MiB beside a peer driver's.
    pub fn peak_rss(backend: &'a str, ours_mib: f64, against: &'a str, theirs_mib: f64) -> Self {
        Row {
            backend,
            call: "driver peak RSS",
            unit: "MiB",
            better: Better::Lower,
            ours: Value::one(ours_mib),
            against,
            kind: Against::Peer,
            theirs: Value::one(theirs_mib),
        }
    }
}

/// Appends `row` to FERROVOL_BENCH_RESULTS, if set.
pub fn record(row: Row<'_>) {
    let line = serde_json::json!({
        "backend": row.backend,
        "call": row.call,
        "unit": row.unit,
        "better": match row.better { Better::Lower => "lower", Better::Higher => "higher" },
        "ours": row.ours.p50,
        "ours_p99": row.ours.p99,
        "against": row.against,
        "kind": match row.kind { Against::Peer => "peer", Against::Floor => "floor" },
        "theirs": row.theirs.p50,
        "theirs_p99": row.theirs.p99,
    });
    append(line);
}

/// Appends one line to FERROVOL_BENCH_RESULTS, if set.
fn append(line: serde_json::Value) {
    let Some(path) = std::env::var_os("FERROVOL_BENCH_RESULTS") else {
        return;
    };
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", std::path::Path::new(&path).display()));
    // One write(2) per line: benches in two processes may append at once.
    f.write_all(format!("{line}\n").as_bytes()).unwrap();
}

/// Appends a figure nothing is put beside (no peer publishes one, and it
/// has no floor), if FERROVOL_BENCH_RESULTS is set: its p50 and its worst,
/// in milliseconds.
pub fn record_figure(backend: &str, what: &str, p50: Duration, worst: Duration) {
    append(serde_json::json!({
        "backend": backend,
        "call": what,
        "unit": "ms",
        "figure": true,
        "ours": p50.as_secs_f64() * 1e3,
        "ours_worst": worst.as_secs_f64() * 1e3,
    }));
}

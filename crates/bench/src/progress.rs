//! A progress bar on stderr for long runs.
//!
//! Drawn only when stderr is a terminal (so logs and tests stay clean), redrawn at most ten times
//! a second, and erased when dropped. Nothing here touches stdout, whose content must depend only
//! on the run's inputs.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// A bar for one task.
#[derive(Debug)]
pub struct Progress {
    label: String,
    enabled: bool,
    last_draw: Option<Instant>,
}

impl Progress {
    /// A bar labelled `label`, shown if stderr is a terminal.
    pub fn new(label: impl Into<String>) -> Self {
        Progress { label: label.into(), enabled: std::io::stderr().is_terminal(), last_draw: None }
    }

    /// Shows `fraction` (0..=1) done.
    pub fn set(&mut self, fraction: f64) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if self.last_draw.is_some_and(|t| now - t < Duration::from_millis(100)) && fraction < 1.0 {
            return;
        }
        self.last_draw = Some(now);
        let width = 30;
        let filled = ((fraction.clamp(0.0, 1.0) * width as f64) as usize).min(width);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r\x1b[2K[{}{}] {:>3.0}% {}",
            "#".repeat(filled),
            ".".repeat(width - filled),
            fraction * 100.0,
            self.label
        );
        let _ = err.flush();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if self.enabled && self.last_draw.is_some() {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
        }
    }
}

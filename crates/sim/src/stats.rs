//! Sample statistics for simulation results: mean and nearest-rank percentiles.
//!
//! Layer: simulation helpers. Samples are kept whole (no sketches) so percentiles are exact; the
//! nearest-rank definition is used (the p-th percentile is the smallest sample with at least p% of
//! the samples at or below it).

/// A bag of samples (any unit; the caller names it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Samples {
    values: Vec<f64>,
    sorted: bool,
}

impl Samples {
    /// An empty bag.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a sample.
    pub fn push(&mut self, v: f64) {
        self.values.push(v);
        self.sorted = false;
    }

    /// How many samples there are.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The arithmetic mean, or `None` when empty.
    pub fn mean(&self) -> Option<f64> {
        (!self.values.is_empty()).then(|| self.values.iter().sum::<f64>() / self.values.len() as f64)
    }

    /// The nearest-rank percentile `p` in `0.0..=100.0`, or `None` when empty.
    pub fn percentile(&mut self, p: f64) -> Option<f64> {
        if self.values.is_empty() {
            return None;
        }
        if !self.sorted {
            self.values.sort_by(f64::total_cmp);
            self.sorted = true;
        }
        let n = self.values.len();
        let rank = ((p.clamp(0.0, 100.0) / 100.0) * n as f64).ceil() as usize;
        Some(self.values[rank.clamp(1, n) - 1])
    }

    /// The largest sample, or `None` when empty.
    pub fn max(&self) -> Option<f64> {
        self.values.iter().copied().max_by(f64::total_cmp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut s = Samples::new();
        assert_eq!(s.percentile(50.0), None);
        for v in (1..=100).rev() {
            s.push(v as f64);
        }
        assert_eq!(s.mean(), Some(50.5));
        assert_eq!(s.percentile(50.0), Some(50.0));
        assert_eq!(s.percentile(99.0), Some(99.0));
        assert_eq!(s.percentile(100.0), Some(100.0));
        assert_eq!(s.percentile(0.0), Some(1.0));
        assert_eq!(s.max(), Some(100.0));
    }
}

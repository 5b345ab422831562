//! Request and execution rates for the overview, from the process's own counters: each look at the overview
//! samples them, and a rate is the change since the newest sample at least a minute old (else the oldest
//! kept, the first taken when the pages were set up), so it needs no task of its own and no Prometheus.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The counters a rate is shown for, with the words the overview uses.
pub const RATED: [(&str, &str); 3] = [
    ("idem_http_requests_total", "HTTP requests (every listener)"),
    ("idem_idempotency_claims_total", "executions (claims)"),
    ("idem_idempotency_replays_total", "replays"),
];

/// How far back a rate looks, at least: Prometheus's usual `rate(…[1m])`.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Samples older than this are dropped (the one the next rate needs is kept).
const KEPT: Duration = Duration::from_secs(600);

/// At most one sample is kept per this long: a page loaded a thousand times a second keeps what one loaded
/// every few seconds keeps (at most `KEPT / SPACING` + 1 samples, of [`RATED`]'s counters only).
const SPACING: Duration = Duration::from_secs(5);

/// A rate over less than this is not shown: a few requests right after start-up are not a rate.
pub const SHORTEST: Duration = Duration::from_secs(1);

/// One rate: per second over the last `over`.
#[derive(Clone, Debug, PartialEq)]
pub struct Rate {
    /// What it counts ([`RATED`]'s words).
    pub what: &'static str,
    /// Per second.
    pub per_second: f64,
    /// The time it was measured over.
    pub over: Duration,
}

/// The samples taken so far.
#[derive(Debug, Default)]
pub struct Rates {
    samples: Mutex<VecDeque<(Instant, BTreeMap<String, f64>)>>,
}

impl Rates {
    /// Records `totals` (counter name → value) as seen at `now`, and returns the rates of [`RATED`] since the
    /// newest earlier sample at least [`WINDOW`] old (or the oldest one); empty when there is no earlier sample
    /// at least [`SHORTEST`] old. A counter that went down (a restarted process) counts from 0, as Prometheus's
    /// `rate` does.
    pub fn observe(&self, now: Instant, totals: &[(String, String)]) -> Vec<Rate> {
        let totals: BTreeMap<String, f64> = totals
            .iter()
            .filter(|(k, _)| RATED.iter().any(|(name, _)| name == k))
            .filter_map(|(k, v)| Some((k.clone(), v.parse::<f64>().ok()?)))
            .collect();
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let base = samples
            .iter()
            .rev()
            .find(|(at, _)| now.saturating_duration_since(*at) >= WINDOW)
            .or_else(|| samples.front())
            .filter(|(at, _)| now.saturating_duration_since(*at) >= SHORTEST)
            .cloned();
        let rates = match base {
            Some((at, before)) => {
                let over = now - at;
                RATED
                    .iter()
                    .map(|(name, what)| {
                        let (was, is) =
                            (before.get(*name).copied().unwrap_or(0.0), totals.get(*name).copied().unwrap_or(0.0));
                        let delta = if is >= was { is - was } else { is };
                        Rate { what, per_second: delta / over.as_secs_f64(), over }
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        // Keep what a later rate may need: everything younger than KEPT, and the newest one older.
        while samples.len() > 1 && samples.get(1).is_some_and(|(at, _)| now.saturating_duration_since(*at) >= KEPT) {
            samples.pop_front();
        }
        if samples.back().is_none_or(|(at, _)| now.saturating_duration_since(*at) >= SPACING) {
            samples.push_back((now, totals));
        }
        rates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(requests: u64, claims: u64) -> Vec<(String, String)> {
        vec![
            ("idem_http_requests_total".into(), requests.to_string()),
            ("idem_idempotency_claims_total".into(), claims.to_string()),
        ]
    }

    #[test]
    fn a_rate_is_the_change_since_the_newest_sample_a_window_old() {
        let rates = Rates::default();
        let t0 = Instant::now();
        assert!(rates.observe(t0, &totals(0, 0)).is_empty(), "no earlier sample");
        // 10 s later: only the first sample is there, younger than the window: the rate over 10 s.
        let r = rates.observe(t0 + Duration::from_secs(10), &totals(100, 50));
        assert_eq!((r[0].per_second, r[1].per_second, r[0].over), (10.0, 5.0, Duration::from_secs(10)));
        assert_eq!((r[2].what, r[2].per_second), ("replays", 0.0));
        // 70 s: the sample at 10 s is a minute old: the rate over the last 60 s.
        let r = rates.observe(t0 + Duration::from_secs(70), &totals(700, 50));
        assert_eq!((r[0].per_second, r[1].per_second, r[0].over), (10.0, 0.0, Duration::from_secs(60)));
        // A counter that went down started again from 0.
        let r = rates.observe(t0 + Duration::from_secs(130), &totals(60, 50));
        assert_eq!(r[0].per_second, 1.0);
    }

    #[test]
    fn old_samples_are_dropped_but_the_one_a_rate_needs_is_kept() {
        let rates = Rates::default();
        let t0 = Instant::now();
        for s in 0..100 {
            rates.observe(t0 + Duration::from_secs(s * 30), &totals(s, 0));
        }
        let kept = rates.samples.lock().unwrap().len();
        assert!(kept <= 22, "{kept} samples kept");
        let r = rates.observe(t0 + Duration::from_secs(3000), &totals(130, 0));
        assert_eq!(r[0].over, Duration::from_secs(60));
    }

    /// A page loaded many times a second keeps one sample per `SPACING`, of the rated counters only (each load
    /// kept one of every counter: 1.9 KB a load, a gigabyte at a thousand loads a second for ten minutes); and
    /// a rate over less than `SHORTEST` is not shown.
    #[test]
    fn loads_many_times_a_second_keep_a_bounded_number_of_samples() {
        let rates = Rates::default();
        let t0 = Instant::now();
        let mut many = totals(0, 0);
        many.extend((0..50).map(|i| (format!("idem_other_{i}_total"), "1".to_owned())));
        assert!(rates.observe(t0, &many).is_empty());
        assert!(rates.observe(t0 + Duration::from_millis(500), &many).is_empty(), "0.5 s is no rate");
        for ms in 0..100_000 {
            rates.observe(t0 + Duration::from_millis(1000 + ms * 6), &many);
        }
        let samples = rates.samples.lock().unwrap();
        assert!(samples.len() <= 122, "{} samples", samples.len());
        assert!(samples.iter().all(|(_, t)| t.len() <= RATED.len()), "only the rated counters are kept");
    }
}

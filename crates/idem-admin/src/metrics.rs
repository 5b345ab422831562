//! Reading this process's Prometheus text (what `/metrics` serves) for the overview and the routes page.

use serde::Serialize;

/// One sample line: name, labels as written (`route="a",reason="stale"`), value.
fn samples(text: &str) -> impl Iterator<Item = (&str, &str, &str)> {
    text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).filter_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        Some(match series.split_once('{') {
            Some((name, labels)) => (name, labels.trim_end_matches('}'), value),
            None => (series, "", value),
        })
    })
}

/// The idempotency layer's counters and the request total, summed over their labels, by name.
pub fn totals(text: &str) -> Vec<(String, String)> {
    let mut out: std::collections::BTreeMap<String, f64> = Default::default();
    for (name, _, value) in samples(text) {
        let kept = name.starts_with("idem_idempotency_") || name == "idem_http_requests_total";
        if kept && let Ok(v) = value.parse::<f64>() {
            *out.entry(name.to_owned()).or_default() += v;
        }
    }
    out.into_iter().map(|(k, v)| (k, format!("{v}"))).collect()
}

/// One webhook route counter.
#[derive(Clone, Debug, Serialize)]
pub struct RouteCounter {
    /// The route.
    pub route: String,
    /// The counter (`idem_route_deliveries_total`, `idem_route_signature_refusals_total`, …).
    pub name: String,
    /// Its other labels (`reason="stale"`).
    pub labels: String,
    /// Its value.
    pub value: String,
}

/// The `idem_route_*` counters, by route then name.
pub fn route_counters(text: &str) -> Vec<RouteCounter> {
    let mut out: Vec<RouteCounter> = samples(text)
        .filter(|(name, _, _)| name.starts_with("idem_route_"))
        .filter_map(|(name, labels, value)| {
            let mut route = None;
            let mut rest = Vec::new();
            for label in labels.split(',').filter(|l| !l.is_empty()) {
                match label.strip_prefix("route=") {
                    Some(r) => route = Some(r.trim_matches('"').to_owned()),
                    None => rest.push(label),
                }
            }
            Some(RouteCounter { route: route?, name: name.to_owned(), labels: rest.join(","), value: value.to_owned() })
        })
        .collect();
    out.sort_by(|a, b| (&a.route, &a.name, &a.labels).cmp(&(&b.route, &b.name, &b.labels)));
    out
}

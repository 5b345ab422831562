//! `--metrics-file`: a job's state after an invocation in the Prometheus text exposition format (version
//! 0.0.4), for node_exporter's textfile collector, the usual way to watch cron jobs: an alert on
//! `time() - idem_once_last_success_timestamp_seconds` catches a job that stopped succeeding, whatever the
//! reason (no machine invoked it, every attempt failed, it was paused and forgotten).

use super::status::History;

/// The states `idem_once_last_slot_state` has a series for (those `status` shows; `crashed` is `running`
/// whose holder's lease lapsed).
const STATES: [&str; 11] = [
    "done",
    "failed",
    "replaced",
    "running",
    "crashed",
    "given_back",
    "waiting",
    "paused",
    "skipped",
    "requested",
    "missed",
];

/// The metrics of `history` (read right after the invocation), whose invocation exited `exit_code` at `now_ms`
/// (milliseconds since the Unix epoch): every series labelled `once_job="NAME"` (not `job`, which Prometheus
/// sets to the scrape's own: a `job` label here would be renamed `exported_job`). Times are Unix seconds.
pub fn prometheus(history: &History, exit_code: i32, now_ms: u64) -> String {
    let job = format!("once_job=\"{}\"", escape(&history.name));
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, series: Vec<(String, String)>| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (labels, value) in series {
            out.push_str(&format!("{name}{{{labels}}} {value}\n"));
        }
    };
    let seconds = |ms: u64| format!("{:.3}", ms as f64 / 1000.0);
    let newest = history.slots.first();
    if let Some(ms) = history.last_success.as_deref().and_then(rfc3339_ms) {
        gauge(
            "idem_once_last_success_timestamp_seconds",
            "When the job's newest successful run ended (Unix time).",
            vec![(job.clone(), seconds(ms))],
        );
    }
    if let Some(ms) = newest.and_then(|s| rfc3339_ms(&s.slot)) {
        gauge(
            "idem_once_last_slot_timestamp_seconds",
            "The scheduled time of the job's newest slot (Unix time).",
            vec![(job.clone(), seconds(ms))],
        );
    }
    let state = newest.map_or("", |s| s.state);
    gauge(
        "idem_once_last_slot_state",
        "The state of the job's newest slot: 1 for its state, 0 for the others.",
        STATES.iter().map(|s| (format!("{job},state=\"{s}\""), u8::from(*s == state).to_string())).collect(),
    );
    gauge(
        "idem_once_slots_missed",
        "Slots of the job recorded missed, in all (a lower bound past a million in one gap).",
        vec![(job.clone(), history.missed.to_string())],
    );
    gauge(
        "idem_once_slots_run_more_than_once",
        "Slots whose command ran to a successful end more than once: must stay 0.",
        vec![(job.clone(), history.ran_more_than_once.to_string())],
    );
    gauge(
        "idem_once_slots_taken_over",
        "Slots whose attempt was taken over from a holder that vanished (it may have run too).",
        vec![(job.clone(), history.taken_over.to_string())],
    );
    gauge(
        "idem_once_pending_runs",
        "Runs requested (backfill, catch-up, trigger) and not run yet.",
        vec![(job.clone(), history.pending.to_string())],
    );
    gauge(
        "idem_once_paused",
        "1 while the job is paused (idem once pause), else 0.",
        vec![(job.clone(), u8::from(history.pause.as_ref().is_some_and(|p| p.paused)).to_string())],
    );
    gauge(
        "idem_once_last_invocation_exit_code",
        "The exit status of the invocation that wrote this file.",
        vec![(job.clone(), exit_code.to_string())],
    );
    gauge(
        "idem_once_last_invocation_timestamp_seconds",
        "When the invocation that wrote this file ended (Unix time).",
        vec![(job, seconds(now_ms))],
    );
    out
}

/// The series an invocation that could not read the job's state writes (the store unavailable: exit 75): the
/// file as it was (`previous`), its other series kept as they stand, with the two invocation series
/// (`idem_once_last_invocation_exit_code` and `…_timestamp_seconds`) replaced; only those two when there was
/// no file. So an alert on the exit code sees the outage, and one on the last success does not see a job
/// that vanished.
pub fn invocation_only(previous: Option<&str>, name: &str, exit_code: i32, now_ms: u64) -> String {
    const OWN: [&str; 2] = ["idem_once_last_invocation_exit_code", "idem_once_last_invocation_timestamp_seconds"];
    let ours = |line: &str| {
        let metric = line.strip_prefix("# HELP ").or_else(|| line.strip_prefix("# TYPE ")).unwrap_or(line);
        OWN.iter().any(|m| metric.strip_prefix(m).is_some_and(|rest| rest.starts_with(['{', ' '])))
    };
    let mut out: String = previous.unwrap_or_default().lines().filter(|l| !ours(l)).map(|l| format!("{l}\n")).collect();
    let job = format!("once_job=\"{}\"", escape(name));
    out.push_str(&format!(
        "# HELP {0} The exit status of the invocation that wrote this file.\n# TYPE {0} gauge\n{0}{{{job}}} {exit_code}\n",
        OWN[0]
    ));
    out.push_str(&format!(
        "# HELP {0} When the invocation that wrote this file ended (Unix time).\n# TYPE {0} gauge\n{0}{{{job}}} {1:.3}\n",
        OWN[1],
        now_ms as f64 / 1000.0
    ));
    out
}

fn rfc3339_ms(s: &str) -> Option<u64> {
    let t: jiff::Timestamp = s.parse().ok()?;
    u64::try_from(t.as_millisecond()).ok()
}

/// A label value escaped as the text format says: backslash, double quote and line feed.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invocation_that_cannot_read_the_store_replaces_only_its_own_series() {
        let history = "# HELP idem_once_paused x\n# TYPE idem_once_paused gauge\nidem_once_paused{once_job=\"j\"} 0\n\
                       # HELP idem_once_last_invocation_exit_code x\n# TYPE idem_once_last_invocation_exit_code gauge\n\
                       idem_once_last_invocation_exit_code{once_job=\"j\"} 0\n";
        let text = invocation_only(Some(history), "j", 75, 2000);
        assert!(text.contains("idem_once_paused{once_job=\"j\"} 0\n"), "{text}");
        assert!(text.contains("idem_once_last_invocation_exit_code{once_job=\"j\"} 75\n"), "{text}");
        assert!(!text.contains("} 0\nidem_once_last_invocation_exit_code{once_job=\"j\"} 0"), "{text}");
        assert_eq!(text.matches("# TYPE idem_once_last_invocation_exit_code").count(), 1, "{text}");
        assert!(text.contains("idem_once_last_invocation_timestamp_seconds{once_job=\"j\"} 2.000\n"), "{text}");
        let alone = invocation_only(None, "j", 75, 2000);
        assert_eq!(alone.lines().count(), 6, "{alone}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn rfc3339_times_with_offsets_are_read() {
        assert_eq!(rfc3339_ms("1970-01-01T00:00:01Z"), Some(1000));
        assert_eq!(rfc3339_ms("1970-01-01T01:00:01+01:00"), Some(1000));
        assert_eq!(rfc3339_ms("soon"), None);
    }
}

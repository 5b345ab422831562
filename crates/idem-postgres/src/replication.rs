//! Whether the primary's synchronous replication waits for every standby, so that no standby can be promoted
//! without a commit idem was told of: through a crash of the primary, a switchover with the old primary still
//! running (`pg_ctl promote` of a standby: with `FIRST 1` or `ANY 1` and two standbys, the other standby
//! becomes the one that acknowledges, and what it acknowledges is lost with the old primary), or a partition.
//!
//! The standbys counted are the most of the hosts the URL lists besides the primary (the ones idem would fail
//! over to, connected or not: a standby cut off from the primary can still be promoted) and the standbys the
//! primary has connected (`pg_stat_replication`). Commits wait for every standby when `synchronous_commit` is
//! `on` or `remote_apply` and `synchronous_standby_names` asks for at least that many (`ANY n (…)`, `FIRST n
//! (…)`, `n (…)`; a plain list or `*` asks for one). `remote_write` is not counted: a standby's operating
//! system crash loses what it had only written.
//!
//! `synchronous_standbys=all` in the URL makes a primary that does not wait for every standby a start-up error
//! ([`crate::Error::NotSynchronous`]); without it idem warns at start-up and on every change it sees (checked
//! every [`EVERY`]), and sets the `idem_store_replicas_unwaited` gauge to the standbys a commit does not wait for.

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_postgres::Client;

/// How often the replication setting is read again.
pub(crate) const EVERY: Duration = Duration::from_secs(10);

/// What the primary's settings make a commit wait for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Coverage {
    /// Standbys that could be promoted.
    pub(crate) standbys: u32,
    /// Standbys a commit waits for.
    pub(crate) waited: u32,
    /// `synchronous_commit` and `synchronous_standby_names` as the server shows them.
    pub(crate) setting: String,
    /// Connected standbys the primary counts as synchronous now (`pg_stat_replication.sync_state` `sync` or
    /// `quorum`): fewer than `waited` and every commit waits. `u32::MAX` when the role may not see it.
    pub(crate) acknowledging: u32,
    /// The connected standbys' `application_name`s, for the warning.
    pub(crate) names: String,
}

impl Coverage {
    /// Standbys a commit does not wait for.
    pub(crate) fn unwaited(&self) -> u32 {
        self.standbys.saturating_sub(self.waited)
    }
}

/// How many standbys `synchronous_standby_names` makes a commit wait for: `ANY n (…)`, `FIRST n (…)` and
/// `n (…)` ask for `n`; a plain list of names or `*` for one; empty for none
/// (<https://www.postgresql.org/docs/15/runtime-config-replication.html#GUC-SYNCHRONOUS-STANDBY-NAMES>).
pub(crate) fn required(names: &str) -> u32 {
    let names = names.trim();
    if names.is_empty() {
        return 0;
    }
    let upper = names.to_ascii_uppercase();
    let rest = upper.strip_prefix("ANY").or_else(|| upper.strip_prefix("FIRST")).unwrap_or(&upper).trim_start();
    match rest.split_once('(') {
        Some((n, _)) => n.trim().parse().unwrap_or(1),
        None => 1,
    }
}

/// Reads what the primary `client` is connected to waits for, with `listed` standbys named in the URL.
pub(crate) async fn coverage(client: &Client, listed: u32) -> Result<Coverage, tokio_postgres::Error> {
    // Without pg_read_all_stats (or pg_monitor) a role sees pg_stat_replication's rows but NULL in most
    // columns: then the standbys acknowledging now are unknown, and nothing is said about them.
    let row = client
        .query_one(
            "SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'), \
             (SELECT count(*) FROM pg_stat_replication WHERE state IS DISTINCT FROM 'backup'), \
             (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')), \
             (SELECT count(*) FROM pg_stat_replication WHERE state IS NULL), \
             (SELECT coalesce(string_agg(application_name, ', ' ORDER BY application_name), '') \
              FROM pg_stat_replication WHERE state IS DISTINCT FROM 'backup')",
            &[],
        )
        .await?;
    let (commit, names, connected, acknowledging, hidden, apps): (String, String, i64, i64, i64, String) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4), row.get(5));
    let acknowledging = if hidden > 0 { u32::MAX } else { u32::try_from(acknowledging).unwrap_or(u32::MAX) };
    let standbys = listed.max(u32::try_from(connected).unwrap_or(u32::MAX));
    let waited = if matches!(commit.as_str(), "on" | "remote_apply") { required(&names) } else { 0 };
    Ok(Coverage {
        standbys,
        waited,
        setting: format!("synchronous_commit={commit}, synchronous_standby_names='{names}'"),
        acknowledging,
        names: apps,
    })
}

/// Logs a commit that does not wait for every standby, or that cannot complete, and sets the gauge.
pub(crate) fn judge(c: &Coverage) {
    metrics::gauge!("idem_store_replicas_unwaited").set(f64::from(c.unwaited()));
    if c.acknowledging < c.waited {
        // The names in synchronous_standby_names must be the standbys' application_name (pg_basebackup -R
        // writes none, and every standby then calls itself walreceiver): otherwise no standby counts and every
        // commit waits for ever, which looks like a hung store.
        tracing::warn!(
            setting = %c.setting,
            connected = %c.names,
            "commits wait: synchronous_standby_names asks for {} standbys and {} connected standbys count as \
             synchronous (connected: {}); writes stall until enough standbys whose application_name is one of the \
             names stream (set application_name in each standby's primary_conninfo, or its cluster_name)",
            c.waited,
            c.acknowledging,
            if c.names.is_empty() { "none" } else { c.names.as_str() }
        );
    }
    if c.unwaited() > 0 {
        tracing::warn!(
            standbys = c.standbys,
            waited = c.waited,
            setting = %c.setting,
            "a commit waits for {} of {} PostgreSQL standbys: promoting one it did not wait for (a failover, or \
             pg_ctl promote with the old primary still running) loses acknowledged writes; \
             synchronous_standby_names = 'ANY {} (…)' naming every server's application_name, with \
             synchronous_commit = on, waits for all",
            c.waited,
            c.standbys,
            c.standbys
        );
    }
}

/// Reads the coverage again every [`EVERY`] and judges it when it changed, until `pool` is closed.
pub(crate) fn watch(pool: Pool, listed: u32, first: Coverage) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last = first;
        loop {
            tokio::time::sleep(EVERY).await;
            if pool.is_closed() {
                return;
            }
            let Ok(client) = pool.get().await else { continue };
            let Ok(now) = coverage(&client, listed).await else { continue };
            // Set at each read, not only on a change: a recorder installed after the first still shows it.
            metrics::gauge!("idem_store_replicas_unwaited").set(f64::from(now.unwaited()));
            if now != last {
                tracing::info!(setting = %now.setting, standbys = now.standbys, "the PostgreSQL replication setting changed");
                judge(&now);
                last = now;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn required_counts_follow_postgresqls_grammar() {
        for (names, n) in [
            ("", 0),
            ("*", 1),
            ("s1", 1),
            ("s1, s2", 1),
            ("FIRST 2 (s1, s2)", 2),
            ("first 1 (s1, s2)", 1),
            ("ANY 2 (s1, s2)", 2),
            ("any 3 (*)", 3),
            ("2 (s1, s2, s3)", 2),
            ("  ANY 2(s1,s2) ", 2),
        ] {
            assert_eq!(required(names), n, "{names:?}");
        }
    }
}

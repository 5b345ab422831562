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
    let row = client
        .query_one(
            "SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'), \
             (SELECT count(*) FROM pg_stat_replication WHERE state <> 'backup')",
            &[],
        )
        .await?;
    let (commit, names, connected): (String, String, i64) = (row.get(0), row.get(1), row.get(2));
    let standbys = listed.max(u32::try_from(connected).unwrap_or(u32::MAX));
    let waited = if matches!(commit.as_str(), "on" | "remote_apply") { required(&names) } else { 0 };
    Ok(Coverage {
        standbys,
        waited,
        setting: format!("synchronous_commit={commit}, synchronous_standby_names='{names}'"),
    })
}

/// Logs a commit that does not wait for every standby and sets the gauge.
pub(crate) fn judge(c: &Coverage) {
    metrics::gauge!("idem_store_replicas_unwaited").set(f64::from(c.unwaited()));
    if c.unwaited() > 0 {
        tracing::warn!(
            standbys = c.standbys,
            waited = c.waited,
            setting = %c.setting,
            "a commit waits for {} of {} PostgreSQL standbys: promoting one it did not wait for (a failover, or \
             pg_ctl promote with the old primary still running) loses acknowledged writes; \
             synchronous_standby_names = 'ANY {} (…)' naming every standby, with synchronous_commit = on, waits for all",
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

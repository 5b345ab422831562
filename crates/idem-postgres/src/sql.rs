//! [`Sql`]: the store's statements, written once per schema.

/// Statements with the schema name filled in once.
///
/// Every conditional write is ONE statement whose `WHERE` carries the precondition. PostgreSQL evaluates an
/// `UPDATE`/`DELETE` condition, and an `ON CONFLICT DO UPDATE ... WHERE`, against the newest committed version
/// of the row once it holds the row lock, so a lost race simply matches no row: it becomes a failed
/// precondition, never a lost update or a database error. `nextval` in a `SET` is evaluated on that locked
/// row too (re-evaluated when the row changed while the statement waited). An INSERT's is not: creates are
/// numbered again under the new row's lock (see `create` in the store), so per key generations increase in commit order.
pub(crate) struct Sql {
    pub(crate) get: String,
    pub(crate) read_generation: String,
    pub(crate) update_if_generation: String,
    pub(crate) update_if_present: String,
    pub(crate) insert_if_absent: String,
    pub(crate) renumber: String,
    pub(crate) delete_if_generation: String,
    pub(crate) delete_if_present: String,
    pub(crate) delete_any: String,
    pub(crate) lock_row: String,
    pub(crate) list: String,
    pub(crate) dedupe_get: String,
    pub(crate) dedupe_put: String,
    pub(crate) set_dedupe_get: String,
    pub(crate) set_dedupe_put: String,
    pub(crate) sweep_kv: String,
    pub(crate) sweep_dedupe: String,
    pub(crate) sweep_set_dedupe: String,
}

impl Sql {
    pub(crate) fn new(schema: &str) -> Self {
        // Quoted, so a schema named like a keyword ("order", "user") works; validate() allows no quote inside.
        let s = &format!("\"{schema}\"");
        const LIVE: &str = "(k.expires_at IS NULL OR k.expires_at > now())";
        // $4: 0 keep, 1 clear, 2 after $5 milliseconds. On an update the row is live, so "keep" is its own expiry.
        const UPD_EXPIRY: &str = "CASE $4::int WHEN 0 THEN k.expires_at WHEN 1 THEN NULL ELSE now() + $5::float8 * interval '1 millisecond' END";
        const NEW_EXPIRY: &str = "CASE $4::int WHEN 2 THEN now() + $5::float8 * interval '1 millisecond' END";
        let update = |cond: &str| {
            format!(
                "UPDATE {s}.kv k SET value = $2, generation = nextval('{s}.generation'), expires_at = {UPD_EXPIRY} \
                 WHERE k.key = $1 AND {LIVE} {cond} RETURNING k.generation"
            )
        };
        Self {
            get: format!("SELECT k.value, k.generation, k.expires_at FROM {s}.kv k WHERE k.key = $1 AND {LIVE}"),
            read_generation: format!("SELECT k.generation FROM {s}.kv k WHERE k.key = $1 AND {LIVE}"),
            update_if_generation: update("AND k.generation = $3"),
            update_if_present: update("AND $3::bigint IS NULL"),
            // A row that is there but expired counts as absent: it is overwritten as a fresh create.
            insert_if_absent: format!(
                "INSERT INTO {s}.kv AS k (key, value, generation, expires_at) \
                 VALUES ($1, $2, nextval('{s}.generation'), {NEW_EXPIRY}) ON CONFLICT (key) DO UPDATE \
                 SET value = excluded.value, generation = nextval('{s}.generation'), expires_at = excluded.expires_at \
                 WHERE k.expires_at IS NOT NULL AND k.expires_at <= now() AND $3::bigint IS NULL \
                 RETURNING k.generation"
            ),
            renumber: format!(
                "UPDATE {s}.kv k SET generation = nextval('{s}.generation') WHERE k.key = $1 RETURNING k.generation"
            ),
            delete_if_generation: format!(
                "DELETE FROM {s}.kv k WHERE k.key = $1 AND k.generation = $2 AND {LIVE} RETURNING k.generation"
            ),
            delete_if_present: format!(
                "DELETE FROM {s}.kv k WHERE k.key = $1 AND {LIVE} AND $2::bigint IS NULL RETURNING k.generation"
            ),
            delete_any: format!("DELETE FROM {s}.kv k WHERE k.key = $1 RETURNING k.generation, {LIVE}"),
            lock_row: format!("SELECT k.value, k.generation FROM {s}.kv k WHERE k.key = $1 AND {LIVE} FOR UPDATE"),
            // A plain lower bound (max of prefix and cursor, chosen by the caller) lets the planner seek the
            // primary key index instead of scanning from the prefix on every page.
            list: format!(
                "SELECT k.key, k.generation, k.expires_at FROM {s}.kv k WHERE k.key >= $1 AND k.key <> $2 \
                 AND {LIVE} ORDER BY k.key LIMIT $3"
            ),
            dedupe_get: format!(
                "SELECT value, generation, delta FROM {s}.counter_dedupe \
                 WHERE key = $1 AND dedupe_id = $2 AND expires_at > now()"
            ),
            dedupe_put: format!(
                "INSERT INTO {s}.counter_dedupe (key, dedupe_id, value, generation, expires_at, delta) \
                 VALUES ($1, $2, $3, $4, now() + $5::float8 * interval '1 millisecond', $6) \
                 ON CONFLICT (key, dedupe_id) DO UPDATE SET value = excluded.value, \
                 generation = excluded.generation, expires_at = excluded.expires_at, delta = excluded.delta"
            ),
            set_dedupe_get: format!(
                "SELECT fingerprint, generation, members, added, removed FROM {s}.set_dedupe \
                 WHERE key = $1 AND dedupe_id = $2 AND expires_at > now()"
            ),
            // Takes the id only when it is free or its record expired; no row back means a concurrent change
            // under the same id committed first.
            set_dedupe_put: format!(
                "INSERT INTO {s}.set_dedupe AS d \
                 (key, dedupe_id, fingerprint, generation, members, added, removed, expires_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, now() + $8::float8 * interval '1 millisecond') \
                 ON CONFLICT (key, dedupe_id) DO UPDATE SET fingerprint = excluded.fingerprint, \
                 generation = excluded.generation, members = excluded.members, added = excluded.added, \
                 removed = excluded.removed, expires_at = excluded.expires_at WHERE d.expires_at <= now() \
                 RETURNING true"
            ),
            sweep_kv: format!(
                "DELETE FROM {s}.kv WHERE ctid IN (SELECT ctid FROM {s}.kv WHERE expires_at <= now() LIMIT 1000)"
            ),
            sweep_dedupe: format!(
                "DELETE FROM {s}.counter_dedupe WHERE ctid IN \
                 (SELECT ctid FROM {s}.counter_dedupe WHERE expires_at <= now() LIMIT 1000)"
            ),
            sweep_set_dedupe: format!(
                "DELETE FROM {s}.set_dedupe WHERE ctid IN \
                 (SELECT ctid FROM {s}.set_dedupe WHERE expires_at <= now() LIMIT 1000)"
            ),
        }
    }
}

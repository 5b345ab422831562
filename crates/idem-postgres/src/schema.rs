use deadpool_postgres::Client;

use crate::Error;

/// Versioned migrations; `{schema}` is replaced by the (validated) schema name. Never edit a released one:
/// add the next.
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        r#"
CREATE SEQUENCE {schema}.generation AS bigint;
CREATE TABLE {schema}.kv (
    key text COLLATE "C" PRIMARY KEY,
    value bytea NOT NULL,
    generation bigint NOT NULL,
    expires_at timestamptz
);
CREATE INDEX kv_expires_at ON {schema}.kv (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE {schema}.counter_dedupe (
    key text COLLATE "C" NOT NULL,
    dedupe_id text COLLATE "C" NOT NULL,
    value bigint NOT NULL,
    generation bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (key, dedupe_id)
);
CREATE INDEX counter_dedupe_expires_at ON {schema}.counter_dedupe (expires_at);
"#,
    ),
    // Dedupe records remember their payload, so an id reused with another payload is refused. A NULL `delta`
    // is a record written before this migration (or by an older server still running beside a newer one),
    // which kept no payload: it matches any delta, as those versions answered. `set_dedupe.generation` is
    // NULL when the change left no set.
    (
        2,
        r#"
ALTER TABLE {schema}.counter_dedupe ADD COLUMN delta bigint;
CREATE TABLE {schema}.set_dedupe (
    key text COLLATE "C" NOT NULL,
    dedupe_id text COLLATE "C" NOT NULL,
    fingerprint text NOT NULL,
    generation bigint,
    members bigint NOT NULL,
    added bigint NOT NULL,
    removed bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (key, dedupe_id)
);
CREATE INDEX set_dedupe_expires_at ON {schema}.set_dedupe (expires_at);
"#,
    ),
];

/// Checks that a schema name needs no quoting: it is pasted into statements.
pub(crate) fn validate(schema: &str) -> Result<(), Error> {
    let ok = !schema.is_empty()
        && schema.len() <= 63
        && schema.bytes().next().is_some_and(|b| b == b'_' || b.is_ascii_lowercase())
        && schema.bytes().all(|b| b == b'_' || b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok { Ok(()) } else { Err(Error::InvalidSchema(schema.to_owned())) }
}

/// Creates the schema and applies missing migrations in one transaction, under an advisory lock keyed by the
/// schema name so two servers starting at once do not both try.
pub(crate) async fn migrate(client: &mut Client, schema: &str) -> Result<(), Error> {
    let err = |source| Error::Migrate { schema: schema.to_owned(), source };
    let tx = client.transaction().await.map_err(err)?;
    tx.execute("SELECT pg_advisory_xact_lock(1768189293, hashtext($1))", &[&schema]).await.map_err(err)?;
    let q = format!("\"{schema}\"");
    // `IF NOT EXISTS` on what is there already (every start but the first) makes PostgreSQL send a NOTICE
    // ("schema … already exists, skipping"), which tokio-postgres logs at INFO: noise on every start. Notices
    // are off for this transaction only; warnings and errors still come.
    tx.batch_execute(&format!(
        "SET LOCAL client_min_messages = warning;
         CREATE SCHEMA IF NOT EXISTS {q};
         CREATE TABLE IF NOT EXISTS {q}.schema_migrations (
             version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now());"
    ))
    .await
    .map_err(err)?;
    let applied: Vec<i32> = tx
        .query(&format!("SELECT version FROM {q}.schema_migrations"), &[])
        .await
        .map_err(err)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let known = MIGRATIONS.last().map(|m| m.0).unwrap_or(0);
    if let Some(&found) = applied.iter().max()
        && found > known
    {
        return Err(Error::SchemaTooNew { schema: schema.to_owned(), found, known });
    }
    for (version, sql) in MIGRATIONS {
        if applied.contains(version) {
            continue;
        }
        tx.batch_execute(&sql.replace("{schema}", &q)).await.map_err(err)?;
        tx.execute(&format!("INSERT INTO {q}.schema_migrations (version) VALUES ($1)"), &[version])
            .await
            .map_err(err)?;
        tracing::info!(schema, version, "applied migration");
    }
    tx.commit().await.map_err(err)
}

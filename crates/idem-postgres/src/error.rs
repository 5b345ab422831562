/// Errors connecting to PostgreSQL. Operations on a connected store return [`idem_store::Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The URL is not a PostgreSQL connection string.
    #[error("invalid PostgreSQL URL")]
    InvalidUrl(#[source] tokio_postgres::Error),
    /// The schema name is not a plain lowercase identifier (`[a-z_][a-z0-9_]{0,62}`).
    #[error("invalid schema name {0:?}: use [a-z_][a-z0-9_]*, at most 63 bytes")]
    InvalidSchema(String),
    /// The connection pool could not be built.
    #[error("cannot build the connection pool")]
    Pool(#[source] deadpool_postgres::BuildError),
    /// The server could not be reached or refused the connection.
    #[error("cannot connect")]
    Connect(#[source] deadpool_postgres::PoolError),
    /// Creating or migrating the schema failed.
    #[error("cannot migrate schema {schema}")]
    Migrate {
        /// The schema.
        schema: String,
        /// What PostgreSQL said.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The schema was migrated by a newer idem.
    #[error("schema {schema} is at version {found}; this idem knows up to {known}")]
    SchemaTooNew {
        /// The schema.
        schema: String,
        /// Its version.
        found: i32,
        /// The newest this build knows.
        known: i32,
    },
    /// An operation failed.
    #[error(transparent)]
    Store(#[from] idem_store::Error),
}

//! `idem explain` (everything the store knows about one record, item or cron slot: the data of its page under
//! `/ui/`) and `idem admin` (the pages' actions from a shell). Both open the store directly, as `idem runs`
//! does; the JSON endpoints under `/v1/admin/` do the same through a running server.

use idem_admin::{Error as AdminError, records, runs};

use crate::error::Error;
use crate::ledger::{Ledger, on_ledger};

/// Where the store is.
#[derive(Debug, clap::Args)]
pub struct StoreArgs {
    /// The store: the one `idem serve --store` or `idem run --store` / `idem once --store` uses (a SQLite file
    /// that a running `idem serve` holds is locked: use its pages or /v1/admin/ then).
    #[arg(long, env = "IDEM_STORE")]
    store: String,
    /// PostgreSQL schema / Redis key prefix.
    #[arg(long, env = "IDEM_NAMESPACE", default_value = "idem")]
    namespace: String,
    /// The idempotency records' key prefix (`idem serve`'s layer writes under `idempotency/`).
    #[arg(long, default_value = idem_tower::DEFAULT_RECORD_PREFIX)]
    record_prefix: String,
}

/// `idem explain`.
#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    #[command(subcommand)]
    what: Explain,
    /// `text` (lines for people) or `json` (the object the /v1/admin/ endpoints answer with).
    #[arg(long, value_enum, default_value_t = Format::Text, global = true)]
    format: Format,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Format {
    Text,
    Json,
}

#[derive(Debug, clap::Subcommand)]
enum Explain {
    /// An idempotency record: KEY is the Idempotency-Key (with --scope, --route), or the record's store key
    /// as the pages show it (`idempotency/anonymous/order-1`).
    Key {
        key: String,
        /// The caller's scope: `anonymous` or the 32 hex digits of its credential's hash.
        #[arg(long, default_value = "anonymous")]
        scope: String,
        /// The webhook route whose record it is.
        #[arg(long)]
        route: Option<String>,
        /// Show the stored body too (at most 64 KiB).
        #[arg(long)]
        body: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// A work item of `idem run --name JOB`.
    Item {
        /// The job's --name.
        #[arg(long)]
        name: String,
        id: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// A slot of `idem once --name JOB`, by its time as `idem once status` shows it.
    Slot {
        /// The job's --name.
        #[arg(long)]
        name: String,
        slot: String,
        #[command(flatten)]
        store: StoreArgs,
    },
}

/// `idem admin`.
#[derive(Debug, clap::Args)]
pub struct AdminArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Release an idempotency record (delete it): the next request with its key executes again.
    Release {
        /// The record's store key, as the pages and `idem explain key` show it.
        store_key: String,
        /// Only if the record is still this generation (the one `idem explain` showed).
        #[arg(long)]
        generation: Option<u64>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Resolve an unknown outcome as taken effect (once the upstream's own records show it did): every retry
    /// with its key is then answered 409 outcome-resolved with the note, and never executed. (If it did not
    /// take effect, release the record instead.)
    Resolve {
        /// The record's store key, as the pages and `idem explain key` show it.
        store_key: String,
        /// What you found, told to every retry (at most 1024 bytes).
        #[arg(long, default_value = "")]
        note: String,
        /// Only if the record is still this generation (the one `idem explain` showed).
        #[arg(long)]
        generation: Option<u64>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Forget a failed or poison item, so the next run of the job retries it (no output file is touched).
    Forget {
        /// The job's --name.
        #[arg(long)]
        name: String,
        id: String,
        #[command(flatten)]
        store: StoreArgs,
    },
}

fn admin_error(e: AdminError) -> Error {
    match e {
        AdminError::NotFound(m) => Error::NotFound(m),
        AdminError::BadRequest(m) => Error::Config(m),
        AdminError::Conflict(m) => Error::PreconditionFailed(m),
        AdminError::Store(e) => Error::Store(e),
        other => Error::Failed(other.to_string()),
    }
}

/// The store, refusing a SQLite file that does not exist (these commands only read or change what is there: a
/// typo must not answer "no record" from a file made for it, nor leave one behind), as `idem once status` does.
async fn open(args: &StoreArgs) -> Result<Ledger, Error> {
    if let Ok(idem_backends::StoreUrl::Sqlite(path)) = idem_backends::StoreUrl::parse(&args.store)
        && !path.exists()
    {
        return Err(Error::NotFound(format!(
            "no store at {}: nothing was written there (or the store is elsewhere: --store)",
            path.display()
        )));
    }
    Ledger::open_existing(&args.store, &args.namespace)
        .await?
        .ok_or_else(|| Error::NotFound(format!("the store has no schema {}", args.namespace)))
}

/// The record's store key from what was given.
fn store_key(prefix: &str, key: &str, scope: &str, route: Option<&str>) -> String {
    if key.starts_with(prefix) {
        return key.to_owned();
    }
    match route {
        Some(r) => format!("{prefix}route/{r}/{scope}/{key}"),
        None => format!("{prefix}{scope}/{key}"),
    }
}

/// Prints what the store knows. Exit 0; 3 when nothing is stored under what was named.
///
/// # Errors
/// [`Error::NotFound`] (exit 3), [`Error::Config`] for a malformed key (2), store errors.
pub async fn explain(args: ExplainArgs) -> Result<i32, Error> {
    let store = match &args.what {
        Explain::Key { store, .. } | Explain::Item { store, .. } | Explain::Slot { store, .. } => store,
    };
    let ledger = open(store).await?;
    let prefix = &store.record_prefix;
    let shown: Result<(serde_json::Value, String), AdminError> = on_ledger!(&ledger, s => match &args.what {
        Explain::Key { key, scope, route, body, .. } => {
            let key = store_key(prefix, key, scope, route.as_deref());
            records::detail(s, prefix, &key, *body).await.map(|d| (json(&d), record_text(&d)))
        }
        Explain::Item { name, id, .. } => runs::item(s, name, id).await.map(|d| (json(&d), item_text(&d))),
        Explain::Slot { name, slot, .. } => {
            idem_admin::cron::slot(s, name, slot).await.map(|v| (json(&v), lines(&json(&v))))
        }
    });
    ledger.close().await;
    let (value, text) = shown.map_err(admin_error)?;
    let out = match args.format {
        Format::Json => format!("{value}\n"),
        Format::Text => text,
    };
    crate::error::out(&out)?;
    Ok(0)
}

fn json<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or_default()
}

/// `name: value` lines of a JSON object's fields, nulls and empty lists left out.
fn lines(v: &serde_json::Value) -> String {
    let mut out = String::new();
    if let Some(map) = v.as_object() {
        for (k, v) in map {
            match v {
                serde_json::Value::Null => {}
                serde_json::Value::Array(a) if a.is_empty() => {}
                serde_json::Value::String(s) => out.push_str(&format!("{k}: {s}\n")),
                other => out.push_str(&format!("{k}: {other}\n")),
            }
        }
    }
    out
}

fn record_text(d: &records::Detail) -> String {
    let mut v = json(d);
    let body = v.as_object_mut().and_then(|m| m.remove("body"));
    let mut out = lines(&v);
    if let Some(serde_json::Value::String(body)) = body {
        out.push_str(&format!("body:\n{body}\n"));
    }
    out
}

fn item_text(d: &runs::ItemDetail) -> String {
    let mut v = json(d);
    let entry = v.as_object_mut().and_then(|m| m.remove("entry")).unwrap_or_default();
    let mut out = lines(&v);
    for line in lines(&entry).lines() {
        out.push_str(&format!("entry.{line}\n"));
    }
    out
}

/// Does the action, logged with the local user as the actor. Exit 0; 3 when there is nothing to act on; 4
/// when the record changed since --generation, its outcome is not unknown (resolve), or the item is not
/// failed or poison.
///
/// # Errors
/// As [`explain`], and [`Error::PreconditionFailed`] (exit 4).
pub async fn admin(args: AdminArgs) -> Result<i32, Error> {
    let store = match &args.action {
        Action::Release { store, .. } | Action::Resolve { store, .. } | Action::Forget { store, .. } => store,
    };
    let ledger = open(store).await?;
    // As `idem once pause` names who asked: $USER, else $LOGNAME, else the user id's account (cron, systemd and
    // root shells often set neither), with the host.
    let actor = format!("cli:{}", idem_runner::once::who());
    let prefix = &store.record_prefix;
    let done = on_ledger!(&ledger, s => match &args.action {
        Action::Release { store_key, generation, .. } => records::release(s, prefix, store_key, *generation, &actor)
            .await
            .map(|()| format!("released {store_key}: the next request with its key executes again\n")),
        Action::Resolve { store_key, note, generation, .. } => {
            records::resolve(s, prefix, store_key, *generation, note, &actor).await.map(|()| {
                format!("resolved {store_key}: a retry with its key is told it took effect, and never executes\n")
            })
        }
        Action::Forget { name, id, .. } => runs::forget(s, name, id, &actor)
            .await
            .map(|()| format!("forgot item {id} of {name}: the next run retries it\n")),
    });
    ledger.close().await;
    crate::error::out(&done.map_err(admin_error)?)?;
    Ok(0)
}

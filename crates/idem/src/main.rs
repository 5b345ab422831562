//! The `idem` command: `serve` the KV API (or proxy an upstream with Idempotency-Key handling), talk to it
//! with `kv`, measure the store with `bench`, derive keys with `key` and send writes with `send`, run work
//! items with `run` (their ledger: `runs`) and cron jobs with `once`, probe an API's Idempotency-Key handling
//! with `check`.

// The doc comments of the argument structs are clap's `--help` text, written for a terminal (`http[s]://`,
// `KEY<TAB>GENERATION`), not rustdoc markup; a binary's docs are not published.
#![allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]

mod bench;
mod check;
mod client;
mod error;
mod explain;
mod key;
mod ledger;
mod once;
mod run;
mod send;
mod serve;
mod tls;

use std::io::IsTerminal;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// idem makes effects happen once on top of deliveries that may repeat: a reverse proxy (serve --upstream) and
/// a client (send, key) that make HTTP writes safe to retry with Idempotency-Key, a runner that does work items
/// (run, runs) and cron jobs (once) once across machines, a probe of any API's Idempotency-Key handling (check),
/// and the versioned key-value store with compare-and-swap beneath them (serve, kv, bench).
#[derive(Debug, Parser)]
#[command(name = "idem", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process; boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the KV API (embedded SQLite by default), or with --upstream a reverse proxy that makes an HTTP
    /// API's POST and PATCH safe to retry with Idempotency-Key.
    Serve(serve::ServeArgs),
    /// Talk to a running server's KV API.
    Kv(client::KvArgs),
    /// Measure durable conditional updates per second against the fsync ceiling.
    Bench(bench::BenchArgs),
    /// Print the deterministic Idempotency-Key of a logical write: PREFIX:ID:HASH of the canonical payload.
    Key(key::KeyArgs),
    /// Send one write with a derived Idempotency-Key, retrying safely (same bytes, same key); prints the body.
    /// Exit 0: a 2xx answer; 1: another final answer (3xx, 4xx, a stored 5xx) or a TLS failure (certificate
    /// refused: nothing sent); 2: bad usage; 5: key reused with
    /// another payload (422) or a conflict; 6: attempts ran out; 7: outcome unknown.
    Send(send::SendArgs),
    /// Run a command over work items: done items are skipped, leases keep runners apart, poison items stop.
    Run(run::RunArgs),
    /// Inspect or trim the ledger of `idem run`.
    Runs(run::RunsArgs),
    /// Run a cron job's current slot once across machines sharing a store (invoke it from cron or a timer on
    /// each, as often as you like); `idem once status` shows the job's slots.
    Once(once::OnceArgs),
    /// Probe any HTTP API's Idempotency-Key handling (replays, concurrent duplicates, key reuse, malformed
    /// keys, scope, errors, expiry) and print a conformance report. Sends real writes: asks first unless
    /// --yes. Exit 0: no probe failed; 1: one did; 2: bad usage or not confirmed (nothing sent).
    Check(check::CheckArgs),
    /// Show everything the store knows about one idempotency record (key), work item (item) or cron slot
    /// (slot), as text or --format json: the data of its page under /ui/. Exit 0; 3: nothing stored there.
    Explain(explain::ExplainArgs),
    /// The operator's actions of the pages under /ui/, from a shell: release a record, resolve an unknown
    /// outcome, forget a failed or poison item. Exit 0; 3: nothing to act on; 4: the record changed or is not
    /// an unknown outcome, or the item is not failed or poison.
    Admin(explain::AdminArgs),
}

fn main() {
    let cli = Cli::parse();
    let default_level = match &cli.command {
        Command::Serve(_) => "info",
        Command::Once(args) => args.log_level(),
        _ => "warn",
    };
    tracing_subscriber::fmt()
        // The platform verifier logs every refused certificate at ERROR, a second line beside the one-line
        // message the clients print for it; lapin logs a refused login, a missing queue or vhost and every
        // failed reconnect at ERROR before idem's own line says the same (IDEM_LOG=lapin=debug shows them).
        .with_env_filter(
            EnvFilter::try_from_env("IDEM_LOG")
                .unwrap_or_else(|_| EnvFilter::new(format!("{default_level},rustls_platform_verifier=off,lapin=off"))),
        )
        .with_writer(std::io::stderr)
        // A log line that cannot be written (standard error closed: `idem run … 2>&1 | head -1`) is dropped:
        // tracing-subscriber would otherwise report it with `eprintln!`, which panics on that same closed pipe.
        .log_internal_errors(false)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            error::sayln!("idem: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve::run(args.resolve()?).await,
            Command::Kv(args) => client::run(args).await,
            Command::Bench(args) => bench::run(args).await,
            Command::Key(args) => key::run(args),
            Command::Send(args) => send::run(args).await,
            // The runner's exit status says how the run ended (documented in `idem run --help`).
            Command::Run(args) => std::process::exit(run::run(args).await?),
            Command::Runs(args) => std::process::exit(run::runs(args).await?),
            // The exit status says what became of the slot (documented in `idem once --help`).
            Command::Once(args) => std::process::exit(once::run(args).await?),
            // The exit status says whether a probe failed (documented in `idem check --help`).
            Command::Check(args) => std::process::exit(check::run(args).await?),
            Command::Explain(args) => std::process::exit(explain::explain(args).await?),
            Command::Admin(args) => std::process::exit(explain::admin(args).await?),
        }
    });
    if let Err(e) = result {
        // A reader that went away (`idem kv list | head -1`: EPIPE on standard output) ended the output, not
        // the command, as for GNU tools: quietly, exit 0.
        if let error::Error::Io(io) = &e
            && io.kind() == std::io::ErrorKind::BrokenPipe
        {
            std::process::exit(0);
        }
        // One write for the whole line: `eprintln!` writes the message and its newline separately, and a server
        // logging to the same terminal could land between them (seen in the README test).
        let line = format!("idem: {}\n", idem_store::error_chain(&e));
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        std::process::exit(e.exit_code());
    }
}

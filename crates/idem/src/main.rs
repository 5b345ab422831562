//! The `idem` command: `serve` the KV API, talk to it with `kv`, measure the store with `bench`.

mod any_store;
mod bench;
mod client;
mod error;
mod run;
mod serve;
mod shared_sqlite;

use std::io::IsTerminal;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// idem makes writes safe to retry: a versioned KV store with compare-and-swap, served over HTTP.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the KV API (embedded SQLite by default).
    Serve(serve::ServeArgs),
    /// Talk to a running server's KV API.
    Kv(client::KvArgs),
    /// Measure durable conditional updates per second against the fsync ceiling.
    Bench(bench::BenchArgs),
    /// Run a command over work items: done items are skipped, leases keep runners apart, poison items stop.
    Run(run::RunArgs),
    /// Inspect or trim the ledger of `idem run`.
    Runs(run::RunsArgs),
}

fn main() {
    let cli = Cli::parse();
    let default_level = if matches!(cli.command, Command::Serve(_)) { "info" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_env("IDEM_LOG").unwrap_or_else(|_| EnvFilter::new(default_level)))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("idem: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve::run(args.resolve()?).await,
            Command::Kv(args) => client::run(args).await,
            Command::Bench(args) => bench::run(args).await,
            // The runner's exit status says how the run ended (documented in `idem run --help`).
            Command::Run(args) => std::process::exit(run::run(args).await?),
            Command::Runs(args) => std::process::exit(run::runs(args).await?),
        }
    });
    if let Err(e) = result {
        let msg = format!("idem: {}", error::chain(&e));
        eprintln!("{msg}");
        std::process::exit(e.exit_code());
    }
}

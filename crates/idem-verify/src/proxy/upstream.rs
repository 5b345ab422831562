//! The upstream of the proxy workload: an HTTP API in the harness that executes `POST /orders` and records
//! every execution durably (one JSON line appended and fsynced before it does anything else), so the checker
//! counts executions from a log that survives whatever happened to the proxy.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::history::{Clock, Micros};

/// One execution, as logged.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Execution {
    /// Its number (unique in the run), returned in the response body.
    pub exec: u64,
    /// The forwarded `Idempotency-Key`.
    pub key: String,
    /// When it started.
    pub start_us: Micros,
    /// The body was a reused-key probe's (another body under a key already answered): it must never execute.
    #[serde(default)]
    pub reused: bool,
}

struct Upstream {
    clock: Clock,
    next: AtomicU64,
    log: Mutex<std::fs::File>,
}

/// The running upstream.
pub struct Running {
    /// `127.0.0.1:PORT`.
    pub addr: std::net::SocketAddr,
    /// The execution log.
    pub log: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts the upstream on a free loopback port, logging to `log`.
///
/// # Errors
/// When the port or the log cannot be opened.
pub async fn start(clock: Clock, log: &Path) -> Result<Running, Error> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| Error::io(format!("opening {}", log.display()), e))?;
    let state = Arc::new(Upstream { clock, next: AtomicU64::new(1), log: Mutex::new(file) });
    let app = Router::new().route("/orders", post(execute)).with_state(state);
    let listener =
        tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| Error::io("binding the upstream", e))?;
    let addr = listener.local_addr().map_err(|e| Error::io("upstream address", e))?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(Running { addr, log: log.to_owned(), task })
}

/// The request body: how long the execution takes, and whether it is a reused-key probe's.
#[derive(Deserialize)]
struct Order {
    delay_ms: u64,
    #[serde(default)]
    reused: bool,
}

async fn execute(State(up): State<Arc<Upstream>>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let (delay, reused) = serde_json::from_slice::<Order>(&body).map(|o| (o.delay_ms, o.reused)).unwrap_or((0, false));
    let exec = up.next.fetch_add(1, Ordering::SeqCst);
    let line = Execution { exec, key: key.clone(), start_us: up.clock.now(), reused };
    let logged = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        let mut file = up.log.lock().unwrap_or_else(|e| e.into_inner());
        let text = serde_json::to_string(&line).map_err(std::io::Error::other)?;
        writeln!(file, "{text}")?;
        file.sync_data()
    })
    .await;
    if !matches!(logged, Ok(Ok(()))) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "cannot log the execution").into_response();
    }
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let body = serde_json::json!({ "exec": exec, "key": key });
    (StatusCode::CREATED, axum::Json(body)).into_response()
}

/// Reads the execution log.
///
/// # Errors
/// When it cannot be read.
pub fn read_log(path: &Path) -> Result<Vec<Execution>, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
}

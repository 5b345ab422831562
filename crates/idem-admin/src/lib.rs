//! The operator's window of idem: pages under `/ui/` and JSON under `/v1/admin/` on the admin listener
//! (the KV listener of a server without an upstream), over the same store the proxy and the runners use.
//!
//! - [`records`]: idempotency records, filtered and cursor-paged; one record; release.
//! - [`runs`]: `idem run`'s jobs and items; one item; forget a failed or poison item.
//! - [`cron`]: `idem once`'s jobs, their recent slots and an SVG timeline.
//! - [`guard`]: the admin token, sessions, CSRF, `Origin` and the security headers.
//!
//! Every list reads the store through [`scan`]: at most [`scan::SCAN_BUDGET`] keys a page, after an opaque
//! cursor, never an offset. The same functions answer the pages, the JSON endpoints and `idem explain`.
//!
//! ```
//! use idem_admin::{Admin, StoreInfo, guard::Guard};
//! use idem_store::MemoryStore;
//!
//! let guard = Guard::new(None, false, false); // no token: the pages are read-only
//! let info = StoreInfo { backend: "memory".into(), namespace: "idem".into() };
//! let router: axum::Router = idem_admin::router(Admin::new(MemoryStore::new(), "idempotency/", guard, info));
//! # drop(router);
//! ```

mod api;
pub mod cron;
mod error;
pub mod guard;
pub mod metrics;
pub mod rates;
pub mod records;
pub mod runs;
pub mod scan;
mod ui;

use std::sync::Arc;

use idem_store::Store;

pub use error::Error;

/// Rows per page of every list.
pub const PAGE: usize = 50;

/// What the overview says about the store.
#[derive(Clone, Debug)]
pub struct StoreInfo {
    /// `sqlite`, `postgres`, `redis`, `memory`, … (never a URL: it may hold a password).
    pub backend: String,
    /// The PostgreSQL schema or Redis key prefix.
    pub namespace: String,
}

/// Renders this process's Prometheus text.
pub type MetricsText = Arc<dyn Fn() -> String + Send + Sync>;

/// Everything the pages and endpoints need.
pub struct Admin<S> {
    pub(crate) store: S,
    pub(crate) prefix: String,
    pub(crate) guard: guard::Guard,
    pub(crate) info: StoreInfo,
    metrics: Option<MetricsText>,
    pub(crate) rates: rates::Rates,
}

impl<S: Store> Admin<S> {
    /// The pages over `store`, whose idempotency records live under `record_prefix` (the layer's
    /// `record_key_prefix`), guarded by `guard`.
    pub fn new(store: S, record_prefix: &str, guard: guard::Guard, info: StoreInfo) -> Self {
        Self { store, prefix: record_prefix.to_owned(), guard, info, metrics: None, rates: rates::Rates::default() }
    }

    /// Where the overview and the routes page read counters from (the server's Prometheus handle).
    pub fn metrics(mut self, render: MetricsText) -> Self {
        // The first sample of the rates: the overview's first look has a rate since now.
        self.rates.observe(std::time::Instant::now(), &metrics::totals(&render()));
        self.metrics = Some(render);
        self
    }

    pub(crate) fn metrics_text(&self) -> String {
        self.metrics.as_ref().map(|m| m()).unwrap_or_default()
    }
}

/// The pages (`/ui/…`) and the JSON endpoints (`/v1/admin/…`), with the security headers on every answer.
pub fn router<S: Store>(admin: Admin<S>) -> axum::Router {
    let admin = Arc::new(admin);
    ui::routes(Arc::clone(&admin)).merge(api::routes(admin)).layer(axum::middleware::from_fn(guard::headers))
}

/// Percent-encodes `s` for a query value (everything but unreserved characters, RFC 3986 §2.3).
pub(crate) fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

//! TLS plumbing shared by idem's listener, clients, proxy and backends, so that each is written once: rustls on
//! the ring provider (no OpenSSL, no aws-lc C build), PEM files read with errors that name the flag and the
//! file, the platform's trust store, a check of a server's own certificate at start-up, and rustls's errors
//! said in words a user can act on.
//!
//! ```no_run
//! # fn demo() -> Result<(), idem_tls::Error> {
//! let path = std::path::Path::new("ca.pem");
//! let roots = idem_tls::read_roots("--cacert", path)?;
//! let config = rustls::ClientConfig::builder_with_provider(idem_tls::provider())
//!     .with_safe_default_protocol_versions()
//!     .map_err(idem_tls::Error::Rustls)?
//!     .with_root_certificates(roots)
//!     .with_no_client_auth();
//! # let _ = config; Ok(()) }
//! ```

mod describe;
mod error;
mod own;
mod pem;
mod provider;

pub use describe::{Hints, describe, rustls_error_in};
pub use error::Error;
pub use own::check_own_certificate;
pub use pem::{Identity, platform_roots, read_certificates, read_private_key, read_roots};
pub use provider::{install_default_provider, provider};

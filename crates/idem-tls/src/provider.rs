//! The one crypto provider of every TLS user in idem: rustls on ring.

use std::sync::Arc;

use rustls::crypto::CryptoProvider;

/// The crypto provider of every TLS connection idem makes or accepts: rustls's ring provider.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes ring rustls's process-wide default provider, once. Libraries that build their own rustls
/// configuration from the process default (reqwest built with `rustls-no-provider`, the redis crate) panic or
/// fail when there is none; a provider the application installed first stays.
pub fn install_default_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // `Err` means a provider is already installed, which is what is wanted.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

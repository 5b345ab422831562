//! The conformance suite on [`MemoryStore`].
#![allow(clippy::unwrap_used)] // tests report failures by panicking

use idem_store::MemoryStore;

idem_store::conformance_tests!(async || Some((MemoryStore::new(), ())));

//! The conformance suite on [`MemoryStore`].

use idem_store::MemoryStore;

idem_store::conformance_tests!(async || Some((MemoryStore::new(), ())));

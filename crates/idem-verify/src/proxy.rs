//! The proxy workload (to come).

use crate::{Error, Options, Summary};

/// Runs the proxy workload.
///
/// # Errors
/// Not yet implemented.
pub async fn run(_opts: &Options) -> Result<Summary, Error> {
    Err(Error::Setup("the proxy workload is not implemented yet".into()))
}

//! The runner workload (to come).

use crate::{Error, Options, Summary};

/// Runs the runner workload.
///
/// # Errors
/// Not yet implemented.
pub async fn run(_opts: &Options) -> Result<Summary, Error> {
    Err(Error::Setup("the runner workload is not implemented yet".into()))
}

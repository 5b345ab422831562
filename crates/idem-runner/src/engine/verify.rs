//! `--verify CMD`: the user's own check of an output, run by `sh` with the path quoted.

use std::path::Path;
use std::process::Stdio;

use super::ctx::Ctx;
use super::step::describe;

/// Quoted for the shell: ids and keys are built from item text, which must never run as code.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// Runs `--check` for an item (`{id}` and `{key}` substituted, quoted; `IDEM_ITEM_ID` and `IDEM_KEY` in its
/// environment): `Ok(true)` when it exited 0 (the item's effect is there), `Ok(false)` when it exited 1 (it is
/// not), `Err` with the ending and standard error for any other ending (the check failed: a missing program,
/// exit 2, a signal) or when `sh` cannot start. Without `--check`, `Ok(true)`.
pub(super) async fn check_cmd<S>(ctx: &Ctx<S>, id: &str, key: &str) -> Result<bool, (String, Vec<u8>)> {
    let Some(script) = &ctx.cfg.check else { return Ok(true) };
    let script = crate::config::expand(script, |word| match word {
        "id" => Some(quote(id)),
        "key" => Some(quote(key)),
        _ => None,
    });
    let out = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(&script)
        .env("IDEM_ITEM_ID", id)
        .env("IDEM_KEY", key)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| ("check: cannot start sh".to_owned(), e.to_string().into_bytes()))?;
    // As `grep`, `test` and `diff` say it: 0 the effect is there, 1 it is not, anything else (2, 126 or 127 for a
    // program not found, a signal) the check itself failed, which must not read as "absent" and run the command.
    match out.status.code() {
        Some(0) => Ok(true),
        Some(1) => Ok(false),
        _ => Err((format!("check {}", describe(out.status)), out.stderr)),
    }
}

/// Runs `--verify` on `path`; `Err` carries the ending and standard error when it refuses.
pub(super) async fn verify_cmd<S>(ctx: &Ctx<S>, path: &Path) -> Result<(), (String, Vec<u8>)> {
    let Some(script) = &ctx.cfg.verify else { return Ok(()) };
    // Quoted for the shell: an output path is built from item text, which must never run as code.
    let quoted = format!("'{}'", path.display().to_string().replace('\'', "'\\''"));
    let script = script.replace("{out}", &quoted);
    let out = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(&script)
        .env("IDEM_OUTPUT", path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| ("verify: cannot start sh".to_owned(), e.to_string().into_bytes()))?;
    if out.status.success() { Ok(()) } else { Err((format!("verify {}", describe(out.status)), out.stderr)) }
}

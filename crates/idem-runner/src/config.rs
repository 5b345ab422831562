use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::error::Error;
use crate::items::{ItemFormat, ItemReader};
use crate::queue_url::QueueUrl;

/// What to do when an item turns poison in this run (the same error fingerprint twice). An item an earlier run
/// found poison is skipped either way: it is a known fact, not a new failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnPoison {
    /// Stop claiming new items; running ones finish; exit with the poison status.
    Halt,
    /// Record it and go on with the other items.
    Skip,
}

/// What makes an item done, decided once from the configuration ([`RunConfig::done_by`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DoneBy {
    /// An output file per item (`--output`): the ledger says done and the file has the recorded SHA-256.
    Output,
    /// No output file; `--check` says whether an item's effect is there, before its command and after it, and
    /// the ledger records it done.
    Check,
    /// No output file and no check: the ledger says done.
    Ledger,
}

/// How progress is shown on standard error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// A progress bar when standard error is a terminal, else a plain line every few seconds.
    Auto,
    /// No progress output (the summary is still printed).
    Off,
}

/// Everything one `idem run` needs. Build with [`RunConfig::new`] and set the rest.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// The items: a regular file (checked whole before anything runs), or a stream read once: `-` (standard
    /// input), a pipe or a FIFO. Not read when [`RunConfig::queue`] is set.
    pub items: PathBuf,
    /// A message queue to take the items from instead ([`QueueUrl`]): one item per message.
    pub queue: Option<QueueUrl>,
    /// With a queue: end once it is drained, instead of waiting for more messages (for cron).
    pub until_empty: bool,
    /// How to read it.
    pub format: ItemFormat,
    /// The JSON field holding each item's id.
    pub id_field: Option<String>,
    /// The job's name in the ledger ([`check_job_name`]); `None`: [`job_id`] of the output template, the
    /// name every job had before names could be given, so their ledgers keep working.
    pub name: Option<String>,
    /// The output path template; `{id}` is replaced by the item's id. Empty: the command's result is not a
    /// file (an email sent, a row inserted): an item is done once its command exited 0 and the ledger recorded
    /// it, and no file is ever looked at ([`RunConfig::has_output`]).
    pub output: String,
    /// The command and its arguments; `{id}`, `{out}` (the temporary path to write) and `{item}` are replaced.
    pub command: Vec<String>,
    /// Commands running at once (at least 1).
    pub jobs: usize,
    /// Retries after the first attempt; attempts include ones whose runner crashed.
    pub retries: u32,
    /// The pause before an item's first retry, doubled for each later one (capped at 5 minutes, or at
    /// this when longer), each drawn between half and all of it; zero: retry at once. Default 1 s.
    pub retry_delay: Duration,
    /// What an item turning poison does to the run.
    pub on_poison: OnPoison,
    /// Top-level fields a JSON output must have.
    pub expect_fields: Vec<String>,
    /// Without an output ([`RunConfig::has_output`]): a shell command saying whether an item's effect is there
    /// (exit 0: done), run before its command (done: the command is skipped and the item recorded done) and
    /// after it (the command's exit 0 counts only if the check then passes too). `{id}`, `{key}`, and
    /// `$IDEM_ITEM_ID`, `$IDEM_KEY` name the item.
    pub check: Option<String>,
    /// A shell command that must exit 0 for an output to count (`{out}` and `$IDEM_OUTPUT` name the file).
    pub verify: Option<String>,
    /// Where to write the JSON report.
    pub report: Option<PathBuf>,
    /// Longest one attempt may run; the child is then killed.
    pub timeout: Option<Duration>,
    /// Lease length (renewed every third of it while the command runs); at least 1 s.
    pub lease: Duration,
    /// How long the ledger store may stay unreachable before the run gives up (at least 1 s; default 5
    /// minutes). Until then the run waits: it claims nothing new, keeps running commands while their leases
    /// last, and records finished items once the store is back. Past it, the run ends with the items it did
    /// not finish not done ([`RunStatus::StoreUnavailable`](crate::RunStatus::StoreUnavailable)).
    pub store_outage_limit: Duration,
    /// List what would run and why, run nothing.
    pub dry_run: bool,
    /// Judge every done item by its output on this machine, wherever it was recorded done (each machine needs
    /// its own copy). Otherwise an item another host recorded done is done here too, counted "done
    /// elsewhere", and its output is verified only on that host.
    pub require_local_output: bool,
    /// Prefix of `IDEM_IDEMPOTENCY_KEY` (see `idem_core::derive_key`); `None`: the job's name when
    /// [`RunConfig::name`] is given (the key is then `IDEM_KEY`), else `run`
    /// ([`RunConfig::idempotency_prefix`]).
    pub key_prefix: Option<String>,
    /// Progress display.
    pub progress: ProgressMode,
}

impl RunConfig {
    /// A configuration with the defaults: 1 job, 3 retries 1 s apart (doubling), halt on poison, 10 s lease, no
    /// timeout, 5 minutes of store outage ridden out.
    pub fn new(items: impl Into<PathBuf>, output: impl Into<String>, command: Vec<String>) -> Self {
        Self {
            items: items.into(),
            queue: None,
            until_empty: false,
            format: ItemFormat::Auto,
            id_field: None,
            name: None,
            output: output.into(),
            command,
            jobs: 1,
            retries: 3,
            retry_delay: Duration::from_secs(1),
            on_poison: OnPoison::Halt,
            expect_fields: Vec::new(),
            verify: None,
            check: None,
            report: None,
            timeout: None,
            lease: Duration::from_secs(10),
            store_outage_limit: Duration::from_secs(300),
            dry_run: false,
            require_local_output: false,
            key_prefix: None,
            progress: ProgressMode::Auto,
        }
    }

    /// Refuses settings that cannot work, including a command whose program cannot be found (a path that is
    /// not an executable file, or a bare name not in `PATH`), unless it is a dry run.
    ///
    /// # Errors
    /// [`Error::Config`] naming the problem.
    pub fn check(&self) -> Result<(), Error> {
        self.check_settings().map(|_| ())
    }

    /// [`RunConfig::check`], returning the program found in `PATH` (see [`CheckedConfig::program`]).
    fn check_settings(&self) -> Result<Option<PathBuf>, Error> {
        if let Some(name) = &self.name {
            check_job_name(name)?;
        }
        if !self.has_output() && self.name.is_none() {
            // The default name is the output template's hash: every job without one would share one ledger.
            return Err(Error::Config(
                "without --output, give the job a --name (it names the job in the ledger)".into(),
            ));
        }
        if !self.has_output() {
            // Each names the output file, which there is none of: refused rather than given an empty path.
            if self.command.iter().any(|a| a.contains("{out}")) {
                return Err(Error::Config("{out} in the command needs --output (where the output goes)".into()));
            }
            if self.require_local_output {
                return Err(Error::Config(
                    "--require-local-output judges done items by their output files: it needs --output".into(),
                ));
            }
            if self.verify.is_some() || !self.expect_fields.is_empty() {
                return Err(Error::Config("--verify and --expect-fields check an output: they need --output".into()));
            }
        } else if self.check.is_some() {
            return Err(Error::Config(
                "--check says whether an item's effect is there, for a job without --output (with one, done is the \
                 output's digest; --verify checks it)"
                    .into(),
            ));
        } else if !self.output.contains("{id}") {
            return Err(Error::Config(format!("--output {:?} must contain {{id}}", self.output)));
        }
        for arg in &self.command {
            refuse_unknown_placeholders(arg, "the command", &["id", "out", "key", "item"])?;
        }
        if let Some(check) = &self.check {
            refuse_unknown_placeholders(check, "--check", &["id", "key"])?;
        }
        if self.output.ends_with('/') {
            return Err(Error::Config(format!("--output {:?} must name a file", self.output)));
        }
        if self.command.is_empty() {
            return Err(Error::Config("no command given after --".into()));
        }
        if self.jobs == 0 {
            return Err(Error::Config("--jobs must be at least 1".into()));
        }
        if self.lease < Duration::from_secs(1) {
            return Err(Error::Config("--lease must be at least 1s".into()));
        }
        if self.store_outage_limit < Duration::from_secs(1) {
            return Err(Error::Config("--store-outage-limit must be at least 1s".into()));
        }
        if self.format == ItemFormat::Lines && self.id_field.is_some() {
            return Err(Error::Config("--id-field needs JSON Lines items, not --format lines".into()));
        }
        if self.queue.is_some() && self.dry_run {
            // A dry run must change nothing, and taking a message and handing it back is a change (its
            // delivery count, its place in the queue), over and over.
            return Err(Error::Config("--dry-run reads a file or a pipe, not a queue".into()));
        }
        if self.until_empty && self.queue.is_none() {
            return Err(Error::Config("--until-empty needs --items amqp://… or nats://… (a queue)".into()));
        }
        if let Some(prefix) = &self.key_prefix
            && (prefix.is_empty() || prefix.contains(':'))
        {
            return Err(Error::Config("--key-prefix must be non-empty and without ':'".into()));
        }
        if let Some(report) = &self.report {
            // Created only once the run starts, after the ledger: a report that cannot be created must be
            // refused here, or the refused run would leave a ledger behind.
            let dir = report.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
            if report.is_dir() {
                return Err(Error::Config(format!("--report {} is a directory; name a file", report.display())));
            }
            if !dir.is_dir() {
                return Err(Error::Config(format!(
                    "--report {}: no directory {} to write it in; create it first",
                    report.display(),
                    dir.display()
                )));
            }
        }
        if self.dry_run {
            return Ok(None);
        }
        crate::supervise::check_program(&self.command[0])
    }

    /// [`RunConfig::check`], then every item of the file: readable, with an id, and with an output path no
    /// other item has. Reads the whole items file (blocking I/O) and writes nothing, so a caller can refuse a
    /// run before it opens or creates a ledger.
    ///
    /// # Errors
    /// [`Error::Config`], [`Error::ReadItems`], [`Error::BadItem`], [`Error::DuplicateOutput`].
    pub fn checked(mut self) -> Result<CheckedConfig, Error> {
        let program = self.check_settings()?;
        let total = precheck(&self)?;
        if !self.dry_run {
            self.jobs = crate::supervise::jobs_within_descriptor_limit(self.jobs);
        }
        Ok(CheckedConfig { cfg: self, total, program, source: None })
    }

    /// How this run reads its queue: at most twice `--jobs` messages taken ahead (`--jobs` commands running
    /// and as many claimed ahead, as with a file).
    pub(crate) fn source_config(&self) -> crate::queue::SourceConfig {
        crate::queue::SourceConfig {
            prefetch: self.jobs.saturating_mul(2),
            until_empty: self.until_empty,
            format: self.format,
            id_field: self.id_field.clone(),
        }
    }

    /// True when the items are read once as they come (a stream or a queue), not checked whole before the run.
    pub fn streamed(&self) -> bool {
        self.queue.is_some() || crate::items::is_stream(&self.items)
    }

    /// The job's name in the ledger: `--name`, else [`job_id`] of the output template.
    pub fn job(&self) -> String {
        self.name.clone().unwrap_or_else(|| job_id(&self.output))
    }

    /// The prefix of `IDEM_IDEMPOTENCY_KEY`: `--key-prefix` when given; else the job's name for a named job, so
    /// two named jobs sending through one idempotency proxy never share keys (the key is then `IDEM_KEY`);
    /// else `run`, the prefix every unnamed job had, so the keys of existing jobs do not change.
    pub fn idempotency_prefix(&self) -> &str {
        match (&self.key_prefix, &self.name) {
            (Some(prefix), _) => prefix,
            (None, Some(name)) => name,
            (None, None) => "run",
        }
    }

    /// True when the job writes an output file per item ([`RunConfig::output`] is not empty).
    pub fn has_output(&self) -> bool {
        self.done_by() == DoneBy::Output
    }

    /// What makes an item of this job done: its output file when [`RunConfig::output`] is not empty, else
    /// `--check` when given, else the ledger alone.
    pub fn done_by(&self) -> DoneBy {
        match (self.output.is_empty(), &self.check) {
            (false, _) => DoneBy::Output,
            (true, Some(_)) => DoneBy::Check,
            (true, None) => DoneBy::Ledger,
        }
    }

    /// The output path of item `id` when the job has output files ([`DoneBy::Output`]); `None` otherwise, so no
    /// file is ever looked at for it.
    pub(crate) fn output_of(&self, id: &str) -> Option<PathBuf> {
        (self.done_by() == DoneBy::Output).then(|| self.output_path(id))
    }

    /// What no two items of one run may share: the output path, or without outputs the id (two items with one
    /// id share one ledger entry).
    pub(crate) fn unique_path(&self, id: &str) -> PathBuf {
        self.output_of(id).unwrap_or_else(|| PathBuf::from(id))
    }

    /// The output path of item `id`.
    pub fn output_path(&self, id: &str) -> PathBuf {
        PathBuf::from(self.output.replace("{id}", id))
    }
}

/// A [`RunConfig`] whose settings and items passed [`RunConfig::checked`], for
/// [`run_checked`](crate::run_checked).
#[derive(Debug)]
pub struct CheckedConfig {
    pub(crate) cfg: RunConfig,
    pub(crate) total: u64,
    /// The command's program as found in `PATH` by the check, the run's one lookup: spawned by this path, with
    /// its typed name as argv[0]. `None` for a path, a name with a placeholder, a `PATH` the lookup cannot
    /// read, or a dry run (each spawn then looks it up as usual).
    pub(crate) program: Option<PathBuf>,
    /// The queue, connected and consuming ([`CheckedConfig::connect`]); `None` for a file or a pipe, or when
    /// the run connects it itself.
    pub(crate) source: Option<crate::queue::Source>,
}

impl CheckedConfig {
    /// Connects to the queue of a queue run (for a file or a pipe: nothing), so that a broker that cannot be
    /// reached, refuses the login or has no such queue refuses the run before the caller opens or creates a
    /// ledger. The run then consumes on this connection.
    ///
    /// # Errors
    /// [`Error::Queue`].
    pub async fn connect(&mut self) -> Result<(), Error> {
        if let (Some(url), None) = (&self.cfg.queue, &self.source) {
            self.source = Some(crate::queue::Source::connect(url, self.cfg.source_config()).await?);
        }
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &RunConfig {
        &self.cfg
    }

    /// How many items the file held when it was checked (0 for a stream or a queue: not known before).
    pub fn items(&self) -> u64 {
        self.total
    }
}

/// The length of the placeholder-like word at the start of `rest` (ASCII letters, digits and `_`; 0 for none).
fn word_len(rest: &[u8]) -> usize {
    rest.iter().take_while(|b| b.is_ascii_alphanumeric() || **b == b'_').count()
}

/// The length of an escape at the start of `rest`: `{{WORD}}` (WORD placeholder-like, or empty), which stands
/// for the literal `{WORD}`; `None` when `rest` does not start with one.
fn escape_len(rest: &[u8]) -> Option<usize> {
    let inner = rest.strip_prefix(b"{{")?;
    let n = word_len(inner);
    inner[n..].starts_with(b"}}").then_some(n + 4)
}

/// `text` with each placeholder `{WORD}` that `lookup` knows replaced by its value and each escape
/// `{{WORD}}` by the literal `{WORD}` (`{{}}` is `{}`, `{{id}}` is `{id}`); everything else as it is (`{print
/// $1}`, `${HOME}`, `{"a": 1}`, a lone `}}`). One pass: a value is never expanded again.
pub(crate) fn expand(text: &str, lookup: impl Fn(&str) -> Option<String>) -> String {
    if !text.contains('{') {
        return text.to_owned();
    }
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if let Some(n) = escape_len(&bytes[i..]) {
            out.push_str(&text[i + 1..i + n - 1]);
            i += n;
            continue;
        }
        if bytes[i] == b'{' {
            let n = word_len(&bytes[i + 1..]);
            if bytes.get(i + 1 + n) == Some(&b'}')
                && let Some(value) = lookup(&text[i + 1..i + 1 + n])
            {
                out.push_str(&value);
                i += n + 2;
                continue;
            }
        }
        // Copy up to the next brace: `i` is on a char boundary (a brace, which is ASCII, or where a copy ended).
        let start = if bytes[i] == b'{' { i + 1 } else { i };
        let next = text[start..].find('{').map_or(text.len(), |j| start + j);
        out.push_str(&text[i..next]);
        i = next;
    }
    out
}

/// Refuses a placeholder-like word in `text` that is not one of `valid` (`{ky}`, `{}`, `{item}` in `--check`):
/// it would otherwise reach the command literally, and a typo in `{key}` would send every item with one key.
/// A placeholder-like word is `{` then only ASCII letters, digits and `_` (none too), then `}`, not right after
/// `$`: `${HOME}` is the shell's, and `{print $1}`, `{"a": 1}` and `{a,b}` are not placeholders. An escape
/// `{{WORD}}` is the literal `{WORD}` ([`expand`]), never refused: the way to pass `{}` or an awk program
/// `{print}`, which the refusal names.
///
/// # Errors
/// [`Error::Config`] naming the word, where it was (`what`), the valid ones and the escape.
fn refuse_unknown_placeholders(text: &str, what: &str, valid: &[&str]) -> Result<(), Error> {
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(j) = text[i..].find('{') {
        let open = i + j;
        if let Some(n) = escape_len(&bytes[open..]) {
            i = open + n;
            continue;
        }
        i = open + 1;
        if open > 0 && bytes[open - 1] == b'$' {
            continue;
        }
        let close = open + 1 + word_len(&bytes[open + 1..]);
        if bytes.get(close) != Some(&b'}') {
            continue;
        }
        let word = &text[open + 1..close];
        if !valid.contains(&word) {
            let listed: Vec<String> = valid.iter().map(|v| format!("{{{v}}}")).collect();
            let hint = if word.is_empty() { " (GNU parallel's {} is {item} or {id} here)" } else { "" };
            return Err(Error::Config(format!(
                "unknown placeholder {{{word}}} in {what}{hint}; {what} takes {}; for a literal {{{word}}} (an awk \
                 or jq program, say) double its braces: {{{{{word}}}}}",
                listed.join(", ")
            )));
        }
    }
    Ok(())
}

/// Checks every item of a regular file (ids, duplicate outputs) before anything runs; returns how many there
/// are. A stream or a queue can be read only once: its items are checked as they arrive.
///
/// Each output path is kept as 128 bits of its SHA-256 in one vector, sorted once the file is read: 16 bytes
/// per item (16 MiB for a million lines), where a hash map of them took 50 to 75 MiB while it grew. Only when
/// two items share a path is the file read again, to name the first repeated line and the line it repeats; a
/// file that changed between the two readings is refused too.
fn precheck(cfg: &RunConfig) -> Result<u64, Error> {
    if cfg.streamed() {
        return Ok(0);
    }
    precheck_readings(cfg, || ItemReader::open(&cfg.items, cfg.format, cfg.id_field.as_deref()))
}

/// [`precheck`] over the readings `open` makes of the items file (a test changes the file between them).
fn precheck_readings(cfg: &RunConfig, mut open: impl FnMut() -> Result<ItemReader, Error>) -> Result<u64, Error> {
    let mut keys: Vec<u128> = Vec::new();
    for item in open()? {
        keys.push(path_key(&cfg.unique_path(&item?.id)));
    }
    let total = keys.len() as u64;
    keys.sort_unstable();
    let repeated: HashSet<u128> = keys.windows(2).filter(|w| w[0] == w[1]).map(|w| w[0]).collect();
    if repeated.is_empty() {
        return Ok(total);
    }
    drop(keys);
    let mut first_lines: HashMap<u128, u64> = HashMap::with_capacity(repeated.len());
    for item in open()? {
        let item = item?;
        let output = cfg.unique_path(&item.id);
        let key = path_key(&output);
        if !repeated.contains(&key) {
            continue;
        }
        if let Some(&first) = first_lines.get(&key) {
            return Err(Error::DuplicateOutput {
                path: cfg.items.clone(),
                first,
                second: item.line,
                output: output.display().to_string(),
            });
        }
        first_lines.insert(key, item.line);
    }
    // The first reading found a repeat the second did not: the file changed between them. Neither reading can
    // be trusted to hold what the run will read, and a repeat let through would overwrite an output.
    Err(Error::Config(format!(
        "{}: the file changed while it was checked for two items with one output path; nothing ran: run again \
         once it stays as it is",
        cfg.items.display()
    )))
}

/// 128 bits of the SHA-256 of an output path: two paths of a million colliding by chance is far less likely
/// than a disk error.
fn path_key(output: &Path) -> u128 {
    let digest = Sha256::digest(output.as_os_str().as_encoded_bytes());
    let mut key = [0u8; 16];
    key.copy_from_slice(&digest[..16]);
    u128::from_le_bytes(key)
}

/// The job's name in the ledger: the first 12 hex digits of the SHA-256 of the output template, so two jobs
/// writing different outputs never share ledger entries, and the same job finds its entries on every rerun.
/// The template is normalised first (`./out//{id}.json` is `out/{id}.json`), so two spellings of one job share
/// its leases. It is not made absolute: runners on several machines share a job by its relative template.
pub fn job_id(output_template: &str) -> String {
    let normalised: PathBuf =
        Path::new(output_template).components().filter(|c| !matches!(c, std::path::Component::CurDir)).collect();
    let digest = Sha256::digest(normalised.to_string_lossy().as_bytes());
    hex::encode(&digest[..6])
}

/// Refuses a job name `idem once --name` would refuse (one rule for both: 1 to 100 ASCII letters, digits, `.`,
/// `_` and `-`, not starting with `.` or `-`): it is part of the ledger's keys (`run/NAME/item/ID`) and the
/// first part of `IDEM_KEY` (`NAME:ID:HASH`), where `/` and `:` would be ambiguous.
///
/// # Errors
/// [`Error::Config`] naming the rule.
pub fn check_job_name(name: &str) -> Result<(), Error> {
    check_name(name)
}

/// A job name is 1 to 100 characters of ASCII letters, digits, `.`, `_` and `-`, not starting with `.` or
/// `-`: it is part of store keys and of the messages cron mails.
///
/// # Errors
/// [`Error::Config`] naming the rule.
pub fn check_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && !name.starts_with(['.', '-'])
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "--name {name:?}: use 1 to 100 ASCII letters, digits, '.', '_' and '-', not starting with '.' or '-'"
        )))
    }
}

/// The directory all of a template's outputs share: its path up to the first component holding a
/// placeholder (`out/{id}.json` → `out`, `{id}.json` → `.`).
pub fn output_root(output_template: &str) -> PathBuf {
    let mut root = PathBuf::new();
    for part in Path::new(output_template).components() {
        if part.as_os_str().to_string_lossy().contains('{') {
            break;
        }
        root.push(part);
    }
    if root.as_os_str().is_empty() { PathBuf::from(".") } else { root }
}

/// The default ledger of a template: `<output root>/.idem/ledger.db`, next to the outputs it describes.
pub fn default_ledger_path(output_template: &str) -> PathBuf {
    output_root(output_template).join(".idem").join("ledger.db")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first repeated line in file order is named with the line it repeats, whichever paths repeat: the
    /// sorted check finds that a path repeats, the second reading names the lines.
    #[test]
    fn the_first_repeated_output_is_named_with_the_line_it_repeats() {
        let dir = tempfile::tempdir().expect("tempdir");
        let items = dir.path().join("items.txt");
        std::fs::write(&items, "a\nb\nc\nb\na\nd\n").expect("write items");
        let cfg = RunConfig::new(&items, "out/{id}.txt", vec!["true".into()]);
        let err = precheck(&cfg).expect_err("b and a repeat").to_string();
        assert!(err.ends_with(": lines 2 and 4 both write out/b.txt"), "{err}");
        std::fs::write(&items, "a\nb\nc\n").expect("write items");
        assert_eq!(precheck(&cfg).expect("no path repeats"), 3);
    }

    /// A file whose first reading repeats one path and whose second repeats another (it changed between them)
    /// is refused: neither reading says what the run will read.
    #[test]
    fn a_file_that_changed_between_its_two_readings_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let items = dir.path().join("items.txt");
        std::fs::write(&items, "a\nb\na\n").expect("write items");
        let cfg = RunConfig::new(&items, "out/{id}.txt", vec!["true".into()]);
        let mut readings = 0;
        let err = precheck_readings(&cfg, || {
            readings += 1;
            if readings == 2 {
                std::fs::write(&items, "a\nb\nb\n").expect("rewrite items");
            }
            ItemReader::open(&cfg.items, cfg.format, None)
        })
        .expect_err("a repeat in both versions")
        .to_string();
        assert!(err.contains("the file changed while it was checked"), "{err}");
    }

    #[test]
    fn only_known_placeholders_pass() {
        let valid = ["id", "key"];
        for ok in ["{id}-{key}", "${HOME}/{id}", "awk '{print $1}'", "{\"a\": 1}", "{a,b}", "{1..3}", "{", "}{", "a{b"]
        {
            assert!(refuse_unknown_placeholders(ok, "--check", &valid).is_ok(), "{ok}");
        }
        for (bad, word) in [("{ky}", "{ky}"), ("x {} y", "{}"), ("{id} {item}", "{item}"), ("{ID}", "{ID}")] {
            let err = refuse_unknown_placeholders(bad, "--check", &valid).expect_err(bad).to_string();
            assert!(err.contains(&format!("unknown placeholder {word} in --check")), "{err}");
            assert!(err.contains("--check takes {id}, {key}"), "{err}");
            let escaped = format!("{{{word}}}");
            assert!(err.contains(&format!("double its braces: {escaped}")), "{err}");
        }
        // Escapes are never refused, whatever their word.
        for ok in ["{{}}", "{{item}}", "awk '{{print}}'", "{{id}} {id}"] {
            assert!(refuse_unknown_placeholders(ok, "--check", &valid).is_ok(), "{ok}");
        }
    }

    #[test]
    fn expand_replaces_known_words_and_unescapes_doubled_braces() {
        let lookup = |w: &str| match w {
            "id" => Some("7".to_owned()),
            "item" => Some("{id}".to_owned()),
            _ => None,
        };
        for (text, want) in [
            ("{id}", "7"),
            ("{{}}", "{}"),
            ("{{id}}", "{id}"),
            ("x{{id}}y{id}", "x{id}y7"),
            ("{item}", "{id}"),
            ("awk '{print $1}'", "awk '{print $1}'"),
            ("awk '{{print}}'", "awk '{print}'"),
            ("{if(x){print}}", "{if(x){print}}"),
            ("${HOME}/{id}", "${HOME}/7"),
            ("{{", "{{"),
            ("é{id}é", "é7é"),
            ("{nope}", "{nope}"),
        ] {
            assert_eq!(expand(text, lookup), want, "{text}");
        }
    }

    #[test]
    fn ledger_sits_next_to_the_outputs() {
        assert_eq!(default_ledger_path("out/{id}.json"), PathBuf::from("out/.idem/ledger.db"));
        assert_eq!(default_ledger_path("a/b/{id}/r.json"), PathBuf::from("a/b/.idem/ledger.db"));
        assert_eq!(default_ledger_path("{id}.json"), PathBuf::from("./.idem/ledger.db"));
        assert_ne!(job_id("out/{id}.json"), job_id("out/{id}.txt"));
        assert_eq!(job_id("out/{id}.json"), job_id("./out//{id}.json"));
        assert_eq!(job_id("x").len(), 12);
    }
}

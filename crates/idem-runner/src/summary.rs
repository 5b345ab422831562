//! What a run did ([`Summary`]), how it ended ([`RunStatus`]), and the one-screen text printed at its end.

use std::time::Duration;

use crate::shown::count;

/// How a run ended, in order of precedence; [`RunStatus::exit_code`] is the process exit status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunStatus {
    /// Every item is done (or, for a dry run, the listing finished).
    AllDone,
    /// Some item is not done: it failed every attempt, or the ledger failed.
    Failed,
    /// A poison item stopped the run, or was skipped.
    Poison,
    /// Ctrl-C (or SIGTERM) stopped the run before every item was done.
    Interrupted,
    /// The ledger store was unavailable for longer than `--store-outage-limit`: the run ended with items not
    /// done (none of them failed for it); a rerun once the store is back finishes them.
    StoreUnavailable,
    /// A stream held a bad item (malformed, or a repeated output path): the items before it ran, nothing
    /// after it was read.
    Refused,
}

impl RunStatus {
    /// 0 all done, 1 failures, 2 a bad item in a stream (bad usage), 3 poison, 75 the store unavailable for too
    /// long (`EX_TEMPFAIL` of sysexits.h: try again later), 130 interrupted.
    pub fn exit_code(self) -> i32 {
        match self {
            RunStatus::Refused => 2,
            RunStatus::AllDone => 0,
            RunStatus::Failed => 1,
            RunStatus::Poison => 3,
            RunStatus::Interrupted => 130,
            RunStatus::StoreUnavailable => 75,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Items in the file (a stream: lines read; a queue: messages taken, redeliveries included).
    pub total: u64,
    /// Items this run executed to done.
    pub done: u64,
    /// Items skipped because the ledger says done and the output still matches.
    pub skipped: u64,
    /// Items whose verified output was found in place without a ledger entry and recorded as done.
    pub adopted: u64,
    /// Items another host recorded done (their outputs are on that host; not checked here).
    pub done_elsewhere: u64,
    /// [`Summary::done_elsewhere`] by the host that recorded them.
    pub elsewhere: std::collections::BTreeMap<String, u64>,
    /// Items that used every attempt without succeeding (or whose ledger writes failed).
    pub failed: u64,
    /// The items among `failed` that used every attempt they were allowed.
    pub out_of_attempts: OutOfAttempts,
    /// Poison items: id and error, by id in natural order ([`natural_cmp`](crate::natural_cmp)).
    pub poison: Vec<(String, String)>,
    /// Items not started or given up because of a stop request or a poison halt.
    pub not_done: u64,
    /// An item turned poison in this run and `--on-poison halt` stopped it from starting anything new.
    pub halted: bool,
    /// Commands executed (attempts started by this run).
    pub executions: u64,
    /// Times a command was stopped (SIGSTOP to its process group) because no renewal of its lease had been
    /// accepted a margin before the lease would lapse (the store unavailable or slow, or this runner paused).
    pub stopped: u64,
    /// Items a dry run would execute.
    pub would_run: u64,
    /// A stop was requested.
    pub interrupted: bool,
    /// The ledger store was unavailable for longer than `--store-outage-limit`, which ended the run.
    pub store_unavailable: bool,
    /// A stop ended the reading of a stream before its end (its writer had not closed it, or items read were
    /// left): more items may have followed, so the run is interrupted even when every item read is done.
    pub stream_cut: bool,
    /// Was this a dry run.
    pub dry_run: bool,
    /// Wall time.
    pub elapsed: Duration,
    /// The run's `--retries`.
    pub retries: u32,
    /// The run's output template, which names the job when [`Summary::name`] does not (`idem runs forget
    /// --output`).
    pub output: String,
    /// The job's `--name`, if given (`idem runs forget --name`).
    pub name: Option<String>,
    /// Why a stream's reading ended early: a malformed item or a repeated output path, one line.
    pub refused: Option<String>,
    /// The items came from a queue: a message that ended failed or poison was rejected (dead-lettered or
    /// dropped), so no rerun sees it again until it is published again.
    pub queue: bool,
}

/// Items out of attempts: each used every attempt it was allowed (`--retries` + 1 in all, counted across runs),
/// or more, when an earlier run allowed more.
#[derive(Clone, Debug, Default)]
pub struct OutOfAttempts {
    /// How many.
    pub count: u64,
    /// The most attempts one of them used: a rerun with `--retries` this high gives each at least one more.
    pub most_attempts: u32,
    /// The first [`OutOfAttempts::SHOWN`] of them in the items file, in its order.
    pub first: Vec<FailedItem>,
}

/// An item out of attempts, as the summary names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedItem {
    /// Its 1-based line in the items file.
    pub line: u64,
    /// Its id.
    pub id: String,
    /// The attempts it used, counted across runs.
    pub attempts: u32,
    /// The last attempt's error.
    pub error: String,
}

impl OutOfAttempts {
    /// How many of them [`OutOfAttempts::first`] keeps (the report has them all).
    pub const SHOWN: usize = 10;

    pub(super) fn add(&mut self, item: FailedItem) {
        self.count += 1;
        self.most_attempts = self.most_attempts.max(item.attempts);
        // Items end in whatever order their commands finish; kept by line, the summary reads the same every run.
        let at = self.first.partition_point(|f| f.line < item.line);
        if at < Self::SHOWN {
            self.first.insert(at, item);
            self.first.truncate(Self::SHOWN);
        }
    }
}

impl Summary {
    /// How the run ended.
    pub fn status(&self) -> RunStatus {
        if self.refused.is_some() {
            RunStatus::Refused
        } else if self.interrupted && (self.stream_cut || self.not_done > 0 || self.finished() < self.total) {
            RunStatus::Interrupted
        } else if self.store_unavailable && (self.not_done > 0 || self.finished() < self.total) {
            RunStatus::StoreUnavailable
        } else if !self.poison.is_empty() {
            RunStatus::Poison
        } else if self.dry_run {
            RunStatus::AllDone
        } else if self.failed > 0 || self.not_done > 0 || self.finished() < self.total {
            RunStatus::Failed
        } else {
            RunStatus::AllDone
        }
    }

    /// Items done by the end of the run: now, before, adopted, or on another host.
    fn finished(&self) -> u64 {
        self.done + self.skipped + self.adopted + self.done_elsewhere
    }

    /// The hosts that recorded items done elsewhere, with counts: `b: 3, c: 1`.
    fn elsewhere_hosts(&self) -> String {
        let mut hosts: Vec<_> = self.elsewhere.iter().collect();
        hosts.sort_by(|a, b| crate::shown::natural_cmp(a.0, b.0));
        hosts.iter().map(|(h, n)| format!("{h}: {n}")).collect::<Vec<_>>().join(", ")
    }

    /// `idem runs forget` for this job and `ids` (all of them when `complete`, else the placeholder), quoted
    /// for a POSIX shell.
    fn forget_command<'a>(&self, ids: impl Iterator<Item = &'a str>, complete: bool) -> String {
        let quote = |w: &str| shlex::try_quote(w).map(|q| q.into_owned());
        let ids: Result<Vec<String>, _> = if complete { ids.map(quote).collect() } else { Ok(Vec::new()) };
        let ids = match ids {
            Ok(ids) if !ids.is_empty() => ids.join(" "),
            // Too many to list, or one no shell word can carry (a NUL): the ids are in the report.
            _ => "ID…".to_owned(),
        };
        if let Some(name) = &self.name {
            // Names are plain words: no quoting needed.
            return format!("idem runs forget --name {name} {ids}");
        }
        let output = quote(&self.output).unwrap_or_else(|_| "…".to_owned());
        format!("idem runs forget --output {output} {ids}")
    }

    /// The one-screen summary printed at the end.
    pub fn render(&self) -> String {
        let mut s = String::new();
        if self.dry_run {
            s.push_str(&format!(
                "dry run: {}, {} would run, {} would be adopted, {} done, {} poison, {} out of attempts\n",
                count(self.total, "item", "items"),
                self.would_run,
                self.adopted,
                self.skipped + self.done_elsewhere,
                self.poison.len(),
                self.failed
            ));
            return s;
        }
        self.headline(&mut s);
        self.stopped_and_elsewhere(&mut s);
        self.out_of_attempts_lines(&mut s);
        self.poison_lines(&mut s);
        self.why_not_done(&mut s);
        let status = self.status();
        s.push_str(&format!(
            "exit status {} ({})\n",
            status.exit_code(),
            match status {
                RunStatus::AllDone => "every item done",
                RunStatus::Failed => "some items failed",
                RunStatus::Poison => "poison items",
                RunStatus::Interrupted => "interrupted",
                RunStatus::StoreUnavailable => "the ledger store unavailable for too long",
                RunStatus::Refused => "a bad item in the stream",
            }
        ));
        s
    }

    /// The first line: the counts, or that there was nothing to do.
    fn headline(&self, s: &mut String) {
        let secs = self.elapsed.as_secs_f64();
        if self.queue && self.total == 0 {
            s.push_str("nothing to do: the queue was empty\n");
        } else if self.executions == 0 && self.finished() == self.total {
            let elsewhere = if self.done_elsewhere > 0 {
                format!(", {} done elsewhere", self.done_elsewhere)
            } else {
                String::new()
            };
            let all = if self.total == 1 { "1 item".to_owned() } else { format!("all {} items", self.total) };
            s.push_str(&format!(
                "nothing to do: {all} already done ({} adopted{elsewhere}), ran 0 commands\n",
                self.adopted
            ));
        } else {
            // Said once: after "nothing to do" the counts would only repeat it. Every item is in one count, so
            // they add up to the total (done elsewhere only when there are some, as the line below it says).
            let elsewhere = if self.done_elsewhere > 0 {
                format!("{} done elsewhere, ", self.done_elsewhere)
            } else {
                String::new()
            };
            s.push_str(&format!(
                "{} in {:.1}s: {} done now, {} already done, {} adopted, {elsewhere}{} failed, {} poison, {} not \
                 done; {} ran\n",
                count(self.total, "item", "items"),
                secs,
                self.done,
                self.skipped,
                self.adopted,
                self.failed,
                self.poison.len(),
                self.not_done,
                count(self.executions, "command", "commands")
            ));
        }
    }

    /// Commands stopped for their lease, and items done by another host.
    fn stopped_and_elsewhere(&self, s: &mut String) {
        if self.stopped > 0 {
            s.push_str(&format!(
                "commands stopped for their lease: {} (no renewal accepted in time; each went on once one was, or \
                 was killed if another runner took its item over)\n",
                self.stopped
            ));
        }
        if self.done_elsewhere > 0 && self.output.is_empty() {
            // No output file: nothing to check anywhere, and --require-local-output is refused for such jobs.
            s.push_str(&format!(
                "{} done elsewhere ({}): recorded done by another host; not run here\n",
                self.done_elsewhere,
                self.elsewhere_hosts()
            ));
        } else if self.done_elsewhere > 0 {
            s.push_str(&format!(
                "{} done elsewhere ({}): recorded done by another host, whose outputs are there (not checked \
                 here; --require-local-output runs them here too)\n",
                self.done_elsewhere,
                self.elsewhere_hosts()
            ));
        }
    }

    /// The items out of attempts, the first few by name, and how to run them again.
    fn out_of_attempts_lines(&self, s: &mut String) {
        let failed = &self.out_of_attempts;
        for FailedItem { id, attempts, error, .. } in &failed.first {
            s.push_str(&format!("failed item {id} after {}: {error}\n", count(*attempts, "attempt", "attempts")));
        }
        let unshown = failed.count.saturating_sub(failed.first.len() as u64);
        if unshown > 0 {
            s.push_str(&format!(
                "… and {} out of attempts (see --report)\n",
                count(unshown, "more item", "more items")
            ));
        }
        if failed.count > 0 && self.queue {
            // Their messages were rejected: neither a rerun nor a forget alone brings them back.
            s.push_str(&format!(
                "{} out of attempts (--retries {} allows {} in all, counted across runs); their messages \
                 were rejected without requeue (to the dead-letter exchange, or dropped; JetStream: terminated): \
                 to run them again, `{}`, then publish the messages again (e.g. move them from the dead-letter \
                 queue)\n",
                count(failed.count, "item", "items"),
                self.retries,
                self.retries.saturating_add(1),
                self.forget_command(failed.first.iter().map(|f| f.id.as_str()), unshown == 0)
            ));
        } else if failed.count > 0 {
            // Attempts are counted across runs and the limit is the current run's: raising it is what gives
            // more (the smallest value that gives every one of them another), forgetting starts from zero.
            s.push_str(&format!(
                "{} out of attempts (--retries {} allows {} in all, counted across runs): rerun with \
                 --retries {} to give each one more, or start their count afresh with `{}`\n",
                count(failed.count, "item", "items"),
                self.retries,
                self.retries.saturating_add(1),
                failed.most_attempts,
                self.forget_command(failed.first.iter().map(|f| f.id.as_str()), unshown == 0)
            ));
        }
    }

    /// The poison items, the first ten by name, and how to retry them.
    fn poison_lines(&self, s: &mut String) {
        for (id, error) in self.poison.iter().take(10) {
            s.push_str(&format!("poison item {id}: {error}\n"));
        }
        if self.poison.len() > 10 {
            s.push_str(&format!("… and {}\n", count(self.poison.len() - 10, "more poison item", "more poison items")));
        }
        if !self.poison.is_empty() && self.queue {
            let complete = self.poison.len() <= 10;
            s.push_str(&format!(
                "poison items (the same error twice) are not run again, and their messages were rejected without \
                 requeue (to the dead-letter exchange, or dropped; JetStream: terminated): once the cause is \
                 fixed, `{}`, then publish the messages again (e.g. move them from the dead-letter queue)\n",
                self.forget_command(self.poison.iter().take(10).map(|(id, _)| id.as_str()), complete)
            ));
        } else if !self.poison.is_empty() {
            // Poison stays in the ledger across runs (neither a fixed command nor --retries revives it): say how.
            let complete = self.poison.len() <= 10;
            s.push_str(&format!(
                "poison items (the same error twice) are not run again: once the cause is fixed, `{}` retries \
                 them\n",
                self.forget_command(self.poison.iter().take(10).map(|(id, _)| id.as_str()), complete)
            ));
        }
    }

    /// Why items were left not done: a refused item, the store away, a halt.
    fn why_not_done(&self, s: &mut String) {
        if let Some(why) = &self.refused {
            s.push_str(&format!("stopped reading the items: {why}; the items before it ran\n"));
        }
        if self.store_unavailable && self.not_done > 0 {
            s.push_str(&format!(
                "the ledger store was unavailable for longer than --store-outage-limit, leaving {} not done \
                 (none failed for it): run it again once the store is back\n",
                count(self.not_done, "item", "items")
            ));
        }
        if self.halted && self.not_done > 0 {
            s.push_str(&format!(
                "the run halted when an item turned poison, leaving {} not done: run it again to do them \
                 (poison items found earlier are skipped, not halted on), or add --on-poison skip to go on past \
                 new ones\n",
                count(self.not_done, "item", "items")
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed_item(line: u64, attempts: u32) -> FailedItem {
        FailedItem { line, id: format!("i{line}"), attempts, error: "exit 1: boom".into() }
    }

    #[test]
    fn out_of_attempts_keeps_the_first_lines_in_file_order_and_the_most_attempts() {
        let mut o = OutOfAttempts::default();
        for line in (1..=15).rev() {
            o.add(failed_item(line, if line == 7 { 9 } else { 4 }));
        }
        assert_eq!(o.count, 15);
        assert_eq!(o.most_attempts, 9);
        assert_eq!(o.first.iter().map(|f| f.line).collect::<Vec<_>>(), (1..=10).collect::<Vec<_>>());
    }

    #[test]
    fn status_goes_by_precedence_interrupted_poison_failed() {
        let all = Summary { total: 2, done: 2, ..Summary::default() };
        assert_eq!(all.status(), RunStatus::AllDone);
        let failed = Summary { total: 2, done: 1, failed: 1, ..Summary::default() };
        assert_eq!(failed.status(), RunStatus::Failed);
        let short = Summary { total: 2, done: 1, ..Summary::default() };
        assert_eq!(short.status(), RunStatus::Failed, "an item neither done nor failed is not all done");
        let poison = Summary { poison: vec![("a".into(), "e".into())], ..failed.clone() };
        assert_eq!(poison.status(), RunStatus::Poison);
        let interrupted = Summary { interrupted: true, not_done: 1, ..poison.clone() };
        assert_eq!(interrupted.status(), RunStatus::Interrupted);
        // A stop requested once every item was done changes nothing.
        let late = Summary { interrupted: true, ..all.clone() };
        assert_eq!(late.status(), RunStatus::AllDone);
        // ...unless it cut a stream short: items may have followed.
        let cut = Summary { stream_cut: true, ..late.clone() };
        assert_eq!(cut.status(), RunStatus::Interrupted);
        let dry = Summary { total: 2, would_run: 2, dry_run: true, ..Summary::default() };
        assert_eq!(dry.status(), RunStatus::AllDone);
        let refused =
            Summary { refused: Some("-:3: writes o/a, as an earlier item did".into()), ..interrupted.clone() };
        assert_eq!(refused.status(), RunStatus::Refused, "a bad item in a stream is bad usage, above all else");
        // An outage that ended the run comes before poison and failures: a rerun once the store is back goes on.
        let outage = Summary { store_unavailable: true, not_done: 1, ..poison.clone() };
        assert_eq!(outage.status(), RunStatus::StoreUnavailable);
        assert_eq!(Summary { interrupted: true, ..outage.clone() }.status(), RunStatus::Interrupted);
        assert_eq!(Summary { store_unavailable: true, ..all.clone() }.status(), RunStatus::AllDone);
        let codes: Vec<i32> = [
            RunStatus::AllDone,
            RunStatus::Failed,
            RunStatus::Refused,
            RunStatus::Poison,
            RunStatus::StoreUnavailable,
            RunStatus::Interrupted,
        ]
        .iter()
        .map(|s| s.exit_code())
        .collect();
        assert_eq!(codes, [0, 1, 2, 3, 75, 130]);
    }

    #[test]
    fn nothing_to_do_is_said_first() {
        let s = Summary { total: 3, skipped: 2, adopted: 1, ..Summary::default() };
        let text = s.render();
        assert!(text.starts_with("nothing to do: all 3 items already done (1 adopted), ran 0 commands\n"), "{text}");
        assert!(!text.contains("items in"), "the counts repeat it: {text}");
        assert!(text.ends_with("exit status 0 (every item done)\n"), "{text}");
    }

    #[test]
    fn failed_and_poison_items_are_named_with_a_forget_command_quoted_for_the_shell() {
        let mut s = Summary {
            total: 3,
            done: 1,
            failed: 1,
            retries: 0,
            output: "out dir/{id}.json".into(),
            ..Summary::default()
        };
        s.out_of_attempts.add(FailedItem { line: 2, id: "it's".into(), attempts: 1, error: "exit 1: boom".into() });
        s.poison.push(("p".into(), "exit 2: bad".into()));
        s.executions = 3;
        let text = s.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "3 items in 0.0s: 1 done now, 0 already done, 0 adopted, 1 failed, 1 poison, 0 not done; 3 commands ran",
                "failed item it's after 1 attempt: exit 1: boom",
                "1 item out of attempts (--retries 0 allows 1 in all, counted across runs): rerun with --retries 1 \
                 to give each one more, or start their count afresh with \
                 `idem runs forget --output 'out dir/{id}.json' \"it's\"`",
                "poison item p: exit 2: bad",
                "poison items (the same error twice) are not run again: once the cause is fixed, \
                 `idem runs forget --output 'out dir/{id}.json' p` retries them",
                "exit status 3 (poison items)",
            ]
        );
    }

    #[test]
    fn counts_of_one_are_singular() {
        let s = Summary { total: 1, done: 1, executions: 1, ..Summary::default() };
        assert!(s.render().starts_with("1 item in 0.0s: 1 done now, "), "{}", s.render());
        assert!(s.render().contains("; 1 command ran\n"), "{}", s.render());
        let s = Summary { total: 1, skipped: 1, ..Summary::default() };
        assert!(s.render().starts_with("nothing to do: 1 item already done (0 adopted), ran 0 commands\n"));
        let s = Summary { total: 1, dry_run: true, would_run: 1, ..Summary::default() };
        assert!(s.render().starts_with("dry run: 1 item, 1 would run, "), "{}", s.render());
        let mut s = Summary { total: 11, failed: 11, retries: 3, output: "o/{id}".into(), ..Summary::default() };
        for line in 1..=11 {
            s.out_of_attempts.add(failed_item(line, 4));
        }
        assert!(s.render().contains("… and 1 more item out of attempts (see --report)\n"), "{}", s.render());
    }

    #[test]
    fn more_failed_items_than_shown_point_at_the_report() {
        let mut s = Summary { total: 12, failed: 12, retries: 3, output: "o/{id}".into(), ..Summary::default() };
        for line in 1..=12 {
            s.out_of_attempts.add(failed_item(line, 4));
        }
        let text = s.render();
        assert!(text.contains("… and 2 more items out of attempts (see --report)\n"), "{text}");
        assert!(text.contains("`idem runs forget --output 'o/{id}' ID…`"), "{text}");
    }

    #[test]
    fn from_a_queue_failed_and_poison_items_need_their_messages_published_again() {
        let mut s = Summary { total: 2, failed: 1, queue: true, output: "o/{id}".into(), ..Summary::default() };
        s.out_of_attempts.add(failed_item(1, 4));
        s.poison.push(("p".into(), "exit 2: bad".into()));
        let text = s.render();
        assert!(!text.contains("retries them") && !text.contains("rerun with"), "{text}");
        assert!(
            text.contains(
                "once the cause is fixed, `idem runs forget --output 'o/{id}' p`, then publish the messages again \
                 (e.g. move them from the dead-letter queue)"
            ),
            "{text}"
        );
        assert!(text.contains("to run them again, `idem runs forget --output 'o/{id}' "), "{text}");
    }

    #[test]
    fn an_empty_queue_is_said_to_be_empty() {
        let text = Summary { queue: true, ..Summary::default() }.render();
        assert!(text.starts_with("nothing to do: the queue was empty\n"), "{text}");
    }
}

//! When a job's slots are: `--every DURATION` (aligned to the Unix epoch) or `--cron 'EXPR'` in `--tz ZONE`.
//!
//! Cron expressions are croner's, restricted to the five fields of crontab(5) (and its `@daily`-style
//! nicknames), in an IANA time zone read by jiff from the system's tz database. croner follows Vixie cron at
//! daylight-saving changes, which is what crontab users expect: a fixed-time job whose time falls in the hour
//! skipped in spring runs at the first instant after it (`30 2 * * *` at 03:00 on that day), one whose time
//! falls in the hour repeated in autumn runs once (the first time), and jobs with a wildcard or step in the
//! hour or minute run at every matching instant, so twice in the repeated hour.

use std::str::FromStr as _;
use std::time::Duration;

use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use jiff::Timestamp;
use jiff::tz::TimeZone;

use crate::error::Error;

/// The longest `--every`: a year of seconds (a longer period belongs in `--cron`).
const MAX_EVERY: Duration = Duration::from_secs(366 * 24 * 3600);

/// How many slots a gap is walked back over one by one (each recorded missed); the rest are counted.
const WALK: usize = idem_core::slot::HISTORY;

/// How many slots of a cron gap [`Schedule::between`] counts beyond the listed ones: each is found by walking
/// the schedule, so a gap of years of an every-minute job is bounded (the count is then "at least").
pub const UNLISTED_CAP: u64 = 1_000_000;

/// A job's schedule.
#[derive(Clone, Debug)]
pub struct Schedule {
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Kind {
    /// Slots every `period` milliseconds since the Unix epoch.
    Every { period_ms: u64 },
    /// Slots where the cron expression matches, in `tz`.
    Cron { expr: String, cron: Box<Cron>, tz: TimeZone, tz_name: String },
}

impl Schedule {
    /// Slots every `period` (whole seconds, 1 s up to 366 days), aligned to the Unix epoch: `--every 1h` has
    /// a slot at every full hour UTC, `--every 7d` every seven days from Thursday 1970-01-01.
    ///
    /// # Errors
    /// [`Error::Config`] for a period that is not whole seconds or out of range.
    pub fn every(period: Duration) -> Result<Self, Error> {
        if period.subsec_nanos() != 0 || period < Duration::from_secs(1) || period > MAX_EVERY {
            return Err(Error::Config(format!(
                "--every {}: give whole seconds from 1s up to 366 days (a calendar schedule is --cron)",
                shown(period)
            )));
        }
        Ok(Self { kind: Kind::Every { period_ms: period.as_secs() * 1000 } })
    }

    /// Slots where the five-field cron expression `expr` matches (minute, hour, day of month, month, day of
    /// week, as crontab(5); `L`, `W`, `#` and the `@daily`-style nicknames too), in the IANA time zone `tz`.
    ///
    /// # Errors
    /// [`Error::Config`] for an expression croner refuses, one with a seconds or year field, or an unknown
    /// time zone.
    pub fn cron(expr: &str, tz: &str) -> Result<Self, Error> {
        let parser = CronParser::builder().seconds(Seconds::Disallowed).year(Year::Disallowed).build();
        let cron = parser.parse(expr.trim()).map_err(|e| {
            let culprit = culprit_field(&parser, expr).unwrap_or_default();
            Error::Config(format!(
                "--cron {expr:?}: {culprit}{e} (five fields: minute hour day-of-month month day-of-week)"
            ))
        })?;
        let zone = TimeZone::get(tz).map_err(|e| {
            Error::Config(format!("--tz {tz:?}: {e} (an IANA time zone name such as UTC or Europe/Berlin)"))
        })?;
        // Croner accepts an expression that never matches (31 February); it would fail every invocation.
        let probe = Timestamp::now().to_zoned(zone.clone());
        if cron.find_next_occurrence(&probe, false).is_err() && cron.find_previous_occurrence(&probe, true).is_err() {
            return Err(Error::Config(format!("--cron {expr:?} never matches a time")));
        }
        Ok(Self {
            kind: Kind::Cron {
                expr: expr.split_whitespace().collect::<Vec<_>>().join(" "),
                cron: Box::new(cron),
                tz: zone,
                tz_name: tz.to_owned(),
            },
        })
    }

    /// The schedule in the canonical form the job record keeps: every invocation of a job must give the same.
    pub fn canonical(&self) -> String {
        match &self.kind {
            Kind::Every { period_ms } => format!("every {}s", period_ms / 1000),
            Kind::Cron { expr, tz_name, .. } => format!("cron '{expr}' tz {tz_name}"),
        }
    }

    /// Whether `unlisted`, as [`Schedule::between`] counted it, is a lower bound: a cron gap's slots are
    /// counted one by one, up to a million (an `--every` gap's are counted exactly).
    pub fn capped(&self, unlisted: u64) -> bool {
        matches!(self.kind, Kind::Cron { .. }) && unlisted >= UNLISTED_CAP
    }

    /// The schedule for people: `every 1h`, `every 1d12h`, `cron '0 3 * * *' tz Europe/Berlin`.
    pub fn describe(&self) -> String {
        match &self.kind {
            Kind::Every { period_ms } => format!("every {}", human_secs(period_ms / 1000)),
            Kind::Cron { .. } => self.canonical(),
        }
    }

    /// The slot current at `now_ms` (milliseconds since the Unix epoch): the latest scheduled time at or
    /// before it.
    ///
    /// # Errors
    /// [`Error::Config`] when no scheduled time lies before `now_ms` within the search croner allows.
    pub fn slot_at(&self, now_ms: u64) -> Result<u64, Error> {
        match &self.kind {
            Kind::Every { period_ms } => Ok(now_ms - now_ms % period_ms),
            Kind::Cron { cron, tz, expr, .. } => {
                let now = zoned(now_ms, tz)?;
                let slot = cron
                    .find_previous_occurrence(&now, true)
                    .map_err(|e| Error::Config(format!("--cron {expr:?}: no scheduled time before now: {e}")))?;
                millis(&slot.timestamp())
            }
        }
    }

    /// The first slot strictly after `now_ms` (milliseconds since the Unix epoch).
    ///
    /// # Errors
    /// [`Error::Config`] when no scheduled time lies after `now_ms` within the search croner allows.
    pub fn next_after(&self, now_ms: u64) -> Result<u64, Error> {
        match &self.kind {
            Kind::Every { period_ms } => Ok(now_ms - now_ms % period_ms + period_ms),
            Kind::Cron { cron, tz, expr, .. } => {
                let next = cron
                    .find_next_occurrence(&zoned(now_ms, tz)?, false)
                    .map_err(|e| Error::Config(format!("--cron {expr:?}: no scheduled time after now: {e}")))?;
                millis(&next.timestamp())
            }
        }
    }

    /// The slots strictly between `after_ms` and `before_ms` (both slots of this schedule): the newest
    /// [`HISTORY`](idem_core::slot::HISTORY) of them in ascending order, and how many older ones there are beyond those (for a cron
    /// schedule counted up to a bound of a million, past which the count is that bound).
    ///
    /// # Errors
    /// [`Error::Config`] when croner cannot walk the schedule.
    pub fn between(&self, after_ms: u64, before_ms: u64) -> Result<(Vec<u64>, u64), Error> {
        if before_ms <= after_ms {
            return Ok((Vec::new(), 0));
        }
        match &self.kind {
            Kind::Every { period_ms } => {
                let total = (before_ms - after_ms) / period_ms - 1;
                let listed = total.min(WALK as u64);
                let slots = (0..listed).rev().map(|i| before_ms - period_ms * (i + 1)).collect();
                Ok((slots, total - listed))
            }
            Kind::Cron { cron, tz, .. } => {
                let mut slots = Vec::new();
                let mut unlisted = 0u64;
                for slot in cron.iter_before(zoned(before_ms, tz)?) {
                    let ms = millis(&slot.timestamp())?;
                    if ms <= after_ms {
                        break;
                    }
                    if slots.len() < WALK {
                        slots.push(ms);
                    } else {
                        unlisted += 1;
                        if unlisted >= UNLISTED_CAP {
                            break;
                        }
                    }
                }
                slots.reverse();
                Ok((slots, unlisted))
            }
        }
    }

    /// How long after `slot_ms` job `name`'s slot starts under `--jitter jitter`, in milliseconds: below the
    /// jitter and below the time to the next slot, taken from SHA-256 of the name and the slot, so every machine
    /// (and every version of idem) computes the same one, and the slot is still one run.
    ///
    /// # Errors
    /// [`Error::Config`] when croner cannot find the next slot.
    pub fn jitter_offset(&self, name: &str, slot_ms: u64, jitter: Duration) -> Result<u64, Error> {
        use sha2::Digest as _;
        let gap = self.next_after(slot_ms)?.saturating_sub(slot_ms);
        let bound = u64::try_from(jitter.as_millis()).unwrap_or(u64::MAX).min(gap).max(1);
        let digest = sha2::Sha256::new()
            .chain_update(name.as_bytes())
            .chain_update([0])
            .chain_update(slot_ms.to_be_bytes())
            .finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        Ok(u64::from_be_bytes(first) % bound)
    }

    /// Every slot from `from_ms` to `to_ms` (both included, milliseconds since the Unix epoch), ascending.
    ///
    /// # Errors
    /// [`Error::Config`] when there are more than `max` (naming the count's lower bound and the limit), or
    /// croner cannot walk the schedule.
    pub fn slots_in(&self, from_ms: u64, to_ms: u64, max: usize) -> Result<Vec<u64>, Error> {
        let mut slots = Vec::new();
        let mut slot =
            if self.slot_at(from_ms).is_ok_and(|s| s == from_ms) { from_ms } else { self.next_after(from_ms)? };
        while slot <= to_ms {
            if slots.len() == max {
                return Err(Error::Config(format!(
                    "more than {max} slots from {} to {}: give a shorter range (one backfill requests at most {max})",
                    self.format(from_ms),
                    self.format(to_ms)
                )));
            }
            slots.push(slot);
            slot = self.next_after(slot)?;
        }
        Ok(slots)
    }

    /// A slot's time as RFC 3339 (`IDEM_SLOT`): UTC with `Z` for `--every` and `--tz UTC`, else with the
    /// zone's offset at that instant (`2025-03-30T03:00:00+02:00`).
    pub fn format(&self, slot_ms: u64) -> String {
        format_in(slot_ms, self.zone())
    }

    fn zone(&self) -> Option<&TimeZone> {
        match &self.kind {
            Kind::Every { .. } => None,
            Kind::Cron { tz, tz_name, .. } => (tz_name != "UTC").then_some(tz),
        }
    }
}

/// A duration as given on the command line (`0s`, `1.5s`, `400d`), not as Rust's `Debug` shows it (`0ns`).
fn shown(d: Duration) -> String {
    match (d.as_secs(), d.subsec_millis(), d.subsec_nanos()) {
        (s, 0, 0) if s % 86_400 == 0 && s > 0 => format!("{}d", s / 86_400),
        (s, 0, 0) => format!("{s}s"),
        (s, ms, n) if n == ms * 1_000_000 => format!("{s}.{ms:03}s"),
        _ => format!("{}s", d.as_secs_f64()),
    }
}

/// Whole seconds for people, in the largest units that divide them: `1h`, `1m30s`, `1d2h`, `45s`, `0s`.
pub(crate) fn human_secs(secs: u64) -> String {
    if secs == 0 {
        return "0s".to_owned();
    }
    let mut out = String::new();
    let mut rest = secs;
    for (unit, size) in [("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)] {
        if rest >= size {
            out.push_str(&format!("{}{unit}", rest / size));
            rest %= size;
        }
    }
    out
}

/// `ms` (milliseconds since the Unix epoch) as RFC 3339: UTC with `Z`, or with `tz`'s offset.
pub(crate) fn format_in(ms: u64, tz: Option<&TimeZone>) -> String {
    let Ok(ts) = Timestamp::from_millisecond(i64::try_from(ms).unwrap_or(i64::MAX)) else {
        return ms.to_string();
    };
    match tz {
        None => ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
        Some(tz) => ts.to_zoned(tz.clone()).strftime("%Y-%m-%dT%H:%M:%S%:z").to_string(),
    }
}

fn zoned(ms: u64, tz: &TimeZone) -> Result<jiff::Zoned, Error> {
    let ts = Timestamp::from_millisecond(i64::try_from(ms).unwrap_or(i64::MAX))
        .map_err(|e| Error::Config(format!("time {ms} ms out of range: {e}")))?;
    Ok(ts.to_zoned(tz.clone()))
}

fn millis(ts: &Timestamp) -> Result<u64, Error> {
    u64::try_from(ts.as_millisecond()).map_err(|_| Error::Config("a scheduled time before 1970".into()))
}

impl std::str::FromStr for Schedule {
    type Err = Error;

    /// Reads [`Schedule::canonical`]'s form back (for tests and the status of a job).
    fn from_str(s: &str) -> Result<Self, Error> {
        if let Some(secs) = s.strip_prefix("every ").and_then(|r| r.strip_suffix('s')) {
            let secs: u64 = secs.parse().map_err(|_| Error::Config(format!("schedule {s:?}")))?;
            return Self::every(Duration::from_secs(secs));
        }
        let rest = s.strip_prefix("cron '").ok_or_else(|| Error::Config(format!("schedule {s:?}")))?;
        let (expr, tz) = rest.rsplit_once("' tz ").ok_or_else(|| Error::Config(format!("schedule {s:?}")))?;
        Self::cron(expr, tz)
    }
}

/// Parses a schedule's canonical form.
///
/// # Errors
/// As [`Schedule::every`] and [`Schedule::cron`].
pub fn parse_canonical(s: &str) -> Result<Schedule, Error> {
    Schedule::from_str(s)
}

/// A time an operator gives (`--until`, `--from`, `--to`), in milliseconds since the Unix epoch: a duration
/// (`2h`, `90m`) after `now_ms` (before it with `ago`), or an RFC 3339 time with its offset (`Z`, `+01:00`,
/// as `status` prints slots). A time without an offset is refused: read as UTC it would be hours off for a
/// job in another zone.
///
/// # Errors
/// [`Error::Config`] naming `flag` and the forms taken.
pub fn parse_time(flag: &str, value: &str, now_ms: u64, ago: bool) -> Result<u64, Error> {
    if let Ok(d) = humantime::parse_duration(value) {
        let d = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        return Ok(if ago { now_ms.saturating_sub(d) } else { now_ms.saturating_add(d) });
    }
    let direction = if ago { "ago" } else { "from now" };
    let refused = || {
        Error::Config(format!(
            "{flag} {value:?}: give an RFC 3339 time with its offset (2026-12-05T18:00:00Z, \
             2026-12-05T19:00:00+01:00) or a duration {direction} (2h)"
        ))
    };
    let t: Timestamp = value.trim().parse().map_err(|_| refused())?;
    u64::try_from(t.as_millisecond()).map_err(|_| refused())
}

/// The five fields' names and the values crontab(5) allows in each.
const FIELDS: [(&str, &str); 5] = [
    ("minute", "0-59"),
    ("hour", "0-23"),
    ("day-of-month", "1-31"),
    ("month", "1-12 or JAN-DEC"),
    ("day-of-week", "0-7 or SUN-SAT"),
];

/// Which field of a five-field `expr` croner refuses, said as `the minute field "61" (0-59): `: each field is
/// parsed alone, the others `*`. `None` when the expression has not five fields or no field alone fails (the
/// error is then the whole expression's).
fn culprit_field(parser: &CronParser, expr: &str) -> Option<String> {
    let fields: Vec<&str> = expr.split_whitespace().collect();
    if fields.len() != FIELDS.len() {
        return None;
    }
    fields.iter().zip(FIELDS).enumerate().find_map(|(i, (field, (name, range)))| {
        let mut alone = ["*"; 5];
        alone[i] = field;
        parser.parse(&alone.join(" ")).is_err().then(|| format!("the {name} field {field:?} ({range}): "))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A refused expression names its field and the values it takes (crontab(5)'s ranges).
    #[test]
    fn a_refused_cron_field_is_named_with_its_range() {
        for (expr, said) in [
            ("61 * * * *", "the minute field \"61\" (0-59): "),
            ("* 25 * * *", "the hour field \"25\" (0-23): "),
            ("* * 32 * *", "the day-of-month field \"32\" (1-31): "),
            ("* * * 13 *", "the month field \"13\" (1-12 or JAN-DEC): "),
            ("* * * * 8", "the day-of-week field \"8\" (0-7 or SUN-SAT): "),
            ("0 9 * * MON-XYZ", "the day-of-week field \"MON-XYZ\" (0-7 or SUN-SAT): "),
        ] {
            let err = Schedule::cron(expr, "UTC").map(|_| ()).expect_err(expr).to_string();
            assert!(err.contains(said), "{expr}: {err}");
        }
        let err = Schedule::cron("* * *", "UTC").map(|_| ()).expect_err("three fields").to_string();
        assert!(!err.contains("field \""), "{err}");
    }

    #[test]
    fn operator_times_take_any_offset_or_a_duration_and_refuse_none() {
        let at = |v: &str| parse_time("--from", v, 10_000_000, true);
        assert_eq!(at("2026-12-05T18:00:00Z").unwrap(), at("2026-12-05T19:00:00+01:00").unwrap());
        assert_eq!(at("2026-12-05T13:00:00-05:00").unwrap(), at("2026-12-05T18:00:00Z").unwrap());
        assert_eq!(at("1s").unwrap(), 9_999_000);
        assert_eq!(parse_time("--until", "1s", 10_000_000, false).unwrap(), 10_001_000);
        let e = at("2026-12-05T18:00:00").unwrap_err().to_string();
        assert!(e.contains("--from \"2026-12-05T18:00:00\": give an RFC 3339 time with its offset"), "{e}");
    }

    fn ms(rfc3339: &str) -> u64 {
        u64::try_from(rfc3339.parse::<Timestamp>().unwrap().as_millisecond()).unwrap()
    }

    #[test]
    fn every_is_aligned_to_the_epoch_and_whole_seconds() {
        let hourly = Schedule::every(Duration::from_secs(3600)).unwrap();
        assert_eq!(hourly.slot_at(ms("2025-03-30T01:59:59.999Z")).unwrap(), ms("2025-03-30T01:00:00Z"));
        assert_eq!(hourly.slot_at(ms("2025-03-30T02:00:00Z")).unwrap(), ms("2025-03-30T02:00:00Z"));
        assert_eq!(hourly.format(ms("2025-03-30T02:00:00Z")), "2025-03-30T02:00:00Z");
        assert_eq!(hourly.canonical(), "every 3600s");
        assert_eq!(hourly.describe(), "every 1h");
        assert_eq!(Schedule::every(Duration::from_secs(90)).unwrap().describe(), "every 1m30s");
        assert_eq!(Schedule::every(Duration::from_secs(86_400 + 7200)).unwrap().describe(), "every 1d2h");
        assert_eq!(human_secs(0), "0s");
        let (slots, unlisted) = hourly.between(ms("2025-03-30T00:00:00Z"), ms("2025-03-30T04:00:00Z")).unwrap();
        assert_eq!(slots, [ms("2025-03-30T01:00:00Z"), ms("2025-03-30T02:00:00Z"), ms("2025-03-30T03:00:00Z")]);
        assert_eq!(unlisted, 0);
        assert_eq!(hourly.next_after(ms("2025-03-30T01:59:59.999Z")).unwrap(), ms("2025-03-30T02:00:00Z"));
        assert_eq!(hourly.next_after(ms("2025-03-30T02:00:00Z")).unwrap(), ms("2025-03-30T03:00:00Z"));
        let daily = Schedule::cron("0 3 * * *", "UTC").unwrap();
        assert_eq!(daily.next_after(ms("2025-03-30T02:59:58.500Z")).unwrap(), ms("2025-03-30T03:00:00Z"));
        assert_eq!(daily.next_after(ms("2025-03-30T03:00:00Z")).unwrap(), ms("2025-03-31T03:00:00Z"));
        let second = Schedule::every(Duration::from_secs(1)).unwrap();
        let (slots, unlisted) = second.between(0, 1_000_000).unwrap();
        assert_eq!((slots.len(), unlisted), (WALK, 999 - WALK as u64));
        assert_eq!(slots.last(), Some(&999_000));
        for bad in [Duration::from_millis(1500), Duration::from_millis(500), Duration::from_secs(400 * 86_400)] {
            assert!(Schedule::every(bad).is_err(), "{bad:?}");
        }
        // Echoed as given, not as Rust's Debug shows it (`0ns`).
        let e = Schedule::every(Duration::ZERO).unwrap_err().to_string();
        assert!(e.starts_with("--every 0s:"), "{e}");
        let e = Schedule::every(Duration::from_millis(1500)).unwrap_err().to_string();
        assert!(e.starts_with("--every 1.500s:"), "{e}");
        let e = Schedule::every(Duration::from_secs(400 * 86_400)).unwrap_err().to_string();
        assert!(e.starts_with("--every 400d:"), "{e}");
    }

    #[test]
    fn cron_follows_vixie_cron_at_daylight_saving_changes() {
        let daily = Schedule::cron("30 2 * * *", "Europe/Berlin").unwrap();
        assert_eq!(daily.canonical(), "cron '30 2 * * *' tz Europe/Berlin");
        // Spring: 02:30 does not exist on 2025-03-30; the slot is the first instant after the gap, 03:00.
        let slot = daily.slot_at(ms("2025-03-30T01:10:00Z")).unwrap();
        assert_eq!(daily.format(slot), "2025-03-30T03:00:00+02:00");
        // Autumn: 02:30 happens twice on 2025-10-26; the job runs once, the first time.
        let second_pass = ms("2025-10-26T01:45:00Z"); // 02:45 CET, after the second 02:30
        assert_eq!(daily.format(daily.slot_at(second_pass).unwrap()), "2025-10-26T02:30:00+02:00");
        // An interval job runs in both passes of the repeated hour.
        let half_hourly = Schedule::cron("*/30 * * * *", "Europe/Berlin").unwrap();
        let (slots, _) = half_hourly.between(ms("2025-10-25T23:30:00Z"), ms("2025-10-26T02:00:00Z")).unwrap();
        let shown: Vec<String> = slots.iter().map(|s| half_hourly.format(*s)).collect();
        assert_eq!(
            shown,
            [
                "2025-10-26T02:00:00+02:00",
                "2025-10-26T02:30:00+02:00",
                "2025-10-26T02:00:00+01:00",
                "2025-10-26T02:30:00+01:00"
            ]
        );
    }

    #[test]
    fn cron_takes_crontab_fields_and_refuses_the_rest() {
        let last = Schedule::cron("0 0 L * *", "UTC").unwrap();
        assert_eq!(last.format(last.slot_at(ms("2025-03-15T00:00:00Z")).unwrap()), "2025-02-28T00:00:00Z");
        // 15W: the weekday closest to the 15th; 2025-03-15 is a Saturday.
        let w = Schedule::cron("0 9 15W * *", "UTC").unwrap();
        assert_eq!(w.format(w.slot_at(ms("2025-03-20T00:00:00Z")).unwrap()), "2025-03-14T09:00:00Z");
        // Day of month OR day of week, as crontab(5): the 1st, and every Monday.
        let either = Schedule::cron("0 0 1 * MON", "UTC").unwrap();
        assert_eq!(either.format(either.slot_at(ms("2025-01-03T00:00:00Z")).unwrap()), "2025-01-01T00:00:00Z");
        assert_eq!(either.format(either.slot_at(ms("2025-01-07T00:00:00Z")).unwrap()), "2025-01-06T00:00:00Z");
        let sunday = Schedule::cron("0 0 * * 7", "UTC").unwrap();
        assert_eq!(sunday.format(sunday.slot_at(ms("2025-01-07T00:00:00Z")).unwrap()), "2025-01-05T00:00:00Z");
        assert!(Schedule::cron("@daily", "UTC").is_ok());
        for bad in ["0 0 0 * * *", "61 * * * *", "* * *", "0 0 31 2 *"] {
            let e = Schedule::cron(bad, "UTC").unwrap_err().to_string();
            assert!(e.starts_with("--cron"), "{bad}: {e}");
        }
        let e = Schedule::cron("0 2 * * *", "Mars/Olympus").unwrap_err().to_string();
        assert!(e.starts_with("--tz \"Mars/Olympus\""), "{e}");
        let round = parse_canonical(&Schedule::cron("0  2 * * *", "Europe/Berlin").unwrap().canonical()).unwrap();
        assert_eq!(round.canonical(), "cron '0 2 * * *' tz Europe/Berlin");
    }
}

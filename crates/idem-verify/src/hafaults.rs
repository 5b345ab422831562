//! The faults of the highly available backends ([`HaFault`]), made with the test kit's operations on a
//! primary and two replicas or standbys, each with its timings in words for the report. They run on a
//! blocking thread ([`crate::backend::StoreEnv::ha_fault`]); the sleeps here are the nemesis's schedule.

use std::thread::sleep;
use std::time::{Duration, Instant};

use idem_testkit::{ClusterFailover, PostgresHa, RedisCluster, RedisSentinel};

use crate::HaFault;

/// What one fault does, drawn from the run's seed.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Which fault.
    pub kind: HaFault,
    /// Which replica or standby is frozen, stopped or kept with the old primary (an index, modulo their
    /// number).
    pub replica: usize,
    /// How long a replica is frozen or stopped before the failover, in ms.
    pub lag_ms: u64,
    /// How long the old primary goes on alone after the promotion (the operator's delay before stopping it,
    /// or the partition's length), in ms.
    pub hold_ms: u64,
    /// The Cluster's `CLUSTER FAILOVER` option of a switchover.
    pub cluster: ClusterFailover,
}

/// Milliseconds since `t0`.
fn ms(t0: Instant) -> u128 {
    t0.elapsed().as_millis()
}

/// Every node of the Sentinel set but the master the Sentinels name now.
fn sentinel_others(set: &RedisSentinel, master: u16) -> Vec<u16> {
    std::iter::once(set.primary_port).chain(set.replica_ports.iter().copied()).filter(|p| *p != master).collect()
}

/// A fault on a Redis primary with two replicas under three Sentinels; what was done, with timings.
pub fn sentinel(set: &mut RedisSentinel, p: Plan) -> String {
    let t0 = Instant::now();
    let old = set.master_port();
    let others = sentinel_others(set, old);
    let r = others[p.replica % others.len()];
    let hold = Duration::from_millis(p.hold_ms);
    let lag = Duration::from_millis(p.lag_ms);
    match p.kind {
        HaFault::Failover => {
            set.kill(old);
            let new = set.wait_new_master(old);
            let elected = ms(t0);
            set.restart(old);
            format!(
                "master {old} killed; {new} elected at {elected} ms; old master in sync as a replica at {} ms",
                ms(t0)
            )
        }
        HaFault::Switchover => {
            let new = set.switchover();
            let done = ms(t0);
            for o in sentinel_others(set, new) {
                set.wait_in_sync(o);
            }
            format!(
                "SENTINEL FAILOVER with master {old} alive: {new} master and {old} its replica at {done} ms; \
                 every replica in sync at {} ms",
                ms(t0)
            )
        }
        HaFault::ReplicaLag => {
            set.freeze(r);
            sleep(lag);
            set.kill(old);
            let killed = ms(t0);
            let new = set.wait_new_master(old);
            let elected = ms(t0);
            set.thaw(r);
            let thawed = ms(t0);
            set.restart(old);
            set.wait_in_sync(r);
            format!(
                "replica {r} frozen; master {old} killed at {killed} ms; {new} elected at {elected} ms; replica \
                 thawed at {thawed} ms; old master and replica in sync at {} ms",
                ms(t0)
            )
        }
        HaFault::ReplicaStop => {
            set.kill(r);
            sleep(lag);
            let started = ms(t0);
            let new = set.switchover();
            let done = ms(t0);
            set.restart(r);
            format!(
                "replica {r} killed; SENTINEL FAILOVER at {started} ms: {new} master, {old} its replica at {done} \
                 ms; replica {r} restarted and in sync at {} ms",
                ms(t0)
            )
        }
        HaFault::Partition => {
            set.partition(&[r]);
            let new = set.wait_new_master(old);
            let elected = ms(t0);
            sleep(hold);
            set.heal();
            let healed = ms(t0);
            set.wait_in_sync(old);
            set.wait_in_sync(r);
            format!(
                "master {old} and replica {r} cut off from the other replica and the Sentinels (idem reaches all); \
                 {new} elected at {elected} ms; healed at {healed} ms; old master and {r} replicas of {new} in \
                 sync at {} ms",
                ms(t0)
            )
        }
    }
}

/// A fault on the master serving `tag`'s slot of a Cluster with two replicas per master; what was done.
/// `None` when that master has no replica to act on.
pub fn cluster(cluster: &mut RedisCluster, tag: &str, p: Plan) -> Option<String> {
    let t0 = Instant::now();
    let old = cluster.master_of(tag);
    let replicas = cluster.replicas_of(old);
    let r = *replicas.get(p.replica % replicas.len().max(1))?;
    let other = replicas.iter().copied().find(|x| *x != r).unwrap_or(r);
    let lag = Duration::from_millis(p.lag_ms);
    Some(match p.kind {
        HaFault::Failover => {
            cluster.kill(old);
            cluster.wait_failover(tag, old);
            let elected = ms(t0);
            cluster.restart(old);
            format!(
                "master {old} of {tag} killed; a replica promoted at {elected} ms; old master in sync at {} ms",
                ms(t0)
            )
        }
        HaFault::Switchover => {
            cluster.failover(r, p.cluster);
            format!("CLUSTER FAILOVER {:?} to {r} with master {old} alive: done at {} ms", p.cluster, ms(t0))
        }
        HaFault::ReplicaLag => {
            cluster.freeze(r);
            sleep(lag);
            cluster.kill(old);
            let killed = ms(t0);
            cluster.wait_failover(tag, old);
            let elected = ms(t0);
            cluster.thaw(r);
            cluster.restart(old);
            format!(
                "replica {r} frozen; master {old} killed at {killed} ms; {other} promoted at {elected} ms; replica \
                 thawed, old master in sync at {} ms",
                ms(t0)
            )
        }
        HaFault::ReplicaStop => {
            cluster.kill(r);
            sleep(lag);
            let started = ms(t0);
            cluster.failover(other, ClusterFailover::Force);
            let done = ms(t0);
            cluster.restart(r);
            format!(
                "replica {r} killed; CLUSTER FAILOVER FORCE to {other} at {started} ms, done at {done} ms; replica \
                 restarted and in sync at {} ms",
                ms(t0)
            )
        }
        HaFault::Partition => {
            cluster.partition(tag, &[r]);
            // Both are asserted, not assumed: a cut that did not take would leave the old master in
            // `cluster_state:ok` and no replica elected, and the kit gives up after a minute (a failed fault).
            cluster.wait_cut_off(old);
            let cut = ms(t0);
            let new = cluster.wait_new_master(tag, old);
            let elected = ms(t0);
            sleep(Duration::from_millis(p.hold_ms));
            cluster.heal();
            let healed = ms(t0);
            cluster.wait_settled();
            format!(
                "master {old} of {tag} and replica {r} cut off from replica {other} and the other masters (bus \
                 and replication; idem reaches all); {old} in cluster_state:fail at {cut} ms; {new} elected at \
                 {elected} ms; healed at {healed} ms; {old} and {r} replicas of {new} in sync at {} ms",
                ms(t0)
            )
        }
    })
}

/// A fault on a PostgreSQL primary with two standbys; what was done, with timings.
pub fn postgres(ha: &mut PostgresHa, p: Plan) -> String {
    let t0 = Instant::now();
    let old = ha.primary_now();
    let standbys: Vec<u16> =
        std::iter::once(ha.primary_port).chain(ha.standby_ports.iter().copied()).filter(|x| *x != old).collect();
    let r = standbys[p.replica % standbys.len()];
    let other = standbys.iter().copied().find(|x| *x != r).unwrap_or(r);
    let (lag, hold) = (Duration::from_millis(p.lag_ms), Duration::from_millis(p.hold_ms));
    match p.kind {
        HaFault::Failover => {
            ha.kill_primary();
            // A failure detector's delay.
            sleep(Duration::from_secs(1));
            ha.promote_standby(r);
            let promoted = ms(t0);
            ha.rejoin();
            format!(
                "primary {old} killed; {r} promoted, writable at {promoted} ms; others rebuilt as its standbys at {} ms",
                ms(t0)
            )
        }
        HaFault::Switchover => {
            ha.switchover(r, hold);
            format!(
                "{r} promoted with primary {old} alive; {old} stopped (fast) {} ms after; others rebuilt as standbys \
                 at {} ms",
                hold.as_millis(),
                ms(t0)
            )
        }
        HaFault::ReplicaLag => {
            ha.freeze(r);
            sleep(lag);
            ha.kill_primary();
            let killed = ms(t0);
            sleep(Duration::from_secs(1));
            ha.promote_standby(other);
            let promoted = ms(t0);
            ha.thaw(r);
            ha.rejoin();
            format!(
                "standby {r} frozen; primary {old} killed at {killed} ms; {other} writable at {promoted} ms; {r} \
                 thawed, others rebuilt as standbys at {} ms",
                ms(t0)
            )
        }
        HaFault::ReplicaStop => {
            ha.stop_server(r);
            sleep(lag);
            let started = ms(t0);
            ha.switchover(other, hold);
            format!(
                "standby {r} stopped; {other} promoted at {started} ms with {old} alive, {old} stopped {} ms after; \
                 others rebuilt at {} ms",
                hold.as_millis(),
                ms(t0)
            )
        }
        HaFault::Partition => {
            ha.partition(&[r]);
            ha.promote_standby(other);
            let promoted = ms(t0);
            sleep(hold);
            ha.heal();
            ha.rejoin();
            format!(
                "primary {old} and standby {r} cut off from standby {other} (idem reaches all); {other} promoted, \
                 writable at {promoted} ms; healed and {old} stopped at {} ms; others rebuilt as standbys at {} ms",
                promoted + hold.as_millis(),
                ms(t0)
            )
        }
    }
}

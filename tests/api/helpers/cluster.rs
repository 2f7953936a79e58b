//! A private Redis Cluster seen from outside the service: its masters and
//! their slots (`CLUSTER NODES`), a slot moved or left migrating as
//! `redis-cli --cluster reshard` does, and what one node holds and counts
//! (`INFO commandstats`, `INFO stats`, a key read while its slot imports).

use crate::helpers::procs::{redis_cli, Cluster};

/// A master of the cluster, from `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct Master {
    pub id: String,
    pub port: u16,
    /// The slot ranges it serves (migration markers left out).
    pub slots: Vec<(u16, u16)>,
}

pub fn masters(cluster: &Cluster) -> Vec<Master> {
    let out = redis_cli(cluster.nodes[0].port, &["cluster", "nodes"]);
    let mut masters = Vec::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 || !f[2].contains("master") || f[2].contains("fail") {
            continue;
        }
        let port = f[1]
            .split('@')
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .expect("a node address");
        let slots = f[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .map(|s| match s.split_once('-') {
                Some((a, b)) => (a.parse().expect("slot"), b.parse().expect("slot")),
                None => (s.parse().expect("slot"), s.parse().expect("slot")),
            })
            .collect();
        masters.push(Master {
            id: f[0].to_owned(),
            port,
            slots,
        });
    }
    assert!(masters.len() >= 3, "{out}");
    masters
}

fn ok(out: String, what: &str) {
    assert_eq!(out.trim(), "OK", "{what}: {out}");
}

/// Moves the slot of `key` (and its keys) from its master to another one,
/// as `redis-cli --cluster reshard` does: IMPORTING on the target, MIGRATING
/// on the source, `MIGRATE` of the keys. With `finish`, every master is then
/// told the target owns the slot (the source answers `MOVED`); without, the
/// slot stays migrating (the source answers `ASK` for the moved keys).
/// Returns the slot, the source and the target.
pub fn move_slot(cluster: &Cluster, key: &str, finish: bool) -> (String, Master, Master) {
    move_slot_to(cluster, key, None, finish)
}

/// [`move_slot`] to the master listening on `to` (another one if `None`).
pub fn move_slot_to(
    cluster: &Cluster,
    key: &str,
    to: Option<u16>,
    finish: bool,
) -> (String, Master, Master) {
    let slot = redis_cli(cluster.nodes[0].port, &["cluster", "keyslot", key])
        .trim()
        .to_owned();
    let n: u16 = slot.parse().expect("a slot");
    let all = masters(cluster);
    let src = all
        .iter()
        .find(|m| m.slots.iter().any(|(a, b)| (*a..=*b).contains(&n)))
        .expect("an owner")
        .clone();
    let dst = all
        .iter()
        .find(|m| m.id != src.id && to.is_none_or(|p| m.port == p))
        .expect("another")
        .clone();
    ok(
        redis_cli(
            dst.port,
            &["cluster", "setslot", &slot, "importing", &src.id],
        ),
        "importing",
    );
    ok(
        redis_cli(
            src.port,
            &["cluster", "setslot", &slot, "migrating", &dst.id],
        ),
        "migrating",
    );
    let keys = redis_cli(src.port, &["cluster", "getkeysinslot", &slot, "1000"]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert!(keys.contains(&key), "{key} in slot {slot}: {keys:?}");
    let dst_port = dst.port.to_string();
    let mut migrate = vec!["migrate", "127.0.0.1", &dst_port, "", "0", "5000", "KEYS"];
    migrate.extend(keys.iter().copied());
    ok(redis_cli(src.port, &migrate), "migrate");
    if finish {
        finish_move(&all, &slot, &src, &dst);
    }
    (slot, src, dst)
}

/// `CLUSTER SETSLOT slot NODE target` on the target, the source, then the
/// others.
pub fn finish_move(all: &[Master], slot: &str, src: &Master, dst: &Master) {
    let mut order = vec![dst.clone(), src.clone()];
    order.extend(
        all.iter()
            .filter(|m| m.id != src.id && m.id != dst.id)
            .cloned(),
    );
    for m in order {
        ok(
            redis_cli(m.port, &["cluster", "setslot", slot, "node", &dst.id]),
            "setslot node",
        );
    }
}

pub async fn cluster_conn(cluster: &Cluster) -> redis::cluster_async::ClusterConnection {
    redis::cluster::ClusterClient::new(cluster.urls())
        .expect("cluster client")
        .get_async_connection()
        .await
        .expect("cluster connection")
}

/// Redis's own `CLUSTER KEYSLOT` of `key`.
pub async fn slot(cluster: &Cluster, key: &str) -> u16 {
    let mut c = cluster.nodes[0].conn().await;
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(&mut c)
        .await
        .expect("cluster keyslot")
}

/// The port of the master serving `key`'s slot.
pub async fn owner(cluster: &Cluster, masters: &[Master], key: &str) -> u16 {
    let s = slot(cluster, key).await;
    masters
        .iter()
        .find(|m| m.slots.iter().any(|(a, b)| (*a..=*b).contains(&s)))
        .map(|m| m.port)
        .expect("every slot is served")
}

/// `calls` of one command in a node's `INFO commandstats` (0 if never called).
pub fn calls(port: u16, command: &str) -> u64 {
    let stats = redis_cli(port, &["info", "commandstats"]);
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|l| l.trim().strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The `s` field of `key` on the node at `port`, which is importing its
/// slot (`ASKING` first: without it the node answers `MOVED`).
pub async fn state_while_importing(port: u16, key: &str) -> Option<String> {
    let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .expect("node url")
        .get_multiplexed_async_connection()
        .await
        .expect("node connection");
    let (s,): (Option<String>,) = redis::pipe()
        .cmd("ASKING")
        .ignore()
        .cmd("HGET")
        .arg(key)
        .arg("s")
        .query_async(&mut c)
        .await
        .expect("asking hget");
    s
}

/// `total_reads_processed` of a node's `INFO stats`: the reads from client
/// sockets it made (its own `INFO` included).
pub fn socket_reads(port: u16) -> u64 {
    redis_cli(port, &["info", "stats"])
        .lines()
        .find_map(|l| l.trim().strip_prefix("total_reads_processed:"))
        .and_then(|n| n.parse().ok())
        .expect("total_reads_processed")
}

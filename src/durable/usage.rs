//! The pools' use as Prometheus metrics, read from the pools themselves when
//! `/metrics` is scraped (no query, no lock held across I/O):
//! `ledger_pg_pool_connections{pool, state="idle"|"busy"}` and
//! `ledger_pg_pool_max_connections{pool}`, for `hot` and `admin`, and `read`
//! when the admin reads go to a replica (`postgres.read_url`).

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntGaugeVec, Opts};
use sqlx::PgPool;

use super::Pools;

/// A collector registered once per service (see `startup`).
pub struct PoolUsage {
    pools: Vec<(&'static str, PgPool)>,
    connections: IntGaugeVec,
    max: IntGaugeVec,
}

impl PoolUsage {
    pub fn new(pools: &Pools, max_hot: u32, max_admin: u32) -> PoolUsage {
        // Static, valid definitions.
        let connections = IntGaugeVec::new(
            Opts::new(
                "ledger_pg_pool_connections",
                "Open Postgres connections per pool (hot: the payment path; admin: audit and reconcile; read: the replica of postgres.read_url), idle or busy.",
            ),
            &["pool", "state"],
        )
        .expect("valid metric");
        let max = IntGaugeVec::new(
            Opts::new(
                "ledger_pg_pool_max_connections",
                "The most connections a pool opens (postgres.pool_size; postgres.admin_pool_size, also for the read pool).",
            ),
            &["pool"],
        )
        .expect("valid metric");
        max.with_label_values(&["hot"]).set(i64::from(max_hot));
        max.with_label_values(&["admin"]).set(i64::from(max_admin));
        let mut watched = vec![("hot", pools.hot.clone()), ("admin", pools.admin.clone())];
        if pools.read_is_replica {
            // The read pool has the admin pool's bounds.
            max.with_label_values(&["read"]).set(i64::from(max_admin));
            watched.push(("read", pools.read.clone()));
        }
        PoolUsage {
            pools: watched,
            connections,
            max,
        }
    }
}

impl Collector for PoolUsage {
    fn desc(&self) -> Vec<&Desc> {
        let mut d = self.connections.desc();
        d.extend(self.max.desc());
        d
    }

    fn collect(&self) -> Vec<MetricFamily> {
        for (name, pool) in &self.pools {
            let open = i64::from(pool.size());
            let idle = i64::try_from(pool.num_idle()).unwrap_or(i64::MAX).min(open);
            self.connections
                .with_label_values(&[name, "idle"])
                .set(idle);
            self.connections
                .with_label_values(&[name, "busy"])
                .set(open - idle);
        }
        let mut out = self.connections.collect();
        out.extend(self.max.collect());
        out
    }
}

//! The chaos run's processes (one private Postgres, one private Redis,
//! three service binaries, each linked to each server through its own
//! proxy) and the nemesis that breaks them at random, one fault at a time,
//! each healed before the next.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::Rng;
use sqlx::Connection;

use crate::helpers::link::Link;
use crate::helpers::procs::{LedgerProc, PgProc, RedisProc};

/// One server behind an instance's link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Postgres,
    Redis,
}

/// What the nemesis does, for how long it holds it.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// The instance's link to the tier holds every byte.
    StallLink { at: usize, tier: Tier },
    /// The instance's link to the tier closes every connection.
    CutLink { at: usize, tier: Tier },
    /// {the instance + Redis} | {Postgres + the other instances}.
    Partition { at: usize },
    /// Redis SIGSTOPped (every instance's calls wait).
    PauseRedis,
    /// Every Postgres backend of the ledger's database terminated.
    TerminateBackends,
    /// Postgres stopped immediately (a crash), then started again.
    RestartPostgres,
    /// The instance SIGKILLed, then started again.
    KillInstance { at: usize },
    /// The instance SIGSTOPped, then resumed.
    PauseInstance { at: usize },
}

/// One instance and its two links.
pub struct Instance {
    pub proc: LedgerProc,
    pub pg_link: Link,
    pub redis_link: Link,
}

impl Instance {
    fn link(&self, tier: Tier) -> &Link {
        match tier {
            Tier::Postgres => &self.pg_link,
            Tier::Redis => &self.redis_link,
        }
    }
}

/// Everything the run breaks.
pub struct Fleet {
    pub pg: PgProc,
    pub redis: RedisProc,
    pub db: String,
    pub prefix: String,
    pub instances: Vec<Instance>,
    _dir: tempfile::TempDir,
}

fn config(db_url: &str, redis_url: &str, prefix: &str) -> String {
    format!(
        r#"
[postgres]
url = "{db_url}"
pool_size = 6
admin_pool_size = 2
[redis]
url = "{redis_url}"
key_prefix = "{prefix}"
timeout = "250ms"
down_after = "1s"
[tokens]
provisional_ttl = "1s"
[biz.order]
ttl = "10m"
issue_rate = "100000/s"
[biz.like]
ttl = "10m"
issue_rate = "100000/s"
"#
    )
}

impl Fleet {
    /// Starts the servers and `n` instances (the first one creates and
    /// migrates the database before the others start).
    pub async fn start(n: usize) -> Fleet {
        let pg = PgProc::start();
        let redis = RedisProc::start();
        let dir = tempfile::tempdir().expect("tempdir");
        let db = "chaos".to_owned();
        let prefix = "chaos:".to_owned();
        let mut instances: Vec<Instance> = Vec::with_capacity(n);
        for i in 0..n {
            let pg_link = Link::to(pg.port).await;
            let redis_link = Link::to(redis.port).await;
            let cfg = config(
                &format!("postgres://postgres@127.0.0.1:{}/{db}", pg_link.port()),
                &format!("redis://127.0.0.1:{}", redis_link.port()),
                &prefix,
            );
            let mut proc = LedgerProc::start(dir.path(), &format!("i{i}"), &cfg);
            proc.wait_ready().await;
            instances.push(Instance {
                proc,
                pg_link,
                redis_link,
            });
        }
        Fleet {
            pg,
            redis,
            db,
            prefix,
            instances,
            _dir: dir,
        }
    }

    pub fn addresses(&self) -> Vec<String> {
        self.instances.iter().map(|i| i.proc.address()).collect()
    }

    /// A direct URL of the database (no link).
    pub fn db_url(&self) -> String {
        format!("{}/{}", self.pg.base(), self.db)
    }

    /// Draws a fault.
    pub fn draw(&self, rng: &mut StdRng) -> Fault {
        let at = rng.gen_range(0..self.instances.len());
        let tier = if rng.gen_bool(0.5) {
            Tier::Postgres
        } else {
            Tier::Redis
        };
        match rng.gen_range(0..9) {
            0 => Fault::StallLink { at, tier },
            1 => Fault::CutLink { at, tier },
            2 => Fault::Partition { at },
            3 => Fault::PauseRedis,
            4 => Fault::TerminateBackends,
            5 => Fault::RestartPostgres,
            6 => Fault::KillInstance { at },
            7 => Fault::PauseInstance { at },
            _ => Fault::StallLink {
                at,
                tier: Tier::Redis,
            },
        }
    }

    /// Applies `fault`, holds it for `hold`, heals it.
    pub async fn inflict(&mut self, fault: Fault, hold: Duration) {
        match fault {
            Fault::StallLink { at, tier } => {
                self.instances[at].link(tier).stall();
                tokio::time::sleep(hold).await;
                self.instances[at].link(tier).open();
            }
            Fault::CutLink { at, tier } => {
                self.instances[at].link(tier).cut();
                tokio::time::sleep(hold).await;
                self.instances[at].link(tier).open();
            }
            Fault::Partition { at } => {
                for (i, inst) in self.instances.iter().enumerate() {
                    if i == at {
                        inst.pg_link.cut();
                    } else {
                        inst.redis_link.cut();
                    }
                }
                tokio::time::sleep(hold).await;
                for inst in &self.instances {
                    inst.pg_link.open();
                    inst.redis_link.open();
                }
            }
            Fault::PauseRedis => {
                self.redis.pause();
                tokio::time::sleep(hold).await;
                self.redis.resume();
            }
            Fault::TerminateBackends => {
                if let Ok(mut c) = sqlx::PgConnection::connect(&self.db_url()).await {
                    let _ = sqlx::query(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                          WHERE datname = $1 AND pid <> pg_backend_pid()",
                    )
                    .bind(&self.db)
                    .execute(&mut c)
                    .await;
                }
                tokio::time::sleep(hold).await;
            }
            Fault::RestartPostgres => {
                tokio::task::block_in_place(|| self.pg.stop_immediate());
                tokio::time::sleep(hold).await;
                tokio::task::block_in_place(|| self.pg.start_again());
            }
            Fault::KillInstance { at } => {
                self.instances[at].proc.kill();
                tokio::time::sleep(hold).await;
                self.instances[at].proc.restart();
            }
            Fault::PauseInstance { at } => {
                let p = &mut self.instances[at].proc;
                if p.is_running() {
                    p.pause();
                    tokio::time::sleep(hold).await;
                    p.resume();
                }
            }
        }
    }

    /// Everything healed: links open, Redis resumed, every instance
    /// running and answering `/healthz` (restarted if it exited).
    pub async fn heal(&mut self) {
        self.redis.resume();
        for inst in &mut self.instances {
            inst.pg_link.open();
            inst.redis_link.open();
            if inst.proc.is_running() {
                inst.proc.resume();
            } else {
                inst.proc.restart();
            }
        }
        for inst in &mut self.instances {
            inst.proc.wait_ready().await;
        }
    }

    /// Waits until every instance's `/readyz` shows the fleet `normal` with
    /// Redis deciding there, and the journal stream is empty.
    pub async fn wait_settled(&self, http: &reqwest::Client) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let mut settled = true;
            for inst in &self.instances {
                let body: Option<serde_json::Value> = match http
                    .get(format!("{}/readyz", inst.proc.address()))
                    .send()
                    .await
                {
                    Ok(r) => r.json().await.ok(),
                    Err(_) => None,
                };
                let normal = body.is_some_and(|b| {
                    b["fleet"]["state"] == "normal" && b["fleet"]["redis_decides_here"] == true
                });
                settled &= normal;
            }
            let journal = self
                .redis
                .cli(&["XLEN", &format!("{}journal", self.prefix)]);
            settled &= journal.trim() == "0";
            if settled {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the fleet did not settle after healing (journal: {journal})"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

//! The chaos run's processes (one private Postgres, one private Redis,
//! three service binaries, each linked to each server through its own
//! proxy) and the nemesis that breaks them at random: one lane of faults at
//! a time on the processes, and (with two lanes) another on the links, so
//! that faults of the two kinds overlap; each fault is healed before its
//! lane draws the next.

use std::sync::Arc;
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The instance's link to the tier holds every byte.
    StallLink { at: usize, tier: Tier },
    /// The instance's link to the tier closes every connection.
    CutLink { at: usize, tier: Tier },
    /// {the instance + Redis} | {Postgres + the other instances}.
    Partition { at: usize },
    /// Redis SIGSTOPped (every instance's calls wait).
    PauseRedis,
    /// Redis killed and started again at once, empty (no persistence).
    RestartRedis,
    /// Every Postgres backend of the ledger's database terminated.
    TerminateBackends,
    /// Postgres stopped immediately (a crash), then started again.
    RestartPostgres,
    /// The instance SIGKILLed, then started again.
    KillInstance { at: usize },
    /// The instance SIGSTOPped, then resumed.
    PauseInstance { at: usize },
}

/// Which faults a lane draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    Everything,
    Links,
    Processes,
}

/// One instance's links to the two servers.
pub struct Links {
    pub pg: Link,
    pub redis: Link,
}

impl Links {
    fn to(&self, tier: Tier) -> &Link {
        match tier {
            Tier::Postgres => &self.pg,
            Tier::Redis => &self.redis,
        }
    }
}

/// Everything the run breaks.
pub struct Fleet {
    pub pg: PgProc,
    pub redis: RedisProc,
    pub db: String,
    pub prefix: String,
    pub procs: Vec<LedgerProc>,
    /// Each instance's links, shared with the links' lane.
    pub links: Arc<Vec<Links>>,
    /// When an instance was last killed, and Redis last restarted empty.
    last_kill: Option<tokio::time::Instant>,
    last_redis_restart: Option<tokio::time::Instant>,
    _dir: tempfile::TempDir,
}

/// Draws a fault for `lane` among `n` instances.
pub fn draw(rng: &mut StdRng, n: usize, lane: Lane) -> Fault {
    let at = rng.gen_range(0..n);
    let tier = if rng.gen_bool(0.5) {
        Tier::Postgres
    } else {
        Tier::Redis
    };
    let links = [
        Fault::StallLink { at, tier },
        Fault::CutLink { at, tier },
        Fault::Partition { at },
    ];
    let procs = [
        Fault::PauseRedis,
        Fault::RestartRedis,
        Fault::TerminateBackends,
        Fault::RestartPostgres,
        Fault::KillInstance { at },
        Fault::PauseInstance { at },
    ];
    match lane {
        Lane::Links => links[rng.gen_range(0..links.len())],
        Lane::Processes => procs[rng.gen_range(0..procs.len())],
        Lane::Everything => {
            let i = rng.gen_range(0..links.len() + procs.len());
            links
                .get(i)
                .copied()
                .unwrap_or_else(|| procs[i - links.len()])
        }
    }
}

/// Applies a fault of the links, holds it for `hold`, heals it.
pub async fn inflict_on_links(links: &[Links], fault: Fault, hold: Duration) {
    match fault {
        Fault::StallLink { at, tier } => {
            links[at].to(tier).stall();
            tokio::time::sleep(hold).await;
            links[at].to(tier).open();
        }
        Fault::CutLink { at, tier } => {
            links[at].to(tier).cut();
            tokio::time::sleep(hold).await;
            links[at].to(tier).open();
        }
        Fault::Partition { at } => {
            for (i, l) in links.iter().enumerate() {
                if i == at {
                    l.pg.cut();
                } else {
                    l.redis.cut();
                }
            }
            tokio::time::sleep(hold).await;
            for l in links {
                l.pg.open();
                l.redis.open();
            }
        }
        _ => {}
    }
}

/// How far apart a kill and a Redis restart are kept (see [`Fleet::apart`]).
const KILL_AND_RESTART_APART: Duration = Duration::from_secs(20);

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
        let mut procs = Vec::with_capacity(n);
        let mut links = Vec::with_capacity(n);
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
            procs.push(proc);
            links.push(Links {
                pg: pg_link,
                redis: redis_link,
            });
        }
        Fleet {
            pg,
            redis,
            db,
            prefix,
            procs,
            links: Arc::new(links),
            last_kill: None,
            last_redis_restart: None,
            _dir: dir,
        }
    }

    /// `fault`, unless it is a kill and a Redis restart within
    /// [`KILL_AND_RESTART_APART`] of each other: a crashed member's Redis
    /// decisions that only the journal held are then lost with Redis, which
    /// no protocol can recover; the fleet waits for an operator (`fleet
    /// forget-silent`, `fleet_redis_down::a_member_lost_with_redis_...`).
    /// The pause of the same process is inflicted instead.
    pub fn apart(&self, fault: Fault) -> Fault {
        let near = |at: Option<tokio::time::Instant>| {
            at.is_some_and(|t| t.elapsed() < KILL_AND_RESTART_APART)
        };
        match fault {
            Fault::RestartRedis if near(self.last_kill) => Fault::PauseRedis,
            Fault::KillInstance { at } if near(self.last_redis_restart) => {
                Fault::PauseInstance { at }
            }
            other => other,
        }
    }

    /// `fault`, unless it restarts Redis while the fleet still waits to
    /// account for a crashed member (an instance shows
    /// `ledger_fleet_unaccounted_members` above 0, or none answers): that
    /// member's decisions may still be in the journal only (entries its
    /// drainer held are claimed after 30 s), so a restart then is the
    /// operator's case of [`Self::apart`], however long ago the kill was.
    /// The pause of Redis is inflicted instead.
    pub async fn accountable(&self, fault: Fault, http: &reqwest::Client) -> Fault {
        if fault != Fault::RestartRedis {
            return fault;
        }
        let mut answered = false;
        for p in &self.procs {
            let Ok(r) = http.get(format!("{}/metrics", p.address())).send().await else {
                continue;
            };
            let text = r.text().await.unwrap_or_default();
            let unaccounted = text.lines().find_map(|l| {
                l.strip_prefix("ledger_fleet_unaccounted_members ")
                    .and_then(|v| v.trim().parse::<f64>().ok())
            });
            match unaccounted {
                Some(n) if n > 0.0 => return Fault::PauseRedis,
                Some(_) => answered = true,
                None => {}
            }
        }
        if answered {
            fault
        } else {
            Fault::PauseRedis
        }
    }

    /// Keeps the instances' logs (and configs) after the run; their
    /// directory.
    pub fn keep_logs(&mut self) -> std::path::PathBuf {
        let dir = tempfile::tempdir().expect("tempdir");
        let kept = std::mem::replace(&mut self._dir, dir);
        kept.keep()
    }

    pub fn addresses(&self) -> Vec<String> {
        self.procs.iter().map(LedgerProc::address).collect()
    }

    /// A direct URL of the database (no link).
    pub fn db_url(&self) -> String {
        format!("{}/{}", self.pg.base(), self.db)
    }

    /// Applies `fault`, holds it for `hold`, heals it.
    pub async fn inflict(&mut self, fault: Fault, hold: Duration) {
        match fault {
            Fault::StallLink { .. } | Fault::CutLink { .. } | Fault::Partition { .. } => {
                inflict_on_links(&self.links, fault, hold).await;
            }
            Fault::PauseRedis => {
                self.redis.pause();
                tokio::time::sleep(hold).await;
                self.redis.resume();
            }
            Fault::RestartRedis => {
                self.last_redis_restart = Some(tokio::time::Instant::now());
                tokio::task::block_in_place(|| self.redis.restart());
                tokio::time::sleep(hold).await;
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
                self.last_kill = Some(tokio::time::Instant::now());
                self.procs[at].kill();
                tokio::time::sleep(hold).await;
                self.procs[at].restart();
            }
            Fault::PauseInstance { at } => {
                let p = &mut self.procs[at];
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
        for l in self.links.iter() {
            l.pg.open();
            l.redis.open();
        }
        for p in &mut self.procs {
            if p.is_running() {
                p.resume();
            } else {
                p.restart();
            }
        }
        for p in &mut self.procs {
            p.wait_ready().await;
        }
    }

    /// Waits until every instance's `/readyz` shows the fleet `normal` with
    /// Redis deciding there, and the journal stream is empty. After 60 s:
    /// what each instance and the journal showed last.
    pub async fn wait_settled(&self, http: &reqwest::Client) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let mut settled = true;
            let mut seen = Vec::new();
            for p in &self.procs {
                let body: Option<serde_json::Value> =
                    match http.get(format!("{}/readyz", p.address())).send().await {
                        Ok(r) => r.json().await.ok(),
                        Err(_) => None,
                    };
                let normal = body.as_ref().is_some_and(|b| {
                    b["fleet"]["state"] == "normal" && b["fleet"]["redis_decides_here"] == true
                });
                settled &= normal;
                if !normal {
                    // What keeps it: members unaccounted for, a foreign Redis.
                    let metrics = match http.get(format!("{}/metrics", p.address())).send().await {
                        Ok(r) => r.text().await.unwrap_or_default(),
                        Err(_) => String::new(),
                    };
                    let gauges: Vec<&str> = metrics
                        .lines()
                        .filter(|l| {
                            l.starts_with("ledger_fleet_unaccounted_members")
                                || l.starts_with("ledger_fleet_redis_foreign")
                        })
                        .collect();
                    seen.push(format!(
                        "{} {}",
                        body.map_or("no answer".to_owned(), |b| b["fleet"].to_string()),
                        gauges.join(", ")
                    ));
                }
            }
            let journal = self
                .redis
                .cli(&["XLEN", &format!("{}journal", self.prefix)]);
            settled &= journal.trim() == "0";
            if settled {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "the fleet did not settle within 60 s of healing: journal length {}; instances' fleet: {}",
                    journal.trim(),
                    seen.join("; ")
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

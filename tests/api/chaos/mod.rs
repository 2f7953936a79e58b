//! The chaos test: three real instances on one private Postgres and one
//! private Redis, a proxy on each instance's link to each, payment-like
//! clients racing two attempts on every token and every client key (fast
//! and durable types of both) while a nemesis breaks
//! links, servers (Redis restarted empty among them) and instances at random; then everything heals, every
//! attempt is retried once more, and the whole history is checked per
//! token or key (`history::check`).
//!
//! `CHAOS_SEED` replays a fault schedule (the seed is printed; the
//! interleavings of real processes are not replayed), `CHAOS_SECS` sets how
//! long the nemesis runs (30 s in the suite; see docs/development.md for
//! the long run), `CHAOS_LANES=1` draws one fault at a time of any kind
//! instead of a lane of link faults beside a lane of process faults.

mod history;
mod nemesis;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::helpers::{heavy, PAYMENTS};
use history::{check, Answer, Event, History, Op, Phase, Rows};
use nemesis::{Fleet, Lane};

/// The clients' view of the fleet: the instances' addresses, one HTTP
/// client (each request bounded: a paused instance is a timeout), where
/// answers go, and whether the nemesis still runs.
struct Clients {
    addresses: Vec<String>,
    http: reqwest::Client,
    history: History,
    chaos: AtomicBool,
    began: std::time::Instant,
}

/// A token and who may consume it.
#[derive(Debug, Clone)]
struct Issued {
    token: String,
    subject: String,
}

/// What the clients race to consume: an issued token, or a client key (it
/// exists from its first consume on; `key` is unique to the run).
#[derive(Debug, Clone)]
enum Target {
    Token(Issued),
    Key { biz: &'static str, key: String },
}

impl Target {
    /// Its name in the history: the token, or `key:<biz>:<key>`.
    fn name(&self) -> String {
        match self {
            Target::Token(t) => t.token.clone(),
            Target::Key { biz, key } => format!("key:{biz}:{key}"),
        }
    }

    /// The consume call of attempt `rid`: path and body.
    fn consume(&self, rid: &str) -> (String, Value) {
        match self {
            Target::Token(t) => (
                format!("/v1/tokens/{}/consume", t.token),
                json!({"subject": t.subject, "request_id": rid}),
            ),
            Target::Key { biz, key } => (
                "/v1/keys/consume".to_owned(),
                json!({"biz_type": biz, "key": key, "request_id": rid}),
            ),
        }
    }

    /// The winner's result call: path and body.
    fn result(&self, rid: &str) -> (String, Value) {
        match self {
            Target::Token(t) => (
                format!("/v1/tokens/{}/result", t.token),
                json!({"subject": t.subject, "result": {"by": rid}, "request_id": rid}),
            ),
            Target::Key { biz, key } => (
                "/v1/keys/result".to_owned(),
                json!({"biz_type": biz, "key": key, "result": {"by": rid}, "request_id": rid}),
            ),
        }
    }
}

impl Clients {
    fn phase(&self) -> Phase {
        if self.chaos.load(Ordering::Relaxed) {
            Phase::Chaos
        } else {
            Phase::Healed
        }
    }

    /// One POST to instance `at`; what came back (status and the body's
    /// `outcome` or `error`), and the body.
    async fn post(&self, at: usize, path: &str, body: &Value) -> (Answer, Value) {
        let sent = self
            .http
            .post(format!("{}{path}", self.addresses[at]))
            .bearer_auth(PAYMENTS)
            .json(body)
            .send()
            .await;
        let Ok(r) = sent else {
            return (Answer::None, Value::Null);
        };
        let status = r.status().as_u16();
        let Ok(body) = r.json::<Value>().await else {
            return (Answer::None, Value::Null);
        };
        let said = body["outcome"].as_str().or(body["error"].as_str());
        (
            Answer::Http {
                status,
                said: said.map(str::to_owned),
            },
            body,
        )
    }

    fn record(&self, token: &str, rid: Option<&str>, op: Op, at: usize, answer: &Answer) {
        self.history.push(Event {
            token: token.to_owned(),
            rid: rid.map(str::to_owned),
            op,
            phase: self.phase(),
            instance: at,
            answer: answer.clone(),
            at_ms: u64::try_from(self.began.elapsed().as_millis()).unwrap_or(u64::MAX),
        });
    }

    /// Issues a token of `biz` on instances drawn at random, retrying what
    /// may be retried; `None` if no instance issued it within `tries`.
    async fn issue(&self, rng: &mut StdRng, biz: &str, subject: &str) -> Option<Issued> {
        for _ in 0..20 {
            let at = rng.gen_range(0..self.addresses.len());
            let (a, body) = self
                .post(
                    at,
                    "/v1/tokens",
                    &json!({"biz_type": biz, "subject": subject}),
                )
                .await;
            match (&a, body["token"].as_str()) {
                (Answer::Http { status: 201, .. }, Some(t)) => {
                    self.record(t, None, Op::Issue, at, &a);
                    return Some(Issued {
                        token: t.to_owned(),
                        subject: subject.to_owned(),
                    });
                }
                (
                    Answer::Http {
                        status: 503 | 429, ..
                    }
                    | Answer::None,
                    _,
                ) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                _ => {
                    self.record(&format!("<issue {biz}>"), None, Op::Issue, at, &a);
                    return None;
                }
            }
        }
        None
    }

    /// One attempt, as a payment client makes it: its own `request_id`,
    /// sent again on 503, 429, timeouts and broken connections (to any
    /// instance) until an answer settles it; the winner records its result
    /// the same way. `until_settled` keeps trying after the nemesis stopped;
    /// otherwise the attempt gives up when it does.
    async fn attempt(&self, rng: &mut StdRng, t: &Target, rid: &str, until_settled: bool) {
        let name = t.name();
        let (path, consume) = t.consume(rid);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        let won = loop {
            if !until_settled && !self.chaos.load(Ordering::Relaxed) {
                return;
            }
            if tokio::time::Instant::now() > deadline {
                return;
            }
            let at = rng.gen_range(0..self.addresses.len());
            let (a, _) = self.post(at, &path, &consume).await;
            self.record(&name, Some(rid), Op::Consume, at, &a);
            match a {
                Answer::Http { status: 200, said } => break said.as_deref() == Some("consumed"),
                Answer::Http {
                    status: 503 | 429, ..
                }
                | Answer::None => {
                    tokio::time::sleep(Duration::from_millis(rng.gen_range(50..300))).await;
                }
                Answer::Http { .. } => return,
            }
        };
        if !won {
            return;
        }
        let (path, result) = t.result(rid);
        while tokio::time::Instant::now() < deadline {
            let at = rng.gen_range(0..self.addresses.len());
            let (a, _) = self.post(at, &path, &result).await;
            self.record(&name, Some(rid), Op::Result, at, &a);
            match a {
                Answer::Http {
                    status: 503 | 429, ..
                }
                | Answer::None => {
                    tokio::time::sleep(Duration::from_millis(rng.gen_range(50..300))).await;
                }
                Answer::Http { .. } => return,
            }
        }
    }
}

fn seed() -> u64 {
    std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random)
}

fn lanes() -> usize {
    std::env::var("CHAOS_LANES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2)
}

fn chaos_secs() -> u64 {
    std::env::var("CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30)
}

/// The attempts of one token: `<token index>-a` and `<token index>-b`.
fn rids(i: usize) -> [String; 2] {
    [format!("r{i}-a"), format!("r{i}-b")]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_random_faults_every_token_is_consumed_exactly_once() {
    let _heavy = heavy().await;
    let seed = seed();
    let secs = chaos_secs();
    eprintln!("chaos: seed {seed} for {secs} s (replay the schedule with CHAOS_SEED={seed})");
    let mut fleet = Fleet::start(3).await;
    let clients = Arc::new(Clients {
        addresses: fleet.addresses(),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .pool_max_idle_per_host(0)
            .build()
            .expect("client"),
        history: History::default(),
        chaos: AtomicBool::new(true),
        began: std::time::Instant::now(),
    });

    // Issuance during the faults, and a new client key every other round;
    // each token and key raced by two attempts.
    let issuer = {
        let clients = clients.clone();
        tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed ^ 0x155);
            let mut issued: Vec<Target> = Vec::new();
            let mut racers = Vec::new();
            let mut i = 0usize;
            while clients.chaos.load(Ordering::Relaxed) {
                let biz = if i.is_multiple_of(2) { "like" } else { "order" };
                let subject = format!("s{}", i % 16);
                let mut new = Vec::new();
                if let Some(t) = clients.issue(&mut rng, biz, &subject).await {
                    new.push(Target::Token(t));
                }
                if i.is_multiple_of(2) {
                    let biz = if i.is_multiple_of(4) { "like" } else { "order" };
                    new.push(Target::Key {
                        biz,
                        key: format!("chaos-{seed:x}-{i}"),
                    });
                }
                for t in new {
                    for rid in rids(issued.len()) {
                        let (clients, t) = (clients.clone(), t.clone());
                        let mut rng = StdRng::seed_from_u64(rng.gen());
                        racers.push(tokio::spawn(async move {
                            clients.attempt(&mut rng, &t, &rid, false).await;
                        }));
                    }
                    issued.push(t);
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(60)).await;
            }
            for r in racers {
                r.await.expect("racer");
            }
            issued
        })
    };

    // The nemesis: a lane of link faults beside this one, of processes.
    let schedule = Arc::new(std::sync::Mutex::new(Vec::new()));
    let end = tokio::time::Instant::now() + Duration::from_secs(secs);
    let note = |schedule: &std::sync::Mutex<Vec<String>>, fault, hold: Duration| {
        schedule.lock().expect("schedule").push(format!(
            "{fault:?} at {} ms for {hold:?}",
            clients.began.elapsed().as_millis()
        ));
    };
    let (own, links_lane) = if lanes() >= 2 {
        let links = fleet.links.clone();
        let schedule = schedule.clone();
        let began = clients.began;
        let n = links.len();
        let lane = tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed ^ 0x11);
            while tokio::time::Instant::now() < end {
                tokio::time::sleep(Duration::from_millis(rng.gen_range(100..1_000))).await;
                let fault = nemesis::draw(&mut rng, n, Lane::Links);
                let hold = Duration::from_millis(rng.gen_range(200..4_000));
                schedule.lock().expect("schedule").push(format!(
                    "{fault:?} at {} ms for {hold:?}",
                    began.elapsed().as_millis()
                ));
                nemesis::inflict_on_links(&links, fault, hold).await;
            }
        });
        (Lane::Processes, Some(lane))
    } else {
        (Lane::Everything, None)
    };
    let mut rng = StdRng::seed_from_u64(seed);
    while tokio::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(100..1_000))).await;
        let fault = fleet.apart(nemesis::draw(&mut rng, fleet.procs.len(), own));
        let fault = fleet.accountable(fault, &clients.http).await;
        let hold = Duration::from_millis(rng.gen_range(200..4_000));
        note(&schedule, fault, hold);
        fleet.inflict(fault, hold).await;
    }
    if let Some(lane) = links_lane {
        lane.await.expect("links lane");
    }
    let schedule = schedule.lock().expect("schedule").clone();
    clients.chaos.store(false, Ordering::Relaxed);
    let issued = issuer.await.expect("issuer");

    // Healed: every attempt once more with its own request_id, until it
    // gets an answer that settles it.
    fleet.heal().await;
    let settled = |r: Result<(), String>| {
        if let Err(e) = r {
            panic!("seed {seed}: {e}\nschedule: {}", schedule.join("; "));
        }
    };
    settled(fleet.wait_settled(&clients.http).await);
    // At most 128 at once, as a client population would send them: a long
    // run's thousands of targets all at once only time out on two cores.
    let permits = Arc::new(tokio::sync::Semaphore::new(128));
    let last: Vec<_> = issued
        .iter()
        .enumerate()
        .flat_map(|(i, t)| rids(i).map(|rid| (t.clone(), rid)))
        .map(|(t, rid)| {
            let (clients, permits) = (clients.clone(), permits.clone());
            let mut rng = StdRng::seed_from_u64(seed);
            tokio::spawn(async move {
                let _permit = permits.acquire().await.expect("permits");
                clients.attempt(&mut rng, &t, &rid, true).await
            })
        })
        .collect();
    for l in last {
        l.await.expect("last round");
    }
    settled(fleet.wait_settled(&clients.http).await);

    // What Postgres holds, read directly.
    let pool = sqlx::PgPool::connect(&fleet.db_url())
        .await
        .expect("postgres");
    let tokens: Vec<String> = issued
        .iter()
        .filter_map(|t| match t {
            Target::Token(t) => Some(t.token.clone()),
            Target::Key { .. } => None,
        })
        .collect();
    let keys: Vec<String> = issued
        .iter()
        .filter_map(|t| match t {
            Target::Key { key, .. } => Some(key.clone()),
            Target::Token(_) => None,
        })
        .collect();
    let rows: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT token, state::text, request_id FROM tokens WHERE token = ANY($1) AND key IS NULL
         UNION ALL
         SELECT 'key:' || biz_type || ':' || key, state::text, request_id FROM tokens
          WHERE key = ANY($2) AND client = 'payments'",
    )
    .bind(&tokens)
    .bind(&keys)
    .fetch_all(&pool)
    .await
    .expect("rows");
    let rows: Rows = rows.into_iter().map(|(t, s, r)| (t, (s, r))).collect();

    let events = clients.history.events();
    let set: BTreeSet<String> = issued.iter().map(Target::name).collect();
    let violations = check(&events, &set, &rows);
    let answered = events.iter().filter(|e| e.phase == Phase::Chaos).count();
    eprintln!(
        "chaos: seed {seed}: {} tokens and {} keys, {} requests ({answered} under faults), {} faults: {}",
        tokens.len(),
        keys.len(),
        events.len(),
        schedule.len(),
        schedule.join("; ")
    );
    assert!(
        tokens.len() >= 50,
        "seed {seed}: only {} tokens issued",
        tokens.len()
    );
    if !violations.is_empty() {
        eprintln!(
            "chaos: the instances' logs are kept in {} (LEDGER_TEST_LOG sets their level; default warn)",
            fleet.keep_logs().display()
        );
    }
    for v in &violations {
        eprintln!("chaos violation: {v:?}");
        if let Some(t) = v.token() {
            for e in events.iter().filter(|e| e.token == t) {
                eprintln!("chaos history: {e:?}");
            }
        }
    }
    assert!(
        violations.is_empty(),
        "seed {seed}: {} violations (listed above, each with its token's history)\nschedule: {}",
        violations.len(),
        schedule.join("; ")
    );
}

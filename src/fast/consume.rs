//! The consume script: one attempt on one token's key, and its reply
//! (the outcome, the key's generation, Redis's clock).

use uuid::Uuid;

use super::call::{evalsha, run_script};
use super::conn::Lane;
use super::write::Writeback;
use super::{FastError, FastTier, Record};

/// What the consume script found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScriptOutcome {
    /// Fast mode: consumed now (journal appended).
    Won { at_ms: i64 },
    /// Durable mode: our provisional marker is set; Postgres decides.
    Claimed,
    /// Consumed before.
    Consumed(Marker),
    /// Another attempt holds a live provisional marker.
    Provisional(Marker),
    /// No key.
    Miss,
    /// Peek: live and unconsumed.
    Issued,
    /// A client key bound to another subject (fast mode, see [`KeyArgs`]).
    Mismatch,
    /// A client key whose hash records no subject to check the call's
    /// against: nothing was written (fast mode, see [`KeyArgs`]).
    Unbound,
    /// Fast mode: Redis holds another dataset than the one the fleet agreed
    /// on (it restarted empty): nothing was decided or written.
    Foreign,
}

/// A durable claim's reply ([`FastTier::claim`]): Redis never decides a
/// durable consume, it only holds the attempt's place while Postgres does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Our provisional marker is set; Postgres decides.
    Claimed,
    /// Consumed before (the marker may be stale: Postgres is the record).
    Consumed(Marker),
    /// Another attempt holds a live provisional marker.
    Provisional(Marker),
}

/// A fast consume's reply ([`FastTier::decide`]): Redis decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Consumed now (journal appended), or a resend of our own win.
    Won { at_ms: i64 },
    /// Consumed before.
    Consumed(Marker),
    /// Another attempt holds a live provisional marker (a durable claim).
    Provisional(Marker),
    /// No key: Redis lost it, it expired, or it was never seeded.
    Miss,
    /// A client key bound to another subject (see [`KeyArgs`]).
    Mismatch,
    /// A client key whose hash records no subject to check the call's
    /// against: nothing was written (see [`KeyArgs`]).
    Unbound,
    /// Redis holds another dataset than the one asked about (it restarted
    /// empty): nothing was decided (see [`crate::fleet`]).
    Foreign,
}

/// A look at a key that writes nothing ([`FastTier::peek`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peek {
    Consumed(Marker),
    Provisional(Marker),
    /// Live and unconsumed.
    Issued,
    Miss,
}

impl ScriptOutcome {
    fn refused(&self, op: &str) -> FastError {
        FastError::Protocol(format!("the consume script ({op}) answered {self:?}"))
    }
}

impl TryFrom<ScriptOutcome> for Claim {
    type Error = FastError;
    fn try_from(o: ScriptOutcome) -> Result<Claim, FastError> {
        match o {
            ScriptOutcome::Claimed => Ok(Claim::Claimed),
            ScriptOutcome::Consumed(m) => Ok(Claim::Consumed(m)),
            ScriptOutcome::Provisional(m) => Ok(Claim::Provisional(m)),
            other => Err(other.refused("claim")),
        }
    }
}

impl TryFrom<ScriptOutcome> for Decision {
    type Error = FastError;
    fn try_from(o: ScriptOutcome) -> Result<Decision, FastError> {
        match o {
            ScriptOutcome::Won { at_ms } => Ok(Decision::Won { at_ms }),
            ScriptOutcome::Consumed(m) => Ok(Decision::Consumed(m)),
            ScriptOutcome::Provisional(m) => Ok(Decision::Provisional(m)),
            ScriptOutcome::Miss => Ok(Decision::Miss),
            ScriptOutcome::Mismatch => Ok(Decision::Mismatch),
            ScriptOutcome::Unbound => Ok(Decision::Unbound),
            ScriptOutcome::Foreign => Ok(Decision::Foreign),
            other => Err(other.refused("decide")),
        }
    }
}

impl TryFrom<ScriptOutcome> for Peek {
    type Error = FastError;
    fn try_from(o: ScriptOutcome) -> Result<Peek, FastError> {
        match o {
            ScriptOutcome::Consumed(m) => Ok(Peek::Consumed(m)),
            ScriptOutcome::Provisional(m) => Ok(Peek::Provisional(m)),
            ScriptOutcome::Issued => Ok(Peek::Issued),
            ScriptOutcome::Miss => Ok(Peek::Miss),
            other => Err(other.refused("peek")),
        }
    }
}

/// What a consume of a client key adds to the script's arguments (fast
/// mode; see `consume.lua`, ARGV[8] to ARGV[10]). Tokens pass none.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeyArgs<'a> {
    /// The subject the call names: a key bound to another answers
    /// [`ScriptOutcome::Mismatch`].
    pub subject: Option<&'a str>,
    /// A missing key is created at this generation and won (its first
    /// consume); `None`: a missing key is a [`ScriptOutcome::Miss`].
    pub create_at_gen: Option<i64>,
    /// The service checked `subject` against Postgres: a key without a
    /// recorded subject takes it instead of answering `Unbound`.
    pub subject_checked: bool,
}

/// What a consume script checks besides the key: a client key's
/// arguments, and the dataset a fast decision is made on.
#[derive(Debug, Clone, Copy, Default)]
struct Checked<'a> {
    key: KeyArgs<'a>,
    /// `None`: not checked (durable and peek modes, replays, tools).
    dataset: Option<Uuid>,
}

/// The fields of a consumed or provisional marker.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Marker {
    pub at_ms: i64,
    pub request_id: Option<String>,
    pub fingerprint: Option<String>,
    pub result: Option<String>,
}

/// The generation a consume script found or decided, and Redis's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyVersion {
    /// The key's generation (bumped by every consume and release, odd while
    /// consumed); after a win, the one it decided; -1 for a missing key.
    pub gen: i64,
    /// Redis's clock when the script ran, ms.
    pub now_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumeMode {
    Durable,
    Fast,
    Peek,
}

/// The arguments of one consume attempt.
#[derive(Debug, Clone)]
pub struct Attempt<'a> {
    /// Its provisional marker's owner; `None`: the script gets a fresh one
    /// for this attempt alone (a fast consume's caller may not name one).
    pub owner: Option<&'a str>,
    pub request_id: Option<&'a str>,
    pub fingerprint: Option<&'a str>,
}

impl FastTier {
    /// A durable attempt's claim on `handle`'s key (a token's text or a
    /// client key's handle): Postgres decides, Redis holds its place.
    pub async fn claim(
        &self,
        handle: &str,
        attempt: &Attempt<'_>,
        provisional_ms: i64,
    ) -> Result<(Claim, KeyVersion), FastError> {
        let (o, v) = self
            .consume_script(
                handle,
                ConsumeMode::Durable,
                attempt,
                provisional_ms,
                None,
                Checked::default(),
            )
            .await?;
        Ok((Claim::try_from(o)?, v))
    }

    /// A fast attempt on `handle`'s key: Redis decides, and appends the
    /// journal entry `journal` with a win. Only on `dataset` (the one the
    /// fleet agreed on; `None`: not checked, for a replay of a decision
    /// already made): on another, [`Decision::Foreign`].
    pub async fn decide(
        &self,
        handle: &str,
        attempt: &Attempt<'_>,
        provisional_ms: i64,
        journal: &Record,
        key: KeyArgs<'_>,
        dataset: Option<Uuid>,
    ) -> Result<(Decision, KeyVersion), FastError> {
        let (o, v) = self
            .consume_script(
                handle,
                ConsumeMode::Fast,
                attempt,
                provisional_ms,
                Some(journal),
                Checked { key, dataset },
            )
            .await?;
        Ok((Decision::try_from(o)?, v))
    }

    /// What `handle`'s key holds, written nothing.
    pub async fn peek(&self, handle: &str) -> Result<(Peek, KeyVersion), FastError> {
        let attempt = Attempt {
            owner: None,
            request_id: None,
            fingerprint: None,
        };
        let (o, v) = self
            .consume_script(
                handle,
                ConsumeMode::Peek,
                &attempt,
                0,
                None,
                Checked::default(),
            )
            .await?;
        Ok((Peek::try_from(o)?, v))
    }

    /// Runs the consume script in any mode and answers its raw outcome
    /// (the tests' and tools' view; the service uses [`Self::claim`],
    /// [`Self::decide`] and [`Self::peek`]). `journal` is the journal entry
    /// a fast win appends.
    pub async fn consume(
        &self,
        token: &str,
        mode: ConsumeMode,
        attempt: &Attempt<'_>,
        provisional_ms: i64,
        journal: Option<&Record>,
    ) -> Result<ScriptOutcome, FastError> {
        self.consume_versioned(token, mode, attempt, provisional_ms, journal)
            .await
            .map(|(outcome, _)| outcome)
    }

    /// Runs the consume script, and says which generation the key is at
    /// (the one it decided, after a fast win) and Redis's clock.
    pub async fn consume_versioned(
        &self,
        token: &str,
        mode: ConsumeMode,
        attempt: &Attempt<'_>,
        provisional_ms: i64,
        journal: Option<&Record>,
    ) -> Result<(ScriptOutcome, KeyVersion), FastError> {
        self.consume_script(
            token,
            mode,
            attempt,
            provisional_ms,
            journal,
            Checked::default(),
        )
        .await
    }

    /// The consume script on a client key's hash (`handle`, see
    /// [`crate::domain::key`]), with its [`KeyArgs`].
    pub async fn consume_key(
        &self,
        handle: &str,
        mode: ConsumeMode,
        attempt: &Attempt<'_>,
        provisional_ms: i64,
        journal: Option<&Record>,
        key: KeyArgs<'_>,
    ) -> Result<(ScriptOutcome, KeyVersion), FastError> {
        let checked = Checked { key, dataset: None };
        self.consume_script(handle, mode, attempt, provisional_ms, journal, checked)
            .await
    }

    async fn consume_script(
        &self,
        token: &str,
        mode: ConsumeMode,
        attempt: &Attempt<'_>,
        provisional_ms: i64,
        journal: Option<&Record>,
        checked: Checked<'_>,
    ) -> Result<(ScriptOutcome, KeyVersion), FastError> {
        let key_args = checked.key;
        let key = self.token_key(token);
        let journal_key = self.journal_key();
        let dataset_key = self.dataset_key();
        let dataset = match (mode, checked.dataset) {
            (ConsumeMode::Fast, Some(d)) if self.checks_dataset() => d.to_string(),
            _ => String::new(),
        };
        let script = &self.scripts.consume;
        let mode_arg = match mode {
            ConsumeMode::Durable => "durable",
            ConsumeMode::Fast => "fast",
            ConsumeMode::Peek => "peek",
        };
        let journal = journal.filter(|_| mode == ConsumeMode::Fast);
        let append = journal.is_some() && self.journal_in_script();
        let consumed_ttl = self.consumed_ttl_ms();
        // The script is idempotent per owner, so every attempt needs its own
        // (a fast consume's caller may not name one).
        let fresh_owner;
        let owner = match attempt.owner {
            Some(owner) => owner,
            None => {
                fresh_owner = uuid::Uuid::new_v4().simple().to_string();
                fresh_owner.as_str()
            }
        };
        let (key, dataset) = (&key, dataset.as_str());
        let create_at = key_args
            .create_at_gen
            .map(|g| g.to_string())
            .unwrap_or_default();
        let create_at = create_at.as_str();
        let timeout = self.settings.timeout;
        let deadline = &self.deadline;
        let mut sends = 0;
        let reply: Vec<String> = loop {
            sends += 1;
            let reply: Vec<String> = self
                .call_idempotent(Lane::Serving, "consume", |mut c| async move {
                    let mut inv = evalsha(script, if append { 3 } else { 1 });
                    inv.arg(key);
                    if append {
                        inv.arg(journal_key).arg(dataset_key);
                    }
                    inv.arg(mode_arg)
                        .arg(owner)
                        .arg(provisional_ms)
                        .arg(attempt.request_id.unwrap_or(""))
                        .arg(attempt.fingerprint.unwrap_or(""))
                        .arg(consumed_ttl)
                        .arg(if append { "1" } else { "0" })
                        .arg(key_args.subject.unwrap_or(""))
                        .arg(create_at)
                        .arg(if key_args.subject_checked { "1" } else { "0" })
                        // Set at each send: a resend gets its own deadline.
                        .arg(deadline.arg(timeout));
                    if append {
                        inv.arg(dataset);
                    }
                    if let (true, Some(journal)) = (append, journal) {
                        for (k, v) in journal.pairs() {
                            inv.arg(k).arg(v);
                        }
                    }
                    run_script(script, &inv, &mut c).await
                })
                .await?;
            // Released less than the releaser's `redis.timeout` ago (see
            // `consume.lua`): sent again once that has passed, at most once.
            if reply.first().map(String::as_str) != Some("cooling") {
                break reply;
            }
            let field = |i: usize| reply.get(i).and_then(|v| v.parse::<i64>().ok());
            if let Some(redis_now) = field(6) {
                self.deadline.observe(redis_now);
            }
            if sends > 1 {
                return Err(FastError::Timeout);
            }
            let wait = match (field(1), field(6)) {
                (Some(until), Some(now)) => until.saturating_sub(now).saturating_add(1),
                _ => 1,
            };
            let cap = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
            let wait = u64::try_from(wait.clamp(1, cap.max(1))).unwrap_or(1);
            tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
        };
        let parsed = parse_consume_reply(&reply, self.clock.now_ms());
        let (Ok((_, version)) | Err((_, version))) = &parsed;
        self.deadline.observe(version.now_ms);
        let (outcome, version) = parsed.map_err(|(e, _)| e)?;
        let label = match outcome {
            ScriptOutcome::Miss => "miss",
            _ => "hit",
        };
        self.metrics
            .fast_tier_total
            .with_label_values(&[label])
            .inc();
        if append {
            if let ScriptOutcome::Won { .. } = outcome {
                return Ok((outcome, version));
            }
        } else if let (ScriptOutcome::Won { at_ms }, ConsumeMode::Fast) = (&outcome, mode) {
            // Cluster: the journal stream is in another slot.
            if let Some(journal) = journal {
                self.append_or_queue(journal.clone().decided(version.gen, *at_ms))
                    .await;
            }
        }
        Ok((outcome, version))
    }

    /// Our provisional marker goes back to issued, at its generation, with
    /// `remaining_ms` to live, if we still own it (see `writeback.lua`).
    pub async fn unclaim(
        &self,
        token: &str,
        owner: &str,
        remaining_ms: i64,
    ) -> Result<(), FastError> {
        self.writeback(token, Writeback::Unclaim { owner }, 0, remaining_ms, None)
            .await
            .map(|_| ())
    }
}

fn opt(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// `now_ms`: ours, for a reply that lacks Redis's (never from our scripts).
/// A refusal keeps the reply's version (Redis's clock, for the deadline).
fn parse_consume_reply(
    reply: &[String],
    now_ms: i64,
) -> Result<(ScriptOutcome, KeyVersion), (FastError, KeyVersion)> {
    let field = |i: usize| reply.get(i).map(String::as_str).unwrap_or("");
    let version = KeyVersion {
        gen: field(5).parse().unwrap_or(-1),
        now_ms: field(6).parse().unwrap_or(now_ms),
    };
    let marker = || Marker {
        at_ms: field(1).parse().unwrap_or(0),
        request_id: opt(field(2)),
        fingerprint: opt(field(3)),
        result: opt(field(4)),
    };
    let outcome = match field(0) {
        "won" => ScriptOutcome::Won {
            at_ms: field(1).parse().unwrap_or(now_ms),
        },
        "claimed" => ScriptOutcome::Claimed,
        "consumed" => ScriptOutcome::Consumed(marker()),
        "provisional" => ScriptOutcome::Provisional(marker()),
        "miss" => ScriptOutcome::Miss,
        "issued" => ScriptOutcome::Issued,
        "mismatch" => ScriptOutcome::Mismatch,
        "unbound" => ScriptOutcome::Unbound,
        "foreign" => ScriptOutcome::Foreign,
        // It reached Redis after this call's deadline and decided nothing
        // (see `deadline`); the caller, if it still waits, hears what a
        // timeout tells it.
        "late" => return Err((FastError::Timeout, version)),
        other => {
            return Err((
                FastError::Protocol(format!("consume answered {other:?}")),
                version,
            ))
        }
    };
    Ok((outcome, version))
}

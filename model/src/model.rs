//! The protocol's steps as a stateright [`Model`]: each action is one atomic
//! step of an instance, Redis, Postgres, a client, the clock or a fault.
//! README.md maps each to the code it abstracts.

use stateright::{Model, Property};

use crate::config::Config;
use crate::properties;
use crate::state::*;

/// One step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Logical time advances one tick (only once every active instance has
    /// beaten at this tick).
    Tick,
    /// An instance's heartbeat: journal probe, going down (flush) when it
    /// cannot reach Redis, its report, the fleet's agreement.
    Beat(u8),
    /// An instance drains the first journal entry into Postgres.
    Drain(u8),
    /// A member that reaches Redis again ends a `redis_down` episode.
    EndEpisode(u8),
    /// A client sends (or retries) its consume to an instance.
    Send {
        client: u8,
        inst: u8,
    },
    /// The script at this index reaches Redis and runs.
    Deliver(u8),
    /// The reply at this index reaches its instance.
    Reply(u8),
    /// A caller's deadline passed: 503.
    Timeout(u8),
    /// A client that won releases its token.
    Release {
        client: u8,
        inst: u8,
    },
    /// An instance's filter hears of the token (`LISTEN`/`NOTIFY`).
    Notify {
        token: u8,
        inst: u8,
    },
    // Faults.
    Crash(u8),
    Restart(u8),
    Pause(u8),
    Resume(u8),
    CutRedis(u8),
    CutPg(u8),
    HealLinks(u8),
    /// {inst + Redis} | {Postgres + the others}.
    Partition(u8),
    Stall(u8),
    LoseReply(u8),
    PgDown,
    PgUp,
    RedisDown,
    RedisUp,
    /// Redis restarts empty, unseen: markers, journal and dataset key gone.
    RedisRestart,
}

/// The model of the consume protocol under `cfg`.
#[derive(Clone, Debug)]
pub struct ConsumeModel {
    pub cfg: Config,
}

impl ConsumeModel {
    pub fn new(cfg: Config) -> ConsumeModel {
        ConsumeModel { cfg }
    }

    fn active(&self, s: &State, i: usize) -> bool {
        s.insts[i].alive && !s.insts[i].paused
    }

    fn reaches_redis(&self, s: &State, i: usize) -> bool {
        s.insts[i].alive && !s.insts[i].cut_redis && s.redis.up
    }

    fn reaches_pg(&self, s: &State, i: usize) -> bool {
        s.insts[i].alive && !s.insts[i].cut_pg && s.pg.up
    }

    fn calls_in_flight(&self, s: &State, i: usize) -> bool {
        s.clients
            .iter()
            .any(|c| matches!(c.phase, Phase::Waiting { inst, .. } if inst as usize == i))
    }

    /// `Fleet::redis_may_decide` (src/fleet.rs): `Some(counted_until)` when
    /// the gate is open.
    fn gate(&self, s: &State, i: usize) -> Option<Option<u8>> {
        let p = self.cfg.protocol;
        let t = self.cfg.timing;
        let inst = &s.insts[i];
        let v = inst.view;
        let confirmed = v.confirmed?;
        let until = if v.pg_failing && !p.lease_bounds_failing_reports {
            None
        } else {
            Some(confirmed.saturating_add(t.lease))
        };
        let fresh = until.is_none_or(|u| s.now < u);
        if !(v.reported_up && v.state == Fleet::Normal && fresh) {
            return None;
        }
        // Item 15: a decision is made only on the dataset the fleet agreed
        // on (`RedisGate::dataset`): none yet, no decision.
        if p.redis_dataset && v.dataset.is_none() {
            return None;
        }
        if inst.closing || (p.flush_every_unapplied && inst.recent.len() >= t.recent_limit as usize)
        {
            return None;
        }
        Some(until.map(|_| confirmed.saturating_add(t.member_timeout)))
    }

    /// The filter's verdict on a genuine token at instance `i`
    /// (`Bloom::verdict` in src/bloom.rs): `false` refuses it as forged.
    fn filter_passes(&self, s: &State, token: usize, i: usize) -> bool {
        if !self.cfg.filter {
            return true;
        }
        let t = self.cfg.timing;
        let iss = &s.issued[token];
        if iss.known[i] {
            return true;
        }
        let now = s.now as i16;
        let ts = iss.ts as i16;
        if (now - ts).abs() <= t.grace as i16 {
            return true;
        }
        let ahead = ts > now + t.grace as i16;
        if ahead && !self.cfg.protocol.filter_marks_first {
            return false;
        }
        // Unknown to this filter, so above the mark this instance knows for
        // the issuer's lease (a mark is notified after its ids): pending.
        if ahead {
            ts <= now + (t.grace + t.max_ahead) as i16
        } else {
            true
        }
    }

    fn answer(s: &mut State, a: Answer) {
        if let Err(pos) = s.answers.binary_search(&a) {
            s.answers.insert(pos, a);
        }
    }

    /// A client is told `duplicate`, decided by a tier that saw the token
    /// consumed while its newest decision anywhere was not (`false_dup`).
    fn duplicate(s: &mut State, c: usize, false_dup: bool) {
        if false_dup {
            s.false_duplicate = true;
        }
        s.clients[c].phase = Phase::Done;
    }

    /// A decision moves a Postgres row forward only (the journal statement,
    /// `journal::apply_entries`).
    fn apply_forward(row: &mut Mark, m: Mark) {
        if m.gen > row.gen {
            *row = m;
        }
    }

    fn fault(&self, s: &State) -> bool {
        s.faults_used < self.cfg.faults.max_faults
    }

    fn fenced_pg(&self, s: &State, i: usize) -> bool {
        let v = s.insts[i].view;
        v.state == Fleet::RedisDown
            && self.reaches_pg(s, i)
            && s.pg.fleet == Fleet::RedisDown
            && s.pg.epoch == v.epoch
    }

    /// Item 15: Redis holds another dataset than `id` (the one an instance's
    /// view names): `JournalState::Foreign` (src/fast/dataset.rs). With no
    /// id asked about (a view from before any report) nothing is checked.
    fn foreign(&self, s: &State, id: Option<u8>) -> bool {
        self.cfg.protocol.redis_dataset && id.is_some() && s.redis.dataset != id
    }

    /// The journal read counts as drained: an empty stream (`XLEN` 0), and
    /// with item 15's fix read with the dataset key in one `MULTI`, on the
    /// dataset `id` (`JournalState::Agreed { len: 0 }`, or `Unchecked` when
    /// no id is asked about). Without the fix, an emptied Redis's stream
    /// (a stream that no longer exists) reads 0 too.
    fn drained(&self, s: &State, id: Option<u8>) -> bool {
        s.redis.journal.is_empty() && !self.foreign(s, id)
    }

    /// A new dataset id (`Uuid::new_v4` in the service): one no tier holds.
    fn new_dataset(s: &State) -> u8 {
        s.redis.dataset.max(s.pg.dataset).map_or(1, |d| d + 1)
    }

    /// Postgres decides a fast consume for client `c` at instance `i`:
    /// `consume_fast_down` under the fleet row at the view's epoch
    /// (`fenced`: the token goes into `redis_resync`), or, after Redis
    /// missed the token, `decide_in_postgres` (`tokens::consume_versioned`,
    /// unfenced: the fleet is normal).
    fn postgres_decides(s: &mut State, c: usize, i: usize, fenced: bool) {
        let client = s.clients[c];
        let token = client.token as usize;
        let row = s.pg.rows[token];
        if row.consumed() {
            if row.rid == client.rid {
                Self::answer(
                    s,
                    Answer {
                        token: client.token,
                        gen: row.gen,
                        rid: client.rid,
                        via: Tier::Postgres,
                        by: i as u8,
                        first: false,
                    },
                );
                s.clients[c].phase = Phase::Won { gen: row.gen };
            } else {
                let stale = !s.newest(client.token).consumed();
                Self::duplicate(s, c, stale);
            }
            return;
        }
        let gen = row.gen + 1;
        s.pg.rows[token] = Mark {
            gen,
            rid: client.rid,
        };
        if fenced && !s.pg.resync.contains(&client.token) {
            s.pg.resync.push(client.token);
            s.pg.resync.sort_unstable();
        }
        Self::answer(
            s,
            Answer {
                token: client.token,
                gen,
                rid: client.rid,
                via: Tier::Postgres,
                by: i as u8,
                first: true,
            },
        );
        s.clients[c].phase = Phase::Won { gen };
    }

    fn beat(&self, s: &mut State, i: usize) {
        let p = self.cfg.protocol;
        let t = self.cfg.timing;
        let now = s.now;
        s.insts[i].beat_at = Some(now);
        // Item 15: a reachable Redis on another dataset than the view's is
        // reported down, as an unreachable one is (`note_journal_progress`
        // answers whether it is foreign).
        let reachable = self.reaches_redis(s, i);
        let view_dataset = s.insts[i].view.dataset;
        let up = reachable && !self.foreign(s, view_dataset);
        if up && p.flush_every_unapplied && self.drained(s, view_dataset) {
            // `note_journal_progress`: every decision recorded before an
            // empty stream (of the view's dataset) is in Postgres.
            s.insts[i].recent.clear();
        }
        if !p.flush_every_unapplied {
            // Before item 3: only the last `recent_window` ticks are kept.
            s.insts[i]
                .recent
                .retain(|d| now < d.at.saturating_add(t.recent_window));
        }
        if !up {
            // `go_down`: close the gate, wait for the calls in flight...
            s.insts[i].closing = true;
            if self.calls_in_flight(s, i) {
                // It resumes the moment the last call ends (`go_down`
                // holds the gate's write lock).
                s.insts[i].going_down = true;
                return;
            }
            s.insts[i].going_down = false;
            // ...then write the recent decisions to Postgres.
            if !s.insts[i].recent.is_empty() {
                if !self.reaches_pg(s, i) {
                    s.insts[i].view.pg_failing = true;
                    return;
                }
                let recent = std::mem::take(&mut s.insts[i].recent);
                for d in recent {
                    let row = &mut s.pg.rows[d.token as usize];
                    Self::apply_forward(
                        row,
                        Mark {
                            gen: d.gen,
                            rid: d.rid,
                        },
                    );
                }
            }
        }
        if !self.reaches_pg(s, i) {
            s.insts[i].view.pg_failing = true;
            return;
        }
        // `durable::fleet::report`, under the fleet row's lock.
        s.pg.members[i] = Some(Report { up, at: now });
        if s.pg.fleet == Fleet::Normal && !up {
            let rows = || s.pg.members.iter().flatten().chain(&s.pg.departed);
            let every_counted_down = rows()
                .filter(|r| now < r.at.saturating_add(t.member_timeout))
                .all(|r| !r.up);
            // A silent member that last said Redis up may have decisions
            // only the journal holds.
            let unaccounted = p.account_for_silent_members
                && rows().any(|r| r.up && now >= r.at.saturating_add(t.member_timeout));
            if every_counted_down && !unaccounted {
                s.pg.fleet = Fleet::RedisDown;
                s.pg.epoch += 1;
            }
        }
        if !up {
            let missed = s.answers.iter().any(|a| {
                a.via == Tier::Redis
                    && a.first
                    && a.by as usize == i
                    && s.pg.rows[a.token as usize].gen < a.gen
            });
            if missed {
                s.flush_missed = true;
            }
        }
        // `Fleet::retire_silent`: the journal seen empty (on the dataset this
        // report read) after this report accounts for every member that was
        // silent at it.
        if up && p.account_for_silent_members && self.drained(s, s.pg.dataset) {
            let silent = |r: &Report| r.up && now >= r.at.saturating_add(t.member_timeout);
            for m in s.pg.members.iter_mut() {
                if m.is_some_and(|r| silent(&r)) {
                    *m = None;
                }
            }
            s.pg.departed.retain(|r| !silent(r));
        }
        s.insts[i].view = View {
            confirmed: Some(now),
            reported_up: up,
            redis_reached: reachable,
            state: s.pg.fleet,
            epoch: s.pg.epoch,
            pg_failing: false,
            dataset: s.pg.dataset,
        };
        if up && s.pg.fleet == Fleet::Normal {
            s.insts[i].closing = false;
        }
        // Item 15, `Fleet::adopt_dataset`: a fleet with no dataset yet (a new
        // database) records a new id, written into Redis inside the
        // transaction that holds the fleet row (one step here).
        if p.redis_dataset && reachable && s.pg.dataset.is_none() && s.pg.fleet == Fleet::Normal {
            let id = Some(Self::new_dataset(s));
            s.redis.dataset = id;
            s.pg.dataset = id;
            s.insts[i].view.dataset = id;
        }
    }

    /// A call of instance `i` ended: a going-down beat waiting for it goes on.
    fn call_ended(&self, s: &mut State, i: usize) {
        if s.insts[i].going_down && !self.calls_in_flight(s, i) {
            self.beat(s, i);
        }
    }

    fn send(&self, s: &mut State, c: usize, i: usize) {
        let p = self.cfg.protocol;
        let t = self.cfg.timing;
        let client = s.clients[c];
        let token = client.token as usize;
        s.clients[c].tries += 1;
        let try_no = s.clients[c].tries;
        if !self.filter_passes(s, token, i) {
            s.refused_genuine = true;
            s.clients[c].phase = Phase::Done;
            return;
        }
        if let Some(counted_until) = self.gate(s, i) {
            let deadline = s.now.saturating_add(t.timeout);
            s.scripts.push(Script {
                inst: i as u8,
                client: c as u8,
                try_no,
                token: client.token,
                rid: client.rid,
                deadline,
                bounded: p.script_not_after,
                stalled: false,
                dataset: s.insts[i].view.dataset,
            });
            let member_until = s.insts[i]
                .view
                .confirmed
                .map_or(0, |at| at.saturating_add(t.member_timeout));
            s.clients[c].phase = Phase::Waiting {
                inst: i as u8,
                try_no,
                deadline,
                counted_until,
                member_until,
            };
            return;
        }
        if self.fenced_pg(s, i) {
            // `consume_fast_down` (src/ledger/degraded.rs): Postgres decides
            // under the fleet row's share lock at the instance's epoch.
            Self::postgres_decides(s, c, i, true);
            return;
        }
        // Neither tier may decide here now: 503.
        s.clients[c].phase = Phase::Ready;
    }

    /// `consume.lua` in fast mode.
    fn deliver(&self, s: &mut State, k: usize) {
        let sc = s.scripts.remove(k);
        let t = sc.token as usize;
        let cooling = s.redis.cooling_until[t].is_some_and(|u| s.now <= u);
        let stale = !s.newest(sc.token).consumed();
        let outcome = if sc.bounded && s.now > sc.deadline {
            Outcome::Late
        } else if self.cfg.protocol.redis_dataset
            && (sc.dataset.is_none() || sc.dataset != s.redis.dataset)
        {
            // Item 15: the dataset key (`KEYS[3]`) is not the caller's
            // (`ARGV[12]`): `foreign`, nothing read or written.
            Outcome::Foreign
        } else {
            match s.redis.markers[t] {
                // No key: `miss` (Redis lost it); nothing written.
                None => Outcome::Miss,
                Some(m) if m.consumed() => Outcome::Consumed {
                    gen: m.gen,
                    rid: m.rid,
                    stale,
                },
                // Released moments ago: nobody consumes it yet (`cooling`); a
                // caller still waiting sends again.
                Some(_) if cooling => Outcome::Late,
                Some(m) => {
                    let mark = Mark {
                        gen: m.gen + 1,
                        rid: sc.rid,
                    };
                    s.redis.markers[t] = Some(mark);
                    s.redis.journal.push(Entry {
                        token: sc.token,
                        mark,
                    });
                    Outcome::Won { gen: mark.gen }
                }
            }
        };
        s.replies.push(ReplyMsg {
            inst: sc.inst,
            client: sc.client,
            try_no: sc.try_no,
            outcome,
        });
    }

    /// The rest of `Ledger::consume_fast` (src/ledger/consume.rs) once the
    /// reply is in.
    fn reply(&self, s: &mut State, k: usize) {
        let inst = s.replies[k].inst as usize;
        self.reply_inner(s, k);
        self.call_ended(s, inst);
    }

    fn reply_inner(&self, s: &mut State, k: usize) {
        let r = s.replies.remove(k);
        let c = r.client as usize;
        let client = s.clients[c];
        let Phase::Waiting {
            inst,
            try_no,
            counted_until,
            member_until,
            ..
        } = client.phase
        else {
            return;
        };
        if inst != r.inst || try_no != r.try_no {
            return;
        }
        let i = inst as usize;
        match r.outcome {
            Outcome::Won { gen } => {
                s.insts[i].recent.push(Decision {
                    token: client.token,
                    gen,
                    rid: client.rid,
                    at: s.now,
                });
                let ran_out = counted_until.is_some_and(|u| s.now >= u);
                if self.cfg.protocol.lease_checked_after_reply && ran_out {
                    s.clients[c].phase = Phase::Ready;
                    return;
                }
                if s.now >= member_until {
                    s.won_outside_membership = true;
                }
                Self::answer(
                    s,
                    Answer {
                        token: client.token,
                        gen,
                        rid: client.rid,
                        via: Tier::Redis,
                        by: inst,
                        first: true,
                    },
                );
                s.clients[c].phase = Phase::Won { gen };
            }
            Outcome::Consumed { gen, rid, .. } if rid == client.rid => {
                if self.cfg.protocol.flush_replayed_wins {
                    s.insts[i].recent.push(Decision {
                        token: client.token,
                        gen,
                        rid,
                        at: s.now,
                    });
                    let ran_out = counted_until.is_some_and(|u| s.now >= u);
                    if self.cfg.protocol.lease_checked_after_reply && ran_out {
                        s.clients[c].phase = Phase::Ready;
                        return;
                    }
                }
                Self::answer(
                    s,
                    Answer {
                        token: client.token,
                        gen,
                        rid,
                        via: Tier::Redis,
                        by: inst,
                        first: false,
                    },
                );
                s.clients[c].phase = Phase::Won { gen };
            }
            Outcome::Consumed { stale, .. } => Self::duplicate(s, c, stale),
            Outcome::Late => s.clients[c].phase = Phase::Ready,
            // Item 15: nothing decided; `Fleet::redis_foreign` nudges a
            // report (its next beat finds Redis foreign), 503.
            Outcome::Foreign => s.clients[c].phase = Phase::Ready,
            // Redis lost the token: Postgres decides (`decide_in_postgres`,
            // then `settle_row` writes the row back to Redis off the path:
            // not modelled, the key stays missing and Postgres keeps
            // deciding), or 503 when it cannot be reached.
            Outcome::Miss => {
                if self.reaches_pg(s, i) {
                    Self::postgres_decides(s, c, i, false);
                } else {
                    s.clients[c].phase = Phase::Ready;
                }
            }
        }
    }

    /// A fast release (`fast_write.lua` in Redis while the fleet is normal,
    /// Postgres under the fence during an episode).
    fn release(&self, s: &mut State, c: usize, i: usize) {
        let client = s.clients[c];
        let t = client.token as usize;
        let v = s.insts[i].view;
        let p = self.cfg.protocol;
        let to_redis = if p.releases_through_gate {
            self.gate(s, i).is_some() && self.reaches_redis(s, i)
        } else {
            v.state == Fleet::Normal && self.reaches_redis(s, i)
        };
        // Item 15: `fast_write.lua` `release` carries the gate's dataset id
        // too, and on another dataset writes nothing (`foreign`, 503,
        // `Fleet::redis_foreign`): the client still holds its win.
        if to_redis && self.foreign(s, v.dataset) {
            return;
        }
        match (to_redis, s.redis.markers[t]) {
            // `miss`: the finisher's release in Postgres (then `write_issued`
            // off the path: not modelled), or 503.
            (true, None) => {
                if !self.reaches_pg(s, i) {
                    return;
                }
                let row = &mut s.pg.rows[t];
                if row.consumed() && row.rid == client.rid {
                    row.gen += 1;
                    row.rid = 0;
                    s.clients[c].phase = Phase::Released;
                } else {
                    s.clients[c].phase = Phase::Done;
                }
            }
            (true, Some(m)) if m.consumed() && m.rid == client.rid => {
                let mark = Mark {
                    gen: m.gen + 1,
                    rid: 0,
                };
                s.redis.markers[t] = Some(mark);
                s.redis.journal.push(Entry {
                    token: client.token,
                    mark,
                });
                if p.release_waits_out_scripts {
                    s.redis.cooling_until[t] = Some(s.now.saturating_add(self.cfg.timing.timeout));
                }
                if p.releases_through_gate {
                    s.insts[i].recent.push(Decision {
                        token: client.token,
                        gen: mark.gen,
                        rid: 0,
                        at: s.now,
                    });
                }
                s.clients[c].phase = Phase::Released;
            }
            (true, Some(_)) => s.clients[c].phase = Phase::Done,
            (false, _) if self.fenced_pg(s, i) => {
                let row = &mut s.pg.rows[t];
                if row.consumed() && row.rid == client.rid {
                    row.gen += 1;
                    row.rid = 0;
                    if !s.pg.resync.contains(&client.token) {
                        s.pg.resync.push(client.token);
                        s.pg.resync.sort_unstable();
                    }
                    s.clients[c].phase = Phase::Released;
                } else {
                    s.clients[c].phase = Phase::Done;
                }
            }
            // Otherwise 503: the client still holds its win and may try again.
            (false, _) => {}
        }
    }

    fn end_episode(&self, s: &mut State) {
        for t in std::mem::take(&mut s.pg.resync) {
            let row = s.pg.rows[t as usize];
            let m = &mut s.redis.markers[t as usize];
            // A decision of the episode replaces a marker of the same
            // generation (only a late script can have written one), and
            // creates a missing one.
            if m.is_none_or(|m| m.gen <= row.gen) {
                *m = Some(row);
            }
        }
        s.pg.fleet = Fleet::Normal;
        if self.cfg.protocol.redis_dataset {
            // Item 15: in the same final step (`finish_return`, holding the
            // fleet row) Redis gets the fleet's dataset id back (a new one
            // when the fleet had none): every member's recent decisions are
            // in Postgres, and Redis holds what Postgres decided.
            let id = s.pg.dataset.unwrap_or_else(|| Self::new_dataset(s));
            s.redis.dataset = Some(id);
            s.pg.dataset = Some(id);
        }
    }

    fn crash(&self, s: &mut State, i: usize) {
        // Its row stays in `fleet_members`; a restart reports as a new member.
        if let Some(r) = s.pg.members[i].take() {
            let at = s.pg.departed.partition_point(|x| *x < r);
            s.pg.departed.insert(at, r);
        }
        let inst = &mut s.insts[i];
        inst.alive = false;
        inst.paused = false;
        inst.view = View::default();
        inst.closing = false;
        inst.recent.clear();
        inst.beat_at = None;
        inst.going_down = false;
        for c in s.clients.iter_mut() {
            if matches!(c.phase, Phase::Waiting { inst, .. } if inst as usize == i) {
                // The connection broke: the client sees a failure and retries.
                c.phase = Phase::Ready;
            }
        }
        s.replies.retain(|r| r.inst as usize != i);
        for a in s.answers.iter_mut() {
            if a.by as usize == i {
                a.by = NOBODY;
            }
        }
        s.answers.sort_unstable();
    }
}

impl Model for ConsumeModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let cfg = &self.cfg;
        let n = cfg.instances as usize;
        let tokens = cfg.tokens as usize;
        let insts: Vec<Inst> = (0..n)
            .map(|_| Inst {
                alive: true,
                ..Inst::default()
            })
            .collect();
        let clients: Vec<Client> = cfg
            .clients
            .iter()
            .enumerate()
            .map(|(k, &token)| Client {
                token,
                rid: k as u8 + 1,
                tries: 0,
                phase: Phase::Ready,
            })
            .collect();
        // With the filter, instance 0 issued every token at tick 0, by its
        // clock: on time, or (the clock-skew fault) `skew` ahead.
        let skews: Vec<bool> = if cfg.filter && cfg.faults.clock_skew && cfg.faults.max_faults > 0 {
            vec![false, true]
        } else {
            vec![false]
        };
        skews
            .into_iter()
            .map(|skewed| {
                let issued = (0..tokens)
                    .map(|_| Issued {
                        ts: if skewed { cfg.timing.skew } else { 0 },
                        known: (0..n).map(|i| !cfg.filter || i == 0).collect(),
                    })
                    .collect();
                self.init_state(insts.clone(), clients.clone(), issued, skewed)
            })
            .collect()
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        self.step(last, action)
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        self.enabled(s, out)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::all()
    }
}

impl ConsumeModel {
    fn init_state(
        &self,
        insts: Vec<Inst>,
        clients: Vec<Client>,
        issued: Vec<Issued>,
        skewed: bool,
    ) -> State {
        let cfg = &self.cfg;
        let n = cfg.instances as usize;
        let tokens = cfg.tokens as usize;
        State {
            now: 0,
            faults_used: u8::from(skewed),
            insts,
            redis: Redis {
                up: true,
                markers: vec![Some(Mark::default()); tokens],
                cooling_until: vec![None; tokens],
                journal: Vec::new(),
                dataset: None,
            },
            pg: Pg {
                up: true,
                rows: vec![Mark::default(); tokens],
                fleet: Fleet::Normal,
                epoch: 0,
                members: vec![None; n],
                departed: Vec::new(),
                resync: Vec::new(),
                dataset: None,
            },
            clients,
            scripts: Vec::new(),
            replies: Vec::new(),
            issued,
            issuer_skewed: skewed,
            answers: Vec::new(),
            refused_genuine: false,
            won_outside_membership: false,
            flush_missed: false,
            false_duplicate: false,
        }
    }

    fn enabled(&self, s: &State, out: &mut Vec<Action>) {
        let cfg = &self.cfg;
        let f = cfg.faults;
        let n = cfg.instances as usize;
        // The clock: every active instance beats once per tick.
        let all_beaten = (0..n).all(|i| !self.active(s, i) || s.insts[i].beat_at == Some(s.now));
        // Timers fire on time: a live caller past its deadline answers 503
        // before time moves on.
        let none_expired = s.clients.iter().all(|c| match c.phase {
            Phase::Waiting { inst, deadline, .. } => {
                !self.active(s, inst as usize) || s.now <= deadline
            }
            _ => true,
        });
        if s.now < cfg.max_time && all_beaten && none_expired {
            out.push(Action::Tick);
        }
        for i in 0..n {
            let iu = i as u8;
            if self.active(s, i) {
                if s.insts[i].beat_at != Some(s.now) {
                    out.push(Action::Beat(iu));
                }
                if !s.redis.journal.is_empty() && self.reaches_redis(s, i) && self.reaches_pg(s, i)
                {
                    out.push(Action::Drain(iu));
                }
                // The episode ends on a Redis its last report reached (with
                // item 15's fix: on the fleet's dataset or a foreign one).
                let v = s.insts[i].view;
                if v.redis_reached
                    && v.state == Fleet::RedisDown
                    && s.pg.fleet == Fleet::RedisDown
                    && self.reaches_redis(s, i)
                    && self.reaches_pg(s, i)
                {
                    out.push(Action::EndEpisode(iu));
                }
            }
        }
        for (c, client) in s.clients.iter().enumerate() {
            let cu = c as u8;
            match client.phase {
                Phase::Ready if client.tries < cfg.max_tries => {
                    for i in 0..n {
                        if self.active(s, i) {
                            out.push(Action::Send {
                                client: cu,
                                inst: i as u8,
                            });
                        }
                    }
                }
                Phase::Waiting { inst, deadline, .. }
                    if self.active(s, inst as usize) && s.now > deadline =>
                {
                    out.push(Action::Timeout(cu));
                }
                Phase::Won { .. } if cfg.release => {
                    for i in 0..n {
                        if self.active(s, i) {
                            out.push(Action::Release {
                                client: cu,
                                inst: i as u8,
                            });
                        }
                    }
                }
                _ => {}
            }
        }
        for (k, sc) in s.scripts.iter().enumerate() {
            let link = s.redis.up && !s.insts[sc.inst as usize].cut_redis;
            if link && (sc.stalled || s.now <= sc.deadline) {
                out.push(Action::Deliver(k as u8));
            }
            if f.stall && !sc.stalled && self.fault(s) {
                out.push(Action::Stall(k as u8));
            }
        }
        for (k, r) in s.replies.iter().enumerate() {
            let i = r.inst as usize;
            if self.active(s, i) && !s.insts[i].cut_redis {
                out.push(Action::Reply(k as u8));
            }
            if f.lost_reply && self.fault(s) {
                out.push(Action::LoseReply(k as u8));
            }
        }
        if cfg.filter {
            for (t, iss) in s.issued.iter().enumerate() {
                // The issuer's record commits and the peer hears of it
                // (one step: the writer's batch and its `pg_notify`).
                for i in 0..n {
                    if !iss.known[i]
                        && self.active(s, i)
                        && self.reaches_pg(s, i)
                        && self.reaches_pg(s, 0)
                    {
                        out.push(Action::Notify {
                            token: t as u8,
                            inst: i as u8,
                        });
                    }
                }
            }
        }
        // Faults and heals.
        let can = self.fault(s);
        for i in 0..n {
            let iu = i as u8;
            let inst = &s.insts[i];
            if f.crash {
                if inst.alive && can {
                    out.push(Action::Crash(iu));
                }
                if !inst.alive {
                    out.push(Action::Restart(iu));
                }
            }
            if f.pause {
                if inst.alive && !inst.paused && can {
                    out.push(Action::Pause(iu));
                }
                if inst.paused {
                    out.push(Action::Resume(iu));
                }
            }
            if f.cut_redis && !inst.cut_redis && can {
                out.push(Action::CutRedis(iu));
            }
            if f.cut_pg && !inst.cut_pg && can {
                out.push(Action::CutPg(iu));
            }
            if f.partition && can && !s.insts.iter().any(|x| x.cut_pg || x.cut_redis) {
                out.push(Action::Partition(iu));
            }
            if inst.cut_redis || inst.cut_pg {
                out.push(Action::HealLinks(iu));
            }
        }
        if f.pg_outage {
            if s.pg.up && can {
                out.push(Action::PgDown);
            }
            if !s.pg.up {
                out.push(Action::PgUp);
            }
        }
        if f.redis_outage {
            if s.redis.up && can {
                out.push(Action::RedisDown);
            }
            if !s.redis.up {
                out.push(Action::RedisUp);
            }
        }
        if f.redis_restart && s.redis.up && can {
            out.push(Action::RedisRestart);
        }
    }

    fn step(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick => s.now += 1,
            Action::Beat(i) => self.beat(&mut s, i as usize),
            Action::Drain(_) => {
                let e = s.redis.journal.remove(0);
                Self::apply_forward(&mut s.pg.rows[e.token as usize], e.mark);
            }
            Action::EndEpisode(_) => self.end_episode(&mut s),
            Action::Send { client, inst } => self.send(&mut s, client as usize, inst as usize),
            Action::Deliver(k) => self.deliver(&mut s, k as usize),
            Action::Reply(k) => self.reply(&mut s, k as usize),
            Action::Timeout(c) => {
                let client = s.clients[c as usize];
                if let Phase::Waiting { try_no, .. } = client.phase {
                    // A script that is not held anywhere is gone for good.
                    s.scripts
                        .retain(|x| x.stalled || !(x.client == c && x.try_no == try_no));
                    s.replies.retain(|x| !(x.client == c && x.try_no == try_no));
                }
                s.clients[c as usize].phase = Phase::Ready;
                if let Phase::Waiting { inst, .. } = client.phase {
                    self.call_ended(&mut s, inst as usize);
                }
            }
            Action::Release { client, inst } => {
                self.release(&mut s, client as usize, inst as usize)
            }
            Action::Notify { token, inst } => s.issued[token as usize].known[inst as usize] = true,
            Action::Crash(i) => {
                s.faults_used += 1;
                self.crash(&mut s, i as usize);
            }
            Action::Restart(i) => {
                let inst = &mut s.insts[i as usize];
                inst.alive = true;
                inst.beat_at = None;
            }
            Action::Pause(i) => {
                s.faults_used += 1;
                s.insts[i as usize].paused = true;
            }
            Action::Resume(i) => {
                s.insts[i as usize].paused = false;
                s.insts[i as usize].beat_at = None;
            }
            Action::CutRedis(i) => {
                s.faults_used += 1;
                s.insts[i as usize].cut_redis = true;
            }
            Action::CutPg(i) => {
                s.faults_used += 1;
                s.insts[i as usize].cut_pg = true;
            }
            Action::HealLinks(i) => {
                s.insts[i as usize].cut_redis = false;
                s.insts[i as usize].cut_pg = false;
            }
            Action::Partition(i) => {
                s.faults_used += 1;
                for (j, inst) in s.insts.iter_mut().enumerate() {
                    if j == i as usize {
                        inst.cut_pg = true;
                    } else {
                        inst.cut_redis = true;
                    }
                }
            }
            Action::Stall(k) => {
                s.faults_used += 1;
                s.scripts[k as usize].stalled = true;
            }
            Action::LoseReply(k) => {
                s.faults_used += 1;
                s.replies.remove(k as usize);
            }
            Action::PgDown => {
                s.faults_used += 1;
                s.pg.up = false;
            }
            Action::PgUp => s.pg.up = true,
            Action::RedisDown => {
                s.faults_used += 1;
                s.redis.up = false;
            }
            Action::RedisUp => s.redis.up = true,
            Action::RedisRestart => {
                s.faults_used += 1;
                let tokens = s.redis.markers.len();
                s.redis.markers = vec![None; tokens];
                s.redis.cooling_until = vec![None; tokens];
                s.redis.journal.clear();
                s.redis.dataset = None;
            }
        }
        Some(s)
    }
}

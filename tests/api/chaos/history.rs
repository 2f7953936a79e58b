//! The chaos run's history (every request the clients sent and what came
//! back) and its checker: the per-token properties that must hold whatever
//! the nemesis did. A client key is checked as a token is, under the name
//! `key:<biz>:<key>` (it has no issuance: it exists from its first consume).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

/// What a client asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Issue,
    Consume,
    Result,
}

/// When: under the nemesis, or in the last round after everything healed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Chaos,
    Healed,
}

/// What came back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// An HTTP answer: its status, and the body's `outcome` or `error`.
    Http { status: u16, said: Option<String> },
    /// No answer: a timeout, a refused or broken connection.
    None,
}

impl Answer {
    fn is(&self, status: u16, said: &str) -> bool {
        matches!(self, Answer::Http { status: s, said: Some(x) } if *s == status && x == said)
    }
}

/// One request and its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub token: String,
    /// The consume attempt's `request_id` (issuance has none).
    pub rid: Option<String>,
    pub op: Op,
    pub phase: Phase,
    pub instance: usize,
    pub answer: Answer,
    /// Milliseconds since the run began, when the answer came.
    pub at_ms: u64,
}

/// Every event of a run, appended by many tasks.
#[derive(Debug, Default)]
pub struct History {
    events: Mutex<Vec<Event>>,
}

impl History {
    pub fn push(&self, e: Event) {
        self.events.lock().expect("history").push(e);
    }

    pub fn events(&self) -> Vec<Event> {
        self.events.lock().expect("history").clone()
    }
}

/// A token's row in Postgres after the run: `(state, request_id)`.
pub type Rows = HashMap<String, (String, Option<String>)>;

/// A property that did not hold, for one token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// More than one attempt was told `consumed`.
    TwoWinners { token: String, rids: Vec<String> },
    /// Nobody was told `consumed`, even after healing: the token is burned.
    Burned { token: String },
    /// The winner is not what Postgres holds (no row, not consumed, or
    /// another `request_id`).
    WinnerNotInPostgres {
        token: String,
        winner: String,
        row: Option<(String, Option<String>)>,
    },
    /// A token answered 201 was refused as forged.
    RefusedAsForged { token: String, instance: usize },
    /// An answer the API does not document for this request.
    Undocumented { event: Event },
}

impl Violation {
    /// The token it is about (none for an undocumented issue answer).
    pub fn token(&self) -> Option<&str> {
        match self {
            Violation::TwoWinners { token, .. }
            | Violation::Burned { token }
            | Violation::WinnerNotInPostgres { token, .. }
            | Violation::RefusedAsForged { token, .. } => Some(token),
            Violation::Undocumented { event } => Some(&event.token),
        }
    }
}

/// Whether `a` is among the documented answers to `op`.
fn documented(op: Op, a: &Answer) -> bool {
    let Answer::Http { status, said } = a else {
        return true;
    };
    let said = said.as_deref().unwrap_or("");
    matches!(
        (op, *status, said),
        (_, 503, "unavailable")
            | (_, 429, "rate_limited")
            | (Op::Issue, 201, _)
            | (Op::Consume, 200, "consumed" | "duplicate")
            | (Op::Result, 200, "recorded")
    )
}

/// Checks a whole run. `issued` are the tokens answered 201; `rows` what
/// Postgres holds for them at the end (every winner must be there with its
/// `request_id`, once the journal has drained).
pub fn check(events: &[Event], issued: &BTreeSet<String>, rows: &Rows) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut winners: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for e in events {
        if !documented(e.op, &e.answer) {
            if e.answer.is(400, "token_invalid") && issued.contains(&e.token) {
                out.push(Violation::RefusedAsForged {
                    token: e.token.clone(),
                    instance: e.instance,
                });
            } else {
                out.push(Violation::Undocumented { event: e.clone() });
            }
        }
        if e.op == Op::Consume && e.answer.is(200, "consumed") {
            if let Some(rid) = &e.rid {
                winners.entry(&e.token).or_default().insert(rid);
            }
        }
    }
    for token in issued {
        let won = winners.get(token.as_str());
        match won.map(|w| w.iter().copied().collect::<Vec<_>>()) {
            None => out.push(Violation::Burned {
                token: token.clone(),
            }),
            Some(w) if w.len() > 1 => out.push(Violation::TwoWinners {
                token: token.clone(),
                rids: w.iter().map(|r| (*r).to_owned()).collect(),
            }),
            Some(w) => {
                let row = rows.get(token);
                let holds =
                    matches!(row, Some((state, Some(rid))) if state == "consumed" && rid == w[0]);
                if !holds {
                    out.push(Violation::WinnerNotInPostgres {
                        token: token.clone(),
                        winner: w[0].to_owned(),
                        row: row.cloned(),
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(token: &str, rid: &str, op: Op, status: u16, said: &str) -> Event {
        Event {
            token: token.into(),
            rid: Some(rid.into()),
            op,
            phase: Phase::Chaos,
            instance: 0,
            at_ms: 0,
            answer: Answer::Http {
                status,
                said: Some(said.into()),
            },
        }
    }

    fn one(token: &str) -> BTreeSet<String> {
        [token.to_owned()].into()
    }

    fn row(rid: &str) -> Rows {
        [(
            "t".to_owned(),
            ("consumed".to_owned(), Some(rid.to_owned())),
        )]
        .into()
    }

    #[test]
    fn a_clean_race_passes() {
        let h = [
            ev("t", "a", Op::Consume, 503, "unavailable"),
            Event {
                answer: Answer::None,
                ..ev("t", "b", Op::Consume, 0, "")
            },
            ev("t", "a", Op::Consume, 200, "consumed"),
            ev("t", "a", Op::Consume, 200, "consumed"),
            ev("t", "b", Op::Consume, 200, "duplicate"),
            ev("t", "a", Op::Result, 200, "recorded"),
        ];
        assert_eq!(check(&h, &one("t"), &row("a")), vec![]);
    }

    #[test]
    fn two_attempts_told_consumed_are_caught() {
        let h = [
            ev("t", "a", Op::Consume, 200, "consumed"),
            ev("t", "b", Op::Consume, 200, "consumed"),
        ];
        assert_eq!(
            check(&h, &one("t"), &row("a")),
            vec![Violation::TwoWinners {
                token: "t".into(),
                rids: vec!["a".into(), "b".into()]
            }]
        );
    }

    #[test]
    fn a_token_nobody_won_is_burned() {
        let h = [
            ev("t", "a", Op::Consume, 200, "duplicate"),
            ev("t", "b", Op::Consume, 200, "duplicate"),
        ];
        assert_eq!(
            check(&h, &one("t"), &Rows::new()),
            vec![Violation::Burned { token: "t".into() }]
        );
    }

    #[test]
    fn a_winner_postgres_does_not_hold_is_caught() {
        let h = [ev("t", "a", Op::Consume, 200, "consumed")];
        for rows in [Rows::new(), row("b")] {
            let v = check(&h, &one("t"), &rows);
            assert!(
                matches!(&v[..], [Violation::WinnerNotInPostgres { winner, .. }] if winner == "a"),
                "{v:?}"
            );
        }
    }

    #[test]
    fn a_real_token_refused_as_forged_and_other_answers_are_caught() {
        let h = [
            ev("t", "a", Op::Consume, 400, "token_invalid"),
            ev("t", "a", Op::Consume, 500, "internal"),
            ev("t", "b", Op::Consume, 409, "token_already_used"),
            ev("t", "b", Op::Consume, 200, "consumed"),
        ];
        let v = check(&h, &one("t"), &row("b"));
        assert_eq!(v.len(), 3, "{v:?}");
        assert!(matches!(v[0], Violation::RefusedAsForged { .. }));
        assert!(matches!(v[1], Violation::Undocumented { .. }));
        assert!(matches!(v[2], Violation::Undocumented { .. }));
    }
}

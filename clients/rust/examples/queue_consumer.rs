//! A queue consumer that processes each message exactly once although the
//! queue delivers at least once: the message id is the ledger key.
//!
//! Against a local ledger (`cargo run --release -- serve` at the repository
//! root):
//!
//! ```sh
//! cargo run -p idempotency-ledger-client --example queue_consumer
//! ```
//!
//! It puts 5 messages on an in-memory queue that delivers every one of them
//! twice, to two workers at once, and whose "inventory service" refuses the
//! first try of message 3 before anything happened. Each message is applied
//! once; its redeliveries are acknowledged from the ledger's record. The
//! message ids carry a run id, so each run starts afresh; set `QUEUE_RUN` to
//! a previous run's id to watch every message come back `Completed`.
//! `LEDGER_URL`, `LEDGER_API_KEY` and `LEDGER_BIZ_TYPE` override the defaults.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_ledger_client::{
    fingerprint, Client, GuardError, Guarded, KeyConsumeRequest, SideEffects, StepError,
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

#[derive(Debug, Clone)]
struct Message {
    id: String,
    payload: String,
}

/// What applying a message produced: recorded in the ledger, replayed to its
/// redeliveries.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Applied {
    stock_reserved: u32,
}

#[derive(Debug)]
enum ApplyError {
    InventoryRefused,
}

impl std::fmt::Display for ApplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the inventory service refused the reservation")
    }
}

/// What the worker tells the queue.
enum Ack {
    Done,
    RetryLater,
    DeadLetter,
}

struct Consumer {
    ledger: Client,
    biz_type: String,
    /// Messages whose side effect happened, to show it happens once.
    applied: Mutex<Vec<String>>,
    refused_once: Mutex<HashSet<String>>,
}

impl Consumer {
    async fn handle(&self, msg: &Message) -> Ack {
        let request = KeyConsumeRequest::new(&self.biz_type, &msg.id)
            .with_fingerprint(fingerprint(msg.payload.as_bytes()));
        let outcome = self
            .ledger
            .guard_key(request)
            .run(|| async {
                // A refusal before anything happened: the key is given back.
                self.check_inventory(msg).before_side_effects()?;
                self.applied.lock().expect("lock").push(msg.id.clone());
                Ok::<_, StepError<ApplyError>>(Applied { stock_reserved: 1 })
            })
            .await;
        match outcome {
            Ok(Guarded::Ran(a)) => {
                println!("{}: applied ({} reserved)", msg.id, a.stock_reserved);
                Ack::Done
            }
            Ok(Guarded::Completed(_)) => {
                println!("{}: a redelivery, already applied: acknowledged", msg.id);
                Ack::Done
            }
            Ok(Guarded::InProgress { .. }) => {
                println!("{}: another worker is on it: try again later", msg.id);
                Ack::RetryLater
            }
            Ok(Guarded::Uncertain { .. }) => {
                // The other worker ran past its processing lease: nobody knows
                // whether the message was applied. A human decides.
                println!(
                    "{}: outcome unknown (lease ran out): to the dead-letter queue",
                    msg.id
                );
                Ack::DeadLetter
            }
            Err(GuardError::BeforeSideEffects { error, .. }) => {
                println!("{}: {error}: released, try again later", msg.id);
                Ack::RetryLater
            }
            Err(GuardError::Consume(e)) if e.is_retryable() => {
                println!("{}: ledger unavailable ({e}): try again later", msg.id);
                Ack::RetryLater
            }
            Err(e) => {
                println!("{}: {e}: to the dead-letter queue", msg.id);
                Ack::DeadLetter
            }
        }
    }

    fn check_inventory(&self, msg: &Message) -> Result<(), ApplyError> {
        let first_try = self
            .refused_once
            .lock()
            .expect("lock")
            .insert(msg.id.clone());
        if msg.id.ends_with("-3") && first_try {
            Err(ApplyError::InventoryRefused)
        } else {
            Ok(())
        }
    }
}

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // The client logs through `tracing`: the layer's refusals, retries at debug.
    tracing_subscriber::fmt().init();
    let ledger = Client::new(
        &env("LEDGER_URL", "http://127.0.0.1:8080"),
        &env("LEDGER_API_KEY", "dev-payments-key"),
    )?;
    let run = env("QUEUE_RUN", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    println!("run {run}");
    let consumer = Arc::new(Consumer {
        ledger,
        biz_type: env("LEDGER_BIZ_TYPE", "order"),
        applied: Mutex::new(Vec::new()),
        refused_once: Mutex::new(HashSet::new()),
    });

    // At least once: every message is delivered twice.
    let (tx, rx) = mpsc::unbounded_channel::<Message>();
    let messages: Vec<_> = (1..=5)
        .map(|i| Message {
            id: format!("msg-{run}-{i}"),
            payload: format!("reserve sku-{i}"),
        })
        .collect();
    let pending = Arc::new(AtomicUsize::new(messages.len() * 2));
    for msg in messages.iter().chain(messages.iter()) {
        tx.send(msg.clone())?;
    }
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (rx, tx, consumer, pending) =
                (rx.clone(), tx.clone(), consumer.clone(), pending.clone());
            tokio::spawn(async move {
                while pending.load(Ordering::SeqCst) > 0 {
                    let next = tokio::time::timeout(Duration::from_millis(200), async {
                        rx.lock().await.recv().await
                    });
                    let Ok(Some(msg)) = next.await else { continue };
                    match consumer.handle(&msg).await {
                        Ack::Done | Ack::DeadLetter => {
                            pending.fetch_sub(1, Ordering::SeqCst);
                        }
                        Ack::RetryLater => {
                            let tx = tx.clone();
                            tokio::spawn(async move {
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                let _ = tx.send(msg);
                            });
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await?;
    }
    let applied = consumer.applied.lock().expect("lock").clone();
    println!(
        "{} deliveries, {} side effects: {:?}",
        messages.len() * 2,
        applied.len(),
        applied
    );
    Ok(())
}

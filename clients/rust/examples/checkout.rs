//! A small checkout service: `POST /checkout` charges a cart once per
//! `Idempotency-Key`, however often the client retries it.
//!
//! Against a local ledger (`cargo run --release -- serve` at the repository
//! root), with the development API key:
//!
//! ```sh
//! cargo run -p idempotency-ledger-client --example checkout
//! curl -i -X POST localhost:3000/checkout -H 'Idempotency-Key: "k-1"' \
//!      -H 'content-type: application/json' -d '{"cart":"c-1","amount_minor":1000}'
//! ```
//!
//! The same curl again answers the stored response with
//! `Idempotent-Replayed: true`; another body with `k-1` answers 422; no key
//! answers 400. `LEDGER_URL`, `LEDGER_API_KEY`, `LEDGER_BIZ_TYPE` and
//! `CHECKOUT_LISTEN` override the defaults.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotency_ledger_client::{Client, IdempotencyLayer};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Deserialize)]
struct Checkout {
    cart: String,
    amount_minor: i64,
}

/// Stands in for a payment gateway: each call is a real charge.
#[derive(Default)]
struct Gateway {
    charges: AtomicU64,
}

async fn checkout(
    State(gateway): State<Arc<Gateway>>,
    Json(order): Json<Checkout>,
) -> (StatusCode, Json<Value>) {
    if order.amount_minor <= 0 {
        // A 4xx is stored too: the retry gets the same refusal.
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"error": "amount_minor must be positive"})),
        );
    }
    let n = gateway.charges.fetch_add(1, Ordering::SeqCst) + 1;
    println!(
        "charging {} minor units for cart {}",
        order.amount_minor, order.cart
    );
    (
        StatusCode::CREATED,
        Json(json!({"charge_id": format!("ch_{n}"), "cart": order.cart})),
    )
}

async fn charges(State(gateway): State<Arc<Gateway>>) -> Json<Value> {
    Json(json!({"charges": gateway.charges.load(Ordering::SeqCst)}))
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
    let keyed = Router::new().route("/checkout", post(checkout)).layer(
        IdempotencyLayer::new(ledger, env("LEDGER_BIZ_TYPE", "order"))
            // The end user's keys are theirs alone. Here the user is the
            // `X-User` header (a stand-in for your authentication: take
            // it from what your auth middleware established).
            .scope_by(|req| {
                req.headers()
                    .get("x-user")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            }),
    );
    let app = Router::new()
        .route("/charges", get(charges))
        .merge(keyed)
        .with_state(Arc::new(Gateway::default()));
    let listen = env("CHECKOUT_LISTEN", "127.0.0.1:3000");
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("checkout listening on http://{listen} (POST /checkout, GET /charges)");
    axum::serve(listener, app).await?;
    Ok(())
}

//! Order statements. An event runs in one transaction: [`lock`] reads the
//! order `FOR UPDATE` together with what is known of the token, the caller
//! decides with `domain::order::transition`, and [`write_event`] consumes the token,
//! moves the order and writes the event and audit rows in one statement.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Postgres, Row, Transaction};

use super::tokens::TokenRecord;
use super::DurableError;
use crate::domain::order::OrderState;
use crate::domain::AuditKind;
use crate::token::VerifiedToken;

/// One event of an order, oldest first in [`get`].
#[derive(Debug, Clone, PartialEq)]
pub struct OrderEventRecord {
    /// `order.created`, `order.paid`, `order.refunded` or `order.closed`.
    pub kind: AuditKind,
    pub token: Option<String>,
    pub amount_minor: i64,
    pub at: DateTime<Utc>,
}

fn event_kind(text: &str) -> Result<AuditKind, sqlx::Error> {
    AuditKind::parse(text)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown order event kind `{text}`").into()))
}

#[derive(Debug, Clone)]
pub struct OrderRow {
    pub order_id: String,
    pub client: String,
    pub subject: String,
    pub state: OrderState,
    pub amount_minor: i64,
    pub refunded_minor: i64,
    pub currency: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

fn order_row(r: &PgRow) -> Result<OrderRow, sqlx::Error> {
    Ok(OrderRow {
        order_id: r.try_get("order_id")?,
        client: r.try_get("client")?,
        subject: r.try_get("subject")?,
        state: r.try_get("state")?,
        amount_minor: r.try_get("amount_minor")?,
        refunded_minor: r.try_get("refunded_minor")?,
        currency: r.try_get("currency")?,
        created_at: r.try_get("created_at")?,
        updated_at: r.try_get("updated_at")?,
    })
}

#[derive(Debug, Clone)]
pub struct NewOrder<'a> {
    pub order_id: &'a str,
    pub client: &'a str,
    pub subject: &'a str,
    pub amount_minor: i64,
    pub currency: &'a str,
}

/// Inserts the order with its `order.created` event and audit row; `false`
/// when the id is taken (nothing written).
pub async fn create(pool: &PgPool, o: &NewOrder<'_>) -> Result<bool, DurableError> {
    let row = super::fetch_one(pool, || {
        sqlx::query(
            r#"
        WITH ins AS (
            INSERT INTO orders (order_id, client, subject, amount_minor, currency)
            VALUES ($1, $2, $3, $4, $5)
            ON CONFLICT (order_id) DO NOTHING
            RETURNING order_id, created_at
        ), ev AS (
            INSERT INTO order_events (order_id, kind, amount_minor, at)
            SELECT order_id, 'order.created', $4, created_at FROM ins
        ), audit AS (
            INSERT INTO audit_events (at, kind, subject, order_id, client, detail)
            SELECT created_at, 'order.created', $3, order_id, $2,
                   jsonb_build_object('amount_minor', $4, 'currency', $5::text)
              FROM ins
        )
        SELECT count(*) AS n FROM ins
        "#,
        )
        .bind(o.order_id)
        .bind(o.client)
        .bind(o.subject)
        .bind(o.amount_minor)
        .bind(o.currency)
    })
    .await?;
    Ok(row.try_get::<i64, _>("n")? == 1)
}

/// The order and its events, oldest first; one round trip.
pub async fn get(
    pool: &PgPool,
    order_id: &str,
) -> Result<Option<(OrderRow, Vec<OrderEventRecord>)>, DurableError> {
    let row = super::fetch_optional(pool, || {
        sqlx::query(
        r#"
        SELECT o.order_id, o.client, o.subject, o.state, o.amount_minor, o.refunded_minor, o.currency,
               o.created_at, o.updated_at,
               coalesce(array_agg(e.kind::text ORDER BY e.id) FILTER (WHERE e.id IS NOT NULL), '{}') AS kinds,
               coalesce(array_agg(e.token ORDER BY e.id) FILTER (WHERE e.id IS NOT NULL), '{}') AS tokens,
               coalesce(array_agg(e.amount_minor ORDER BY e.id) FILTER (WHERE e.id IS NOT NULL), '{}') AS amounts,
               coalesce(array_agg(e.at ORDER BY e.id) FILTER (WHERE e.id IS NOT NULL), '{}') AS ats
          FROM orders o LEFT JOIN order_events e ON e.order_id = o.order_id
         WHERE o.order_id = $1
         GROUP BY o.order_id
        "#,
    )
    .bind(order_id)
    })
    .await?;
    let Some(r) = row else { return Ok(None) };
    let order = order_row(&r)?;
    let kinds: Vec<String> = r.try_get("kinds")?;
    let tokens: Vec<Option<String>> = r.try_get("tokens")?;
    let amounts: Vec<i64> = r.try_get("amounts")?;
    let ats: Vec<DateTime<Utc>> = r.try_get("ats")?;
    let events = kinds
        .into_iter()
        .zip(tokens)
        .zip(amounts)
        .zip(ats)
        .map(|(((kind, token), amount_minor), at)| {
            Ok(OrderEventRecord {
                kind: event_kind(&kind)?,
                token,
                amount_minor,
                at,
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    Ok(Some((order, events)))
}

/// The event a token was already used for.
#[derive(Debug, Clone)]
pub struct UsedBy {
    pub order_id: String,
    pub kind: Option<AuditKind>,
    pub request_id: Option<String>,
    /// The event's amount (a refund's; the order's for pay and close).
    pub amount_minor: i64,
}

/// What Postgres knows of a token presented for an order event.
#[derive(Debug, Clone, Default)]
pub struct TokenUsage {
    /// The order event it already applied, if any.
    pub used_by: Option<UsedBy>,
    /// Consumed (by a plain consume or an order event).
    pub consumed: bool,
    pub fingerprint: Option<String>,
    /// Its expiry is still ahead of Postgres's `now()`.
    pub live: bool,
}

/// The locked order and what Postgres knew of the token at the same time.
#[derive(Debug, Clone)]
pub struct LockedOrder {
    pub order: OrderRow,
    pub usage: TokenUsage,
}

fn usage_of(r: &PgRow) -> Result<TokenUsage, sqlx::Error> {
    let used_order: Option<String> = r.try_get("used_order")?;
    let used_by = match used_order {
        Some(order_id) => Some(UsedBy {
            order_id,
            kind: r
                .try_get::<Option<String>, _>("used_kind")?
                .as_deref()
                .map(event_kind)
                .transpose()?,
            request_id: r.try_get("used_request_id")?,
            amount_minor: r
                .try_get::<Option<i64>, _>("used_amount")?
                .unwrap_or_default(),
        }),
        None => None,
    };
    Ok(TokenUsage {
        used_by,
        consumed: r
            .try_get::<Option<bool>, _>("token_consumed")?
            .unwrap_or(false),
        fingerprint: r.try_get("token_fingerprint")?,
        live: r.try_get::<Option<bool>, _>("token_live")?.unwrap_or(false),
    })
}

fn expiry(token: &VerifiedToken) -> DateTime<Utc> {
    DateTime::<Utc>::from_timestamp(i64::from(token.claims.exp), 0)
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// A fresh read of the token's usage (a new snapshot, inside the transaction).
pub async fn token_usage(
    tx: &mut Transaction<'_, Postgres>,
    token: &VerifiedToken,
) -> Result<TokenUsage, DurableError> {
    let row = sqlx::query(
        r#"
        SELECT t.state = 'consumed' AS token_consumed, t.fingerprint AS token_fingerprint,
               coalesce(t.expires_at, $2) > now() AS token_live,
               e.order_id AS used_order, e.kind::text AS used_kind, e.request_id AS used_request_id,
               e.amount_minor AS used_amount
          FROM (SELECT $1::bigint AS id) k
          LEFT JOIN tokens t ON t.id = k.id
          LEFT JOIN order_events e ON e.token_id = k.id
        "#,
    )
    .bind(token.claims.id.as_i64())
    .bind(expiry(token))
    .fetch_one(&mut **tx)
    .await?;
    Ok(usage_of(&row)?)
}

/// Locks the order row for this transaction and reads the token's state.
pub async fn lock(
    tx: &mut Transaction<'_, Postgres>,
    order_id: &str,
    token: &VerifiedToken,
) -> Result<Option<LockedOrder>, DurableError> {
    let row = sqlx::query(
        r#"
        SELECT o.order_id, o.client, o.subject, o.state, o.amount_minor, o.refunded_minor, o.currency,
               o.created_at, o.updated_at,
               t.state = 'consumed' AS token_consumed, t.fingerprint AS token_fingerprint,
               coalesce(t.expires_at, $3) > now() AS token_live,
               e.order_id AS used_order, e.kind::text AS used_kind, e.request_id AS used_request_id,
               e.amount_minor AS used_amount
          FROM orders o
          LEFT JOIN tokens t ON t.id = $2
          LEFT JOIN order_events e ON e.token_id = $2
         WHERE o.order_id = $1
           FOR UPDATE OF o
        "#,
    )
    .bind(order_id)
    .bind(token.claims.id.as_i64())
    .bind(expiry(token))
    .fetch_optional(&mut **tx)
    .await?;
    let Some(r) = row else { return Ok(None) };
    Ok(Some(LockedOrder {
        order: order_row(&r)?,
        usage: usage_of(&r)?,
    }))
}

/// What an order event changes, besides consuming its token.
#[derive(Debug, Clone)]
pub struct OrderChange<'a> {
    pub order_id: &'a str,
    /// `order.paid`, `order.refunded` or `order.closed`.
    pub kind: AuditKind,
    pub next_state: OrderState,
    pub refunded_minor: i64,
    /// The event's amount (the refund's, or the order's for pay and close).
    pub amount_minor: i64,
    pub fingerprint: Option<&'a str>,
    pub request_id: Option<&'a str>,
    pub reason: Option<&'a str>,
}

/// Consumes the token (`r`) for this order and applies the event, in one
/// statement. `false` when the token could not be claimed (consumed elsewhere
/// since [`lock`], or expired): nothing was written and the caller rolls back.
pub async fn write_event(
    tx: &mut Transaction<'_, Postgres>,
    r: &TokenRecord,
    w: &OrderChange<'_>,
) -> Result<Option<Claimed>, DurableError> {
    let row = sqlx::query(
        r#"
        WITH claim AS (
            INSERT INTO tokens AS t (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                                     state, gen, consumed_at, fingerprint, request_id, order_id)
            SELECT $1, $2, $3, $4::durability, $5, $6, $7, $8, 'consumed', 1, now(), $9, $10, $11
             WHERE $8 > now()
            ON CONFLICT (id) DO UPDATE
               SET state = 'consumed', gen = t.gen + 1, consumed_at = now(),
                   fingerprint = EXCLUDED.fingerprint, request_id = EXCLUDED.request_id,
                   order_id = EXCLUDED.order_id
             WHERE t.state = 'issued' AND t.expires_at > now()
            RETURNING t.consumed_at, t.gen
        ), upd AS (
            UPDATE orders SET state = $12, refunded_minor = $13, updated_at = now()
             WHERE order_id = $11 AND EXISTS (SELECT 1 FROM claim)
            RETURNING order_id
        ), ev AS (
            INSERT INTO order_events (order_id, kind, token_id, token, amount_minor, request_id, reason)
            SELECT $11, $14::order_event_kind, $1, $2, $15, $10, $16 FROM upd
            RETURNING at
        ), audit AS (
            INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, order_id, client, detail)
            SELECT ev.at, $14::audit_kind, $1, $2, $5, $3, $11, $6,
                   jsonb_strip_nulls(jsonb_build_object('amount_minor', $15, 'state', $12::text,
                       'refunded_minor', $13, 'request_id', $10::text, 'fingerprint', $9::text, 'reason', $16::text))
              FROM ev
        )
        SELECT (SELECT consumed_at FROM claim) AS consumed_at, (SELECT gen FROM claim) AS gen,
               (SELECT count(*) FROM upd) AS updated
        "#,
    )
    .bind(r.id)
    .bind(&r.token)
    .bind(&r.biz_type)
    .bind(r.durability.as_str())
    .bind(&r.subject)
    .bind(&r.client)
    .bind(r.issued_at)
    .bind(r.expires_at)
    .bind(w.fingerprint)
    .bind(w.request_id)
    .bind(w.order_id)
    .bind(w.next_state)
    .bind(w.refunded_minor)
    .bind(w.kind.as_str())
    .bind(w.amount_minor)
    .bind(w.reason)
    .fetch_one(&mut **tx)
    .await?;
    let consumed_at: Option<DateTime<Utc>> = row.try_get("consumed_at")?;
    let gen: Option<i64> = row.try_get("gen")?;
    let updated: i64 = row.try_get("updated")?;
    Ok(match (consumed_at, gen, updated) {
        (Some(consumed_at), Some(gen), 1) => Some(Claimed { consumed_at, gen }),
        _ => None,
    })
}

/// The token an order event consumed: when, and the generation it is at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimed {
    pub consumed_at: DateTime<Utc>,
    pub gen: i64,
}

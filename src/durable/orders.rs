//! Order statements. An event runs in one transaction: [`lock`] reads the
//! order `FOR UPDATE` together with what is known of the token, the caller
//! decides with `domain::order::transition`, and [`write_event`] consumes the token,
//! moves the order and writes the event and audit rows in one statement.
//! A batch of events on distinct orders (`crate::orders`' group commit) runs
//! the same steps over arrays: [`lock_many`], [`token_usage_many`],
//! [`write_events`], then [`get_many`] for the answers.

use std::collections::HashMap;

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
    Ok(Some(order_with_events(&r)?))
}

/// A row of [`get`] or [`get_many`]: the order and its events.
fn order_with_events(r: &PgRow) -> Result<(OrderRow, Vec<OrderEventRecord>), sqlx::Error> {
    let order = order_row(r)?;
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
    Ok((order, events))
}

/// [`get`] for several orders in one round trip: those that exist, by id.
/// (The statement repeats `get`'s: `scripts/bench` reads each function's
/// SQL literal from this file.)
pub async fn get_many(
    pool: &PgPool,
    order_ids: &[&str],
) -> Result<HashMap<String, (OrderRow, Vec<OrderEventRecord>)>, DurableError> {
    let rows = super::fetch_all(pool, || {
        sqlx::query(
            r#"
        SELECT o.order_id, o.client, o.subject, o.state, o.amount_minor, o.refunded_minor, o.currency,
               o.created_at, o.updated_at,
               coalesce(array_agg(e.kind::text ORDER BY e.id) FILTER (WHERE e.id IS NOT NULL), '{}') AS kinds,
               coalesce(array_agg(e.token ORDER BY e.id) FILTER (WHERE e.id IS NOT NULL), '{}') AS tokens,
               coalesce(array_agg(e.amount_minor ORDER BY e.id) FILTER (WHERE e.id IS NOT NULL), '{}') AS amounts,
               coalesce(array_agg(e.at ORDER BY e.id) FILTER (WHERE e.id IS NOT NULL), '{}') AS ats
          FROM orders o LEFT JOIN order_events e ON e.order_id = o.order_id
         WHERE o.order_id = ANY($1)
         GROUP BY o.order_id
        "#,
        )
        .bind(order_ids)
    })
    .await?;
    let mut found = HashMap::with_capacity(rows.len());
    for r in &rows {
        let (order, events) = order_with_events(r)?;
        found.insert(order.order_id.clone(), (order, events));
    }
    Ok(found)
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
    /// The fingerprint it was consumed with: its row's, or once its row has
    /// gone with retention (V19), its order event's.
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
        SELECT t.state = 'consumed' AS token_consumed, coalesce(t.fingerprint, e.fingerprint) AS token_fingerprint,
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
               t.state = 'consumed' AS token_consumed, coalesce(t.fingerprint, e.fingerprint) AS token_fingerprint,
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
            INSERT INTO order_events (order_id, kind, token_id, token, amount_minor, request_id, reason,
                                      fingerprint)
            SELECT $11, $14::order_event_kind, $1, $2, $15, $10, $16, $9 FROM upd
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

// ---- batches of events on distinct orders (`crate::orders::batch`) -------

/// An order to lock in [`lock_many`], with the token its event carries.
#[derive(Debug, Clone, Copy)]
pub struct LockItem<'a> {
    pub order_id: &'a str,
    pub token: &'a VerifiedToken,
}

/// [`lock`] for several events on distinct orders, in one statement: locks
/// every order that exists, in `order_id` order (so batches never deadlock
/// with each other, nor with [`lock`], which takes one), and reads each
/// event's token as [`lock`] does. Per item, in the items' order: the
/// locked order, or `None` when there is no such order.
pub async fn lock_many(
    tx: &mut Transaction<'_, Postgres>,
    items: &[LockItem<'_>],
) -> Result<Vec<Option<LockedOrder>>, DurableError> {
    let order_ids: Vec<&str> = items.iter().map(|i| i.order_id).collect();
    let token_ids: Vec<i64> = items.iter().map(|i| i.token.claims.id.as_i64()).collect();
    let expiries: Vec<DateTime<Utc>> = items.iter().map(|i| expiry(i.token)).collect();
    // Postgres locks the rows as the sort hands them on (the locking clause
    // applies after ORDER BY), and re-reads each one it waited for. The ids
    // (and the tokens') are also a condition on each table itself
    // (`= ANY(...)`), so that a merge join, which the planner may pick for
    // large tables, scans only the batch's rows in the index and not every
    // row sorting before them.
    let rows = sqlx::query(
        r#"
        SELECT k.i, o.order_id, o.client, o.subject, o.state, o.amount_minor, o.refunded_minor, o.currency,
               o.created_at, o.updated_at,
               t.state = 'consumed' AS token_consumed, coalesce(t.fingerprint, e.fingerprint) AS token_fingerprint,
               coalesce(t.expires_at, k.exp) > now() AS token_live,
               e.order_id AS used_order, e.kind::text AS used_kind, e.request_id AS used_request_id,
               e.amount_minor AS used_amount
          FROM UNNEST($1::text[], $2::bigint[], $3::timestamptz[]) WITH ORDINALITY AS k(order_id, token_id, exp, i)
          JOIN orders o ON o.order_id = k.order_id AND o.order_id = ANY($1::text[])
          LEFT JOIN tokens t ON t.id = k.token_id AND t.id = ANY($2::bigint[])
          LEFT JOIN order_events e ON e.token_id = k.token_id AND e.token_id = ANY($2::bigint[])
         ORDER BY o.order_id
           FOR UPDATE OF o
        "#,
    )
    .bind(&order_ids)
    .bind(&token_ids)
    .bind(&expiries)
    .fetch_all(&mut **tx)
    .await?;
    let mut locked: Vec<Option<LockedOrder>> = vec![None; items.len()];
    for r in &rows {
        let slot = ordinal(r, items.len())?;
        locked[slot] = Some(LockedOrder {
            order: order_row(r)?,
            usage: usage_of(r)?,
        });
    }
    Ok(locked)
}

/// The item a row of an `UNNEST ... WITH ORDINALITY` belongs to (0-based).
fn ordinal(r: &PgRow, items: usize) -> Result<usize, sqlx::Error> {
    let i: i64 = r.try_get("i")?;
    usize::try_from(i - 1)
        .ok()
        .filter(|&i| i < items)
        .ok_or_else(|| sqlx::Error::Decode(format!("row for item {i} of {items}").into()))
}

/// [`token_usage`] for several tokens in one statement, in their order.
pub async fn token_usage_many(
    tx: &mut Transaction<'_, Postgres>,
    tokens: &[&VerifiedToken],
) -> Result<Vec<TokenUsage>, DurableError> {
    let ids: Vec<i64> = tokens.iter().map(|t| t.claims.id.as_i64()).collect();
    let expiries: Vec<DateTime<Utc>> = tokens.iter().map(|t| expiry(t)).collect();
    let rows = sqlx::query(
        r#"
        SELECT k.i, t.state = 'consumed' AS token_consumed, coalesce(t.fingerprint, e.fingerprint) AS token_fingerprint,
               coalesce(t.expires_at, k.exp) > now() AS token_live,
               e.order_id AS used_order, e.kind::text AS used_kind, e.request_id AS used_request_id,
               e.amount_minor AS used_amount
          FROM UNNEST($1::bigint[], $2::timestamptz[]) WITH ORDINALITY AS k(id, exp, i)
          LEFT JOIN tokens t ON t.id = k.id AND t.id = ANY($1::bigint[])
          LEFT JOIN order_events e ON e.token_id = k.id AND e.token_id = ANY($1::bigint[])
        "#,
    )
    .bind(&ids)
    .bind(&expiries)
    .fetch_all(&mut **tx)
    .await?;
    let mut usage: Vec<Option<TokenUsage>> = vec![None; tokens.len()];
    for r in &rows {
        let slot = ordinal(r, tokens.len())?;
        usage[slot] = Some(usage_of(r)?);
    }
    usage
        .into_iter()
        .map(|u| u.ok_or_else(|| sqlx::Error::RowNotFound.into()))
        .collect()
}

/// [`write_event`] for several events on distinct orders (each locked by
/// this transaction) with distinct tokens, in one statement: per item, the
/// same token claim, order change, event row and audit row, each
/// conditional on its own claim. Per item, in the items' order: the claim,
/// or `None` when its token could not be claimed (nothing of that item was
/// written; the others' rows stand).
pub async fn write_events(
    tx: &mut Transaction<'_, Postgres>,
    items: &[(&TokenRecord, &OrderChange<'_>)],
) -> Result<Vec<Option<Claimed>>, DurableError> {
    let n = items.len();
    let mut ids = Vec::with_capacity(n);
    let mut toks = Vec::with_capacity(n);
    let mut biz = Vec::with_capacity(n);
    let mut dur = Vec::with_capacity(n);
    let mut subjects = Vec::with_capacity(n);
    let mut clients = Vec::with_capacity(n);
    let mut issued = Vec::with_capacity(n);
    let mut expires = Vec::with_capacity(n);
    let mut fps = Vec::with_capacity(n);
    let mut rids = Vec::with_capacity(n);
    let mut orders = Vec::with_capacity(n);
    let mut states = Vec::with_capacity(n);
    let mut refunded = Vec::with_capacity(n);
    let mut kinds = Vec::with_capacity(n);
    let mut amounts = Vec::with_capacity(n);
    let mut reasons = Vec::with_capacity(n);
    for (r, w) in items {
        ids.push(r.id);
        toks.push(r.token.as_str());
        biz.push(r.biz_type.as_str());
        dur.push(r.durability.as_str());
        subjects.push(r.subject.as_str());
        clients.push(r.client.as_str());
        issued.push(r.issued_at);
        expires.push(r.expires_at);
        fps.push(w.fingerprint);
        rids.push(w.request_id);
        orders.push(w.order_id);
        states.push(w.next_state.as_str());
        refunded.push(w.refunded_minor);
        kinds.push(w.kind.as_str());
        amounts.push(w.amount_minor);
        reasons.push(w.reason);
    }
    // The statement of `write_event`, per row of `r`; tokens are claimed in
    // id order, as every other statement that takes token rows does.
    let rows = sqlx::query(
        r#"
        WITH r AS (
            SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                                 $7::timestamptz[], $8::timestamptz[], $9::text[], $10::text[], $11::text[],
                                 $12::text[], $13::bigint[], $14::text[], $15::bigint[], $16::text[])
                       AS r(id, token, biz_type, durability, subject, client, issued_at, expires_at,
                            fingerprint, request_id, order_id, next_state, refunded_minor, kind,
                            amount_minor, reason)
        ), claim AS (
            INSERT INTO tokens AS t (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                                     state, gen, consumed_at, fingerprint, request_id, order_id)
            SELECT id, token, biz_type, durability::durability, subject, client, issued_at, expires_at,
                   'consumed', 1, now(), fingerprint, request_id, order_id
              FROM r
             WHERE expires_at > now()
             ORDER BY id
            ON CONFLICT (id) DO UPDATE
               SET state = 'consumed', gen = t.gen + 1, consumed_at = now(),
                   fingerprint = EXCLUDED.fingerprint, request_id = EXCLUDED.request_id,
                   order_id = EXCLUDED.order_id
             WHERE t.state = 'issued' AND t.expires_at > now()
            RETURNING t.id, t.consumed_at, t.gen
        ), upd AS (
            UPDATE orders o
               SET state = r.next_state::order_state, refunded_minor = r.refunded_minor, updated_at = now()
              FROM r JOIN claim c ON c.id = r.id
             WHERE o.order_id = r.order_id
            RETURNING o.order_id
        ), ev AS (
            INSERT INTO order_events (order_id, kind, token_id, token, amount_minor, request_id, reason,
                                      fingerprint)
            SELECT r.order_id, r.kind::order_event_kind, r.id, r.token, r.amount_minor, r.request_id, r.reason,
                   r.fingerprint
              FROM r JOIN upd ON upd.order_id = r.order_id
             ORDER BY r.order_id
            RETURNING token_id, at
        ), audit AS (
            INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, order_id, client, detail)
            SELECT ev.at, r.kind::audit_kind, r.id, r.token, r.subject, r.biz_type, r.order_id, r.client,
                   jsonb_strip_nulls(jsonb_build_object('amount_minor', r.amount_minor, 'state', r.next_state,
                       'refunded_minor', r.refunded_minor, 'request_id', r.request_id,
                       'fingerprint', r.fingerprint, 'reason', r.reason))
              FROM ev JOIN r ON r.id = ev.token_id
             ORDER BY r.order_id
        )
        SELECT c.id, c.consumed_at, c.gen,
               (SELECT count(*) FROM upd WHERE upd.order_id = r.order_id) AS updated
          FROM claim c JOIN r ON r.id = c.id
        "#,
    )
    .bind(&ids)
    .bind(&toks)
    .bind(&biz)
    .bind(&dur)
    .bind(&subjects)
    .bind(&clients)
    .bind(&issued)
    .bind(&expires)
    .bind(&fps)
    .bind(&rids)
    .bind(&orders)
    .bind(&states)
    .bind(&refunded)
    .bind(&kinds)
    .bind(&amounts)
    .bind(&reasons)
    .fetch_all(&mut **tx)
    .await?;
    let mut claimed: HashMap<i64, Claimed> = HashMap::with_capacity(rows.len());
    for row in &rows {
        let id: i64 = row.try_get("id")?;
        let updated: i64 = row.try_get("updated")?;
        if updated != 1 {
            // A claim without its order change must not commit; the caller
            // rolls back on an error.
            return Err(DurableError::Other(sqlx::Error::Decode(
                format!("token {id} claimed for an order that was not updated").into(),
            )));
        }
        claimed.insert(
            id,
            Claimed {
                consumed_at: row.try_get("consumed_at")?,
                gen: row.try_get("gen")?,
            },
        );
    }
    Ok(ids.iter().map(|id| claimed.remove(id)).collect())
}

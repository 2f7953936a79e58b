//! Client-key statements (`/v1/keys`). A key lives in `tokens` (see
//! migration V6): its result, release, journal apply, reconciliation and
//! purge are the token statements'. What differs is the consume: the first
//! consume of a key creates its row, and the unique index on
//! (client, biz_type, key, id) decides first use versus duplicate, in one
//! statement with its `key.consumed` audit row (the id is derived from the
//! other three, and V16's partitioned `tokens` needs it in every unique
//! index). Durable consumes of keys reach [`consume`] through the group
//! commit of [`super::key_batch`], which decides a batch of them in one
//! statement with the same answers.

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row};

use super::tokens::{existing, ConsumeRow, Existing, TokenRecord, TokenState};
use super::DurableError;

/// What a consume of a key found or did, and the key's generation and
/// subject afterwards (`''`: created without one).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyConsumed {
    /// `Won`, or `Existing` (consumed, or released and bound to another
    /// subject); never `Expired`: a key does not expire unconsumed.
    pub row: ConsumeRow,
    pub gen: i64,
    pub subject: String,
}

/// The durable consume of a key: one statement, one round trip. `rec`
/// carries the key's derived id and handle; `rec.subject` is the subject
/// named by this call (`''`: none), which a key created now records and a
/// released key must match to be consumed again.
pub async fn consume(
    pool: &PgPool,
    rec: &TokenRecord,
    fingerprint: Option<&str>,
    request_id: Option<&str>,
) -> Result<KeyConsumed, DurableError> {
    // Two first consumes of one key racing: the arbiter is the key's index,
    // and the other unique index on the same row (the derived id) may meet
    // the concurrent insert first and raise a unique violation instead of
    // taking the conflict path. Nothing was written; sent again, the
    // statement sees the committed row and answers from it.
    let mut tries = 0;
    let row = loop {
        tries += 1;
        match consume_statement(pool, rec, fingerprint, request_id).await {
            Err(e) if tries < 3 && is_unique_violation(&e) => {
                tracing::debug!(error = %e, "racing first consumes of a key: sent again");
            }
            other => break other?,
        }
    };
    match row {
        Some(r) if r.try_get::<bool, _>("won")? => Ok(KeyConsumed {
            row: ConsumeRow::Won {
                consumed_at: r.try_get("consumed_at")?,
            },
            gen: r.try_get("gen")?,
            subject: r.try_get("subject")?,
        }),
        Some(r) => {
            let e = existing(&r)?;
            let subject: String = r.try_get("subject")?;
            if e.state == TokenState::Consumed
                || (!rec.subject.is_empty() && subject != rec.subject)
            {
                return Ok(KeyConsumed {
                    gen: e.gen,
                    row: ConsumeRow::Existing(e),
                    subject,
                });
            }
            // Not claimed, yet our snapshot says issued: a concurrent consume
            // committed after our snapshot was taken (the conflict check
            // waited for it and saw `consumed`). A fresh read tells.
            fresh_read(pool, rec.id).await
        }
        // Nothing claimed and nothing in our snapshot: a concurrent consume
        // inserted the row after our snapshot.
        None => fresh_read(pool, rec.id).await,
    }
}

/// The statement of [`consume`].
async fn consume_statement(
    pool: &PgPool,
    rec: &TokenRecord,
    fingerprint: Option<&str>,
    request_id: Option<&str>,
) -> Result<Option<sqlx::postgres::PgRow>, sqlx::Error> {
    super::fetch_optional(pool, || {
        sqlx::query(
            r#"
        WITH claim AS (
            INSERT INTO tokens AS t (id, token, key, biz_type, durability, subject, client,
                                     issued_at, expires_at, state, gen, consumed_at, fingerprint,
                                     request_id)
            VALUES ($1, $2, $3, $4, $5::durability, $6, $7, now(), now(), 'consumed', 1, now(),
                    $8, $9)
            ON CONFLICT (client, biz_type, key, id) WHERE key IS NOT NULL DO UPDATE
               SET state = 'consumed', gen = t.gen + 1, consumed_at = now(),
                   fingerprint = EXCLUDED.fingerprint, request_id = EXCLUDED.request_id
             WHERE t.state = 'issued' AND ($6 = '' OR t.subject = $6)
            RETURNING t.consumed_at, t.gen, t.subject
        ), audit AS (
            INSERT INTO audit_events (at, kind, token_id, subject, biz_type, client, gen, detail)
            SELECT c.consumed_at, 'key.consumed', $1, nullif(c.subject, ''), $4, $7, c.gen,
                   jsonb_strip_nulls(jsonb_build_object('key', $3::text, 'fingerprint', $8::text,
                                                        'request_id', $9::text))
              FROM claim c
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        )
        SELECT true AS won, 'consumed'::token_state AS state, c.consumed_at,
               NULL::text AS fingerprint, NULL::text AS request_id, NULL::jsonb AS result,
               NULL::text AS order_id, c.consumed_at AS expires_at, c.gen, c.subject,
               NULL::timestamptz AS uncertain_since
          FROM claim c
        UNION ALL
        SELECT false, t.state, t.consumed_at, t.fingerprint, t.request_id, t.result, t.order_id,
               t.expires_at, t.gen, t.subject, t.uncertain_since
          FROM tokens t
         WHERE t.id = $1 AND NOT EXISTS (SELECT 1 FROM claim)
        "#,
        )
        .bind(rec.id)
        .bind(&rec.token)
        .bind(rec.key.as_deref())
        .bind(&rec.biz_type)
        .bind(rec.durability.as_str())
        .bind(&rec.subject)
        .bind(&rec.client)
        .bind(fingerprint)
        .bind(request_id)
    })
    .await
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("23505"))
}

async fn fresh_read(pool: &PgPool, id: i64) -> Result<KeyConsumed, DurableError> {
    match find(pool, id).await? {
        Some((e, subject)) => Ok(KeyConsumed {
            gen: e.gen,
            row: ConsumeRow::Existing(e),
            subject,
        }),
        // Purged between the two reads: the caller retries.
        None => Err(DurableError::Other(sqlx::Error::RowNotFound)),
    }
}

/// A key's state and its subject (`''`: none).
pub async fn find(pool: &PgPool, id: i64) -> Result<Option<(Existing, String)>, DurableError> {
    let row = super::fetch_optional(pool, || {
        sqlx::query(
            "SELECT state, consumed_at, fingerprint, request_id, result, order_id, expires_at,
                    gen, subject
               FROM tokens WHERE id = $1 AND key IS NOT NULL",
        )
        .bind(id)
    })
    .await?;
    let Some(r) = row else { return Ok(None) };
    Ok(Some((existing(&r)?, r.try_get("subject")?)))
}

/// A key as its client reads it (`GET /v1/keys`).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyState {
    pub state: TokenState,
    pub consumed_at: Option<DateTime<Utc>>,
    pub result: Option<serde_json::Value>,
}

impl KeyState {
    /// `issued` (released, consumable again) or `consumed`.
    pub fn label(&self) -> &'static str {
        match self.state {
            TokenState::Issued => "issued",
            TokenState::Consumed => "consumed",
        }
    }
}

/// A key's state for `GET /v1/keys`, from the row of `id`.
pub async fn state(pool: &PgPool, id: i64) -> Result<Option<KeyState>, DurableError> {
    Ok(find(pool, id).await?.map(|(e, _)| KeyState {
        state: e.state,
        consumed_at: e.consumed_at,
        result: e.result,
    }))
}

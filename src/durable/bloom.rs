//! What the issued-token filter ([`crate::issuance::filter`]) needs from Postgres: the
//! notification channel on which issuance batches announce their ids (sent by
//! [`super::tokens::insert_issued`] in the same statement as the records),
//! its payload format, a dedicated listening connection, and the load of ids
//! issued since a given snowflake id.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};

use super::{connect_options, DurableError};
use crate::config::PostgresSettings;

/// The channel. NOTIFY is per database, so fleets on separate databases
/// never hear each other.
pub const CHANNEL: &str = "ledger_issued";

/// Ids per notification: 600 * 8 bytes in base64 is 6400 characters, under
/// Postgres's 8000-byte payload limit.
const IDS_PER_PAYLOAD: usize = 600;

/// Rows per load query (keyset pagination on the primary key, so each
/// statement is short and stays under `statement_timeout`).
const LOAD_PAGE: i64 = 100_000;

/// Payloads for `ids`: each the base64url (no padding) of up to 600 ids as
/// 8-byte big-endian integers.
pub fn encode(ids: &[i64]) -> Vec<String> {
    ids.chunks(IDS_PER_PAYLOAD)
        .map(|chunk| {
            let bytes: Vec<u8> = chunk.iter().flat_map(|id| id.to_be_bytes()).collect();
            URL_SAFE_NO_PAD.encode(bytes)
        })
        .collect()
}

/// The ids of one payload; `None` when it is not one of ours.
pub fn decode(payload: &str) -> Option<Vec<u64>> {
    let bytes = URL_SAFE_NO_PAD.decode(payload).ok()?;
    if bytes.len() % 8 != 0 {
        return None;
    }
    Some(
        bytes
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u64::from_be_bytes(b)
            })
            .collect(),
    )
}

/// A one-connection pool for the listener alone: a notification stream must
/// never share a connection with requests, and a lost connection is replaced
/// by acquiring again.
pub fn listen_pool(settings: &PostgresSettings) -> Result<PgPool, sqlx::Error> {
    Ok(PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(settings.acquire_timeout)
        .connect_lazy_with(connect_options(settings)?))
}

/// Connects and `LISTEN`s, to the ids and to the issuance marks
/// ([`super::marks::CHANNEL`]). A lost connection shows as `Ok(None)` from
/// `try_recv` (no silent reconnect: the caller must reload what it missed).
pub async fn listen(pool: &PgPool) -> Result<PgListener, DurableError> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.eager_reconnect(false);
    listener
        .listen_all([CHANNEL, super::marks::CHANNEL])
        .await?;
    Ok(listener)
}

/// Feeds `sink` every token id `>= from_id`, in pages; returns how many.
pub async fn load_since(
    pool: &PgPool,
    from_id: i64,
    sink: impl FnMut(&[i64]),
) -> Result<u64, DurableError> {
    load_between(pool, from_id, i64::MAX, sink).await
}

/// Feeds `sink` every token id in `from_id..until_id`, in pages; returns how many.
pub async fn load_between(
    pool: &PgPool,
    from_id: i64,
    until_id: i64,
    mut sink: impl FnMut(&[i64]),
) -> Result<u64, DurableError> {
    let mut next = from_id;
    let mut total = 0u64;
    loop {
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM tokens WHERE id >= $1 AND id < $3 ORDER BY id LIMIT $2",
        )
        .bind(next)
        .bind(LOAD_PAGE)
        .bind(until_id)
        .fetch_all(pool)
        .await?;
        total += ids.len() as u64;
        sink(&ids);
        match ids.last() {
            Some(&last) if ids.len() as i64 == LOAD_PAGE => next = last + 1,
            _ => return Ok(total),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_fit() {
        let ids: Vec<i64> = (0..1500).map(|i| i64::MAX - i).collect();
        let payloads = encode(&ids);
        assert_eq!(payloads.len(), 3);
        assert!(payloads.iter().all(|p| p.len() < 8000));
        let back: Vec<u64> = payloads.iter().flat_map(|p| decode(p).unwrap()).collect();
        assert_eq!(back, ids.iter().map(|&i| i as u64).collect::<Vec<_>>());
        assert!(decode("not base64!").is_none());
        assert!(decode("AAAA").is_none());
    }
}

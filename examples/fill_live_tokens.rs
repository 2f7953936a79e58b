//! Fills a ledger's two tiers with many live tokens, for measuring
//! reconciliation at scale (`scripts/reconcile-bench`). Not part of the
//! service and never run by the tests.
//!
//!     cargo run --release --example fill_live_tokens -- --config FILE --count N
//!
//! Writes what issuing would leave behind, without the service: each token's
//! `tokens` row in Postgres (`COPY`, in chunks) and its hash in Redis (state
//! `issued` at generation 0 with its TTL, as `issue.lua` seeds it; pipelined).
//! Half the tokens are of `--durable` (default `order`), half of `--fast`
//! (default `like`); all were issued within the last `--spread` seconds, each
//! living `--life` seconds from its issue (whole seconds, as the service
//! signs them: the tokens of one second share an expiry). `--missing-every K` leaves every K-th token
//! out of Redis (a Redis that lost keys: reconcile re-seeds them).
//! Ids come from worker `--worker` (default 1023), so a live service's ids on
//! the same database never collide with them.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::Parser;
use idempotency_ledger::config::{RedisTopology, Settings};
use idempotency_ledger::domain::BizType;
use idempotency_ledger::token::{Claims, SnowflakeId, TokenCodec};
use sqlx::postgres::PgPoolOptions;

#[derive(Debug, Parser)]
struct Args {
    /// The service's configuration (Postgres, Redis, key prefix, signing key).
    #[arg(long)]
    config: PathBuf,
    /// Tokens in all.
    #[arg(long)]
    count: u64,
    #[arg(long, default_value = "order")]
    durable: String,
    #[arg(long, default_value = "like")]
    fast: String,
    /// Issued within this many seconds before now.
    #[arg(long, default_value_t = 3600)]
    spread: i64,
    /// Each token expires this many seconds after its issue.
    #[arg(long, default_value_t = 7200)]
    life: i64,
    /// Leave every K-th token out of Redis (0: none).
    #[arg(long, default_value_t = 0)]
    missing_every: u64,
    #[arg(long, default_value_t = 1023)]
    worker: u16,
}

/// Rows per `COPY`.
const CHUNK: u64 = 50_000;
/// Tokens per Redis pipeline.
const PIPELINE: usize = 2_000;

struct Token<'a> {
    id: i64,
    /// Expiry, Unix seconds.
    exp: u32,
    text: String,
    biz: &'a str,
    durability: &'static str,
    subject: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings = Settings::load(Some(&args.config)).context("loading the configuration")?;
    let RedisTopology::Standalone(redis_url) = &settings.redis.topology else {
        bail!("a standalone Redis only");
    };
    let codec = TokenCodec::new(settings.tokens.signing_keys.clone());
    let durable_biz = BizType::parse(&args.durable).map_err(|_| anyhow::anyhow!("--durable"))?;
    let fast_biz = BizType::parse(&args.fast).map_err(|_| anyhow::anyhow!("--fast"))?;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&settings.postgres.url)
        .await
        .context("connecting to Postgres")?;
    let redis = redis::Client::open(redis_url.as_str())?;
    // No response timeout: a pipeline of thousands may take a while.
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    let mut conn = redis
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    let prefix = settings.redis.key_prefix.clone();
    let client = "payments";

    let now_ms = i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis())?;
    let first_ms = now_ms - args.spread * 1000;
    // Issue times spread evenly; the sequence keeps the ids of one
    // millisecond apart (at most 4096 of them: `--spread` long enough).
    let step_ms = (args.spread * 1000).max(1) as f64 / args.count.max(1) as f64;
    if step_ms * 4096.0 < 1.0 {
        bail!("more than 4096 tokens a millisecond: a longer --spread");
    }

    let mut done = 0u64;
    while done < args.count {
        let n = CHUNK.min(args.count - done);
        let tokens: Vec<Token> = (done..done + n)
            .map(|i| {
                let ms = first_ms + (i as f64 * step_ms) as i64;
                let id = SnowflakeId::from_parts(ms, args.worker, (i % 4096) as u16);
                let exp = u32::try_from(ms / 1000 + args.life).unwrap_or(u32::MAX);
                let (biz, durability) = if i.is_multiple_of(2) {
                    (&durable_biz, "durable")
                } else {
                    (&fast_biz, "fast")
                };
                let subject = format!("u-{}", i % 100_000);
                let claims = Claims {
                    biz_type: biz.clone(),
                    id,
                    exp,
                };
                Token {
                    id: id.as_i64(),
                    exp,
                    text: codec.sign(&claims, client, &subject),
                    biz: biz.as_str(),
                    durability,
                    subject,
                }
            })
            .collect();

        let mut copy = String::with_capacity(tokens.len() * 160);
        for t in &tokens {
            let issued_ms = SnowflakeId(t.id as u64).timestamp_ms();
            let issued_at = chrono::DateTime::from_timestamp_millis(issued_ms).context("time")?;
            let expires_at =
                chrono::DateTime::from_timestamp(i64::from(t.exp), 0).context("expiry")?;
            copy.push_str(&format!(
                "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
                t.id,
                t.text,
                t.biz,
                t.durability,
                t.subject,
                client,
                issued_at.to_rfc3339(),
                expires_at.to_rfc3339(),
            ));
        }
        let mut pg = pool.acquire().await?;
        let mut sink = pg
            .copy_in_raw(
                "COPY tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at) FROM STDIN",
            )
            .await?;
        sink.send(copy.into_bytes()).await?;
        sink.finish().await?;

        // The hash `issue.lua` seeds: `s` = issued, `g` = 0, the TTL left;
        // pipelines of `PIPELINE` tokens.
        for (c, part) in tokens.chunks(PIPELINE).enumerate() {
            let mut pipe = redis::pipe();
            for (k, t) in part.iter().enumerate() {
                let i = done + (c * PIPELINE + k) as u64;
                if args.missing_every > 0 && i.is_multiple_of(args.missing_every) {
                    continue;
                }
                let key = format!("{prefix}tok:{{{}}}", t.text);
                let ttl_ms = (i64::from(t.exp) * 1000 - now_ms).max(1);
                pipe.hset_multiple(&key, &[("s", "i"), ("g", "0")])
                    .ignore()
                    .pexpire(&key, ttl_ms)
                    .ignore();
            }
            pipe.query_async::<()>(&mut conn).await?;
        }
        done += n;
        eprintln!("filled {done} of {}", args.count);
    }
    Ok(())
}

//! Batch statements on the hot pool read only their own rows, even where the
//! planner would rather merge-join.
//!
//! Every batch statement joins its items (an `UNNEST` of ids) with a large
//! table. A merge join walks the table's index from its first entry: it
//! reads every row that sorts before the batch's last one (seen in a full
//! bench run, where order-pay fell to 0.6x of pgbench). The hot pool's
//! sessions do not merge-join (`durable::hot_connect_options`). Each test
//! runs a batch on a connection with the hot pool's options where nested
//! loops and hash joins are off as well, so that a merge join is what the
//! planner would pick if it may; it places 20,000 rows before the batch's
//! and counts the rows the statement read: about the batch's, never the
//! 20,000.

use std::collections::HashMap;

use chrono::{Duration, Utc};
use idempotency_ledger::config::Durability;
use idempotency_ledger::domain::key::{identity, ClientKey};
use idempotency_ledger::domain::BizType;
use idempotency_ledger::durable::batch::{consume_batch, finish_batch, ConsumeItem, FinishItem};
use idempotency_ledger::durable::hot_connect_options;
use idempotency_ledger::durable::key_batch::{consume_key_batch, KeyItem};
use idempotency_ledger::durable::tokens::{self, ConsumeRow, TokenRecord};
use idempotency_ledger::fast::JournalEntry;
use idempotency_ledger::journal::apply_entries;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::helpers::*;

/// Rows placed before the batch's.
const BEFORE: i64 = 20_000;
/// More than this many rows read for a batch of 10 is a scan of the rows
/// before it.
const BOUND: i64 = 1_000;

/// A fresh, migrated database with no service running on it (so no
/// background task reads `tokens` meanwhile), holding `BEFORE` issued
/// tokens (ids 1 to 20,000) and `BEFORE` client keys (the lowest ids of
/// all), analyzed. Its URL, and the hot pool's options for it.
async fn database_with_rows_before() -> (String, PgConnectOptions) {
    let app = spawn_app().await;
    let url = app.stores.db_url();
    let hot = hot_connect_options(&app.stores.settings().postgres).expect("hot options");
    app.stop().await;
    let pg = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("pool");
    sqlx::query(
        "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at)
         SELECT g, 'order_fill_' || g, 'order', 'durable', 'u-fill', 'payments', now(),
                now() + interval '1 hour'
           FROM generate_series(1, $1) g",
    )
    .bind(BEFORE)
    .execute(&pg)
    .await
    .expect("tokens before");
    sqlx::query(
        "INSERT INTO tokens (id, token, key, biz_type, durability, subject, client, issued_at,
                             expires_at)
         SELECT (-9223372036854775807) + g, 'key_fill_' || g, 'fill-' || g, 'order', 'durable',
                'u-fill', 'payments', now(), now()
           FROM generate_series(1, $1) g",
    )
    .bind(BEFORE)
    .execute(&pg)
    .await
    .expect("keys before");
    sqlx::query("ANALYZE tokens")
        .execute(&pg)
        .await
        .expect("analyze");
    pg.close().await;
    (url, hot)
}

/// A pool of one connection with the hot pool's options, on which a merge
/// join is the plan Postgres would pick if it may (no nested loops, no
/// hash joins).
async fn would_merge_join(hot: PgConnectOptions) -> PgPool {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(hot.options([("enable_nestloop", "off"), ("enable_hashjoin", "off")]))
        .await
        .expect("pool");
    let off: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM pg_settings
          WHERE name IN ('enable_nestloop', 'enable_hashjoin') AND setting = 'off'",
    )
    .fetch_all(&pool)
    .await
    .expect("settings");
    assert_eq!(off.len(), 2, "{off:?}");
    pool
}

/// What scans of `tokens` (every partition) have read so far, this
/// connection's included: the entries of every index (a bitmap scan reads
/// its index's entries without fetching their rows) and the rows of
/// sequential scans. Its own counts are flushed to the statistics first
/// (as it goes idle after the first statement).
async fn tokens_read(pool: &PgPool) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .expect("flush");
    sqlx::query_scalar(
        "WITH p AS (SELECT inhrelid AS relid FROM pg_inherits WHERE inhparent = 'tokens'::regclass)
         SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes
                  WHERE relid IN (SELECT relid FROM p))::bigint
              + (SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables
                  WHERE relid IN (SELECT relid FROM p))::bigint",
    )
    .fetch_one(pool)
    .await
    .expect("tokens read")
}

/// A durable `order` token with an id after the rows before.
fn record(i: i64) -> TokenRecord {
    let now = Utc::now();
    let id = 1_000_000 + i;
    TokenRecord {
        id,
        token: format!("order_batch_{id}"),
        biz_type: "order".into(),
        durability: Durability::Durable,
        subject: "u-batch".into(),
        client: "payments".into(),
        issued_at: now,
        expires_at: now + Duration::hours(1),
        key: None,
    }
}

/// What a results and releases batch holds: each kind runs a statement of
/// its own (`durable::batch`).
#[derive(Debug, Clone, Copy)]
enum Mix {
    /// A result for every other item, a release for the rest.
    Both,
    ResultsAlone,
    ReleasesAlone,
}

impl Mix {
    const ALL: [Mix; 3] = [Mix::Both, Mix::ResultsAlone, Mix::ReleasesAlone];

    fn releases(self, i: usize) -> bool {
        match self {
            Mix::Both => i % 2 == 1,
            Mix::ResultsAlone => false,
            Mix::ReleasesAlone => true,
        }
    }

    /// (results recorded, releases done) by a batch of ten.
    fn made(self) -> (i64, i64) {
        match self {
            Mix::Both => (5, 5),
            Mix::ResultsAlone => (10, 0),
            Mix::ReleasesAlone => (0, 10),
        }
    }
}

/// Results and releases of `records` (consumed by `r-first`), as `mix`
/// says.
fn results_and_releases(records: &[TokenRecord], mix: Mix) -> Vec<FinishItem> {
    records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            if mix.releases(i) {
                FinishItem::Release {
                    id: r.id,
                    detail: None,
                    of_request: Some("r-first".into()),
                }
            } else {
                FinishItem::Result {
                    id: r.id,
                    result: serde_json::json!({"payment_id": r.id}),
                    detail: None,
                    of_request: Some("r-first".into()),
                }
            }
        })
        .collect()
}

/// Ten tokens after the rows before, consumed by `r-first`, then their
/// results and releases (as `mix` says) in one batch on `pool`, checked:
/// what the batch read of `tokens`.
async fn finish_batch_read(url: &str, pool: &PgPool, mix: Mix) -> i64 {
    let records: Vec<TokenRecord> = (1..=10).map(record).collect();
    for rec in &records {
        consumed(url, rec).await;
    }
    let items = results_and_releases(&records, mix);
    let refs: Vec<&FinishItem> = items.iter().collect();
    let before = tokens_read(pool).await;
    let answers = finish_batch(pool, &refs).await.expect("batch");
    let read = tokens_read(pool).await - before;
    assert!(answers.iter().all(Result::is_ok), "{mix:?}: {answers:?}");
    assert_eq!(results_and_releases_made(pool).await, mix.made(), "{mix:?}");
    read
}

/// How many tokens after the rows before have a result, and how many are
/// issued again.
async fn results_and_releases_made(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE result IS NOT NULL), count(*) FILTER (WHERE state = 'issued')
           FROM tokens WHERE id > $1",
    )
    .bind(BEFORE)
    .fetch_one(pool)
    .await
    .expect("rows")
}

/// Journal entries of consumes (request `rid`, at `at_ms`) of ten fast
/// `like` tokens after the rows before (entry ids `<tag>-1` to `<tag>-10`).
fn fast_consumes(tag: &str, rid: &str, at_ms: i64) -> Vec<JournalEntry> {
    (1..=10)
        .map(|i| {
            let rec = TokenRecord {
                durability: Durability::Fast,
                biz_type: "like".into(),
                ..record(i)
            };
            journal_entries::consume_entry(&format!("{tag}-{i}"), &rec, rid, at_ms)
        })
        .collect()
}

/// Issues and consumes `rec` (request `r-first`), on another connection.
async fn consumed(url: &str, rec: &TokenRecord) {
    let pg = PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .expect("pool");
    tokens::insert_issued(&pg, std::slice::from_ref(rec), uuid::Uuid::nil(), &[])
        .await
        .expect("issued");
    tokens::consume(&pg, rec, None, Some("r-first"))
        .await
        .expect("consumed");
    pg.close().await;
}

/// The consume batch (`durable::batch::consume_batch`) reads the rows it
/// did not claim back from `tokens`, joined with its items.
#[tokio::test]
async fn a_consume_batch_reads_only_its_own_tokens_on_the_hot_pool() {
    let (url, hot) = database_with_rows_before().await;
    let records: Vec<TokenRecord> = (1..=10).map(record).collect();
    // Half already consumed: their rows are read back for their answers.
    for rec in &records[..5] {
        consumed(&url, rec).await;
    }
    let items: Vec<ConsumeItem> = records
        .iter()
        .map(|r| ConsumeItem {
            record: r.clone(),
            fingerprint: None,
            request_id: Some("r-batch".into()),
        })
        .collect();
    let refs: Vec<&ConsumeItem> = items.iter().collect();

    let pool = would_merge_join(hot).await;
    let before = tokens_read(&pool).await;
    let answers = consume_batch(&pool, &refs).await.expect("batch");
    let read = tokens_read(&pool).await - before;

    let won = answers
        .iter()
        .filter(|a| matches!(a, Ok((ConsumeRow::Won { .. }, _))))
        .count();
    let existing = answers
        .iter()
        .filter(|a| matches!(a, Ok((ConsumeRow::Existing(_), _))))
        .count();
    assert_eq!((won, existing), (5, 5), "{answers:?}");
    assert!(
        read < BOUND,
        "{read} index entries and rows of tokens read for a batch of 10"
    );
}

/// The client keys' consume batch (`durable::key_batch`) reads the keys it
/// did not claim back the same way.
#[tokio::test]
async fn a_key_batch_reads_only_its_own_keys_on_the_hot_pool() {
    let (url, hot) = database_with_rows_before().await;
    let biz = BizType::parse("order").expect("biz");
    let now = Utc::now();
    let records: Vec<TokenRecord> = (1..=10)
        .map(|i| {
            let key = format!("batch-{i}");
            let id = identity("payments", &biz, &ClientKey::parse(&key).expect("key"));
            TokenRecord {
                id: id.id,
                token: id.handle,
                biz_type: "order".into(),
                durability: Durability::Durable,
                subject: "u-batch".into(),
                client: "payments".into(),
                issued_at: now,
                expires_at: now,
                key: Some(key),
            }
        })
        .collect();
    let mut items: Vec<KeyItem> = records
        .iter()
        .map(|r| KeyItem {
            record: r.clone(),
            fingerprint: None,
            request_id: Some("r-batch".into()),
        })
        .collect();
    items.sort_by_key(|it| it.record.id);
    let refs: Vec<&KeyItem> = items.iter().collect();
    // Once to claim them, then again: every row is read back.
    let first = consume_key_batch(&PgPool::connect(&url).await.expect("pool"), &refs)
        .await
        .expect("first batch");
    assert!(
        first
            .iter()
            .all(|a| matches!(a, Ok(k) if matches!(k.row, ConsumeRow::Won { .. }))),
        "{first:?}"
    );

    let pool = would_merge_join(hot).await;
    let before = tokens_read(&pool).await;
    let answers = consume_key_batch(&pool, &refs).await.expect("batch");
    let read = tokens_read(&pool).await - before;

    assert!(
        answers
            .iter()
            .all(|a| matches!(a, Ok(k) if matches!(k.row, ConsumeRow::Existing(_)))),
        "{answers:?}"
    );
    assert!(
        read < BOUND,
        "{read} index entries and rows of tokens read for a batch of 10 keys"
    );
}

/// The results and releases batch (`durable::batch::finish_batch`) updates
/// its rows joined with its items, in each of its three statements (both
/// kinds, results alone, releases alone).
#[tokio::test]
async fn a_result_and_release_batch_reads_only_its_own_tokens_on_the_hot_pool() {
    for mix in Mix::ALL {
        let (url, hot) = database_with_rows_before().await;
        let pool = would_merge_join(hot).await;
        let read = finish_batch_read(&url, &pool, mix).await;
        assert!(
            read < BOUND,
            "{mix:?}: {read} index entries and rows of tokens read for a batch of 10"
        );
    }
}

/// The journal's apply (`durable::journal::apply`) looks its entries' rows
/// up in `tokens` for their audit rows and conflicts.
#[tokio::test]
async fn a_journal_batch_reads_only_its_own_tokens_on_the_hot_pool() {
    let (url, hot) = database_with_rows_before().await;
    let at = Utc::now().timestamp_millis();
    let entries = fast_consumes("plan", "r-journal", at);
    // Once to write the rows, then again: every entry meets its row.
    apply_entries(&PgPool::connect(&url).await.expect("pool"), &entries)
        .await
        .expect("first apply");

    let pool = would_merge_join(hot).await;
    let before = tokens_read(&pool).await;
    apply_entries(&pool, &entries).await.expect("apply");
    let read = tokens_read(&pool).await - before;

    let consumed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tokens WHERE id > $1 AND state = 'consumed' AND gen = 1",
    )
    .bind(BEFORE)
    .fetch_one(&pool)
    .await
    .expect("rows");
    assert_eq!(consumed, 10);
    assert!(
        read < BOUND,
        "{read} index entries and rows of tokens read for 10 journal entries"
    );
}

/// The duplicate attempts' counts (`durable::tokens::add_duplicates`)
/// update their tokens joined with the counts.
#[tokio::test]
async fn duplicate_counts_read_only_their_own_tokens_on_the_hot_pool() {
    let (url, hot) = database_with_rows_before().await;
    let records: Vec<TokenRecord> = (1..=10).map(record).collect();
    for rec in &records {
        consumed(&url, rec).await;
    }
    let counts: HashMap<i64, i64> = records.iter().map(|r| (r.id, 3)).collect();

    let pool = would_merge_join(hot).await;
    let before = tokens_read(&pool).await;
    let skipped = tokens::add_duplicates(&pool, &counts)
        .await
        .expect("add duplicates");
    assert_eq!(skipped, Vec::<i64>::new());
    let read = tokens_read(&pool).await - before;

    let total: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(duplicate_attempts), 0)::bigint FROM tokens WHERE id > $1",
    )
    .bind(BEFORE)
    .fetch_one(&pool)
    .await
    .expect("rows");
    assert_eq!(total, 30);
    assert!(
        read < BOUND,
        "{read} index entries and rows of tokens read for 10 counts"
    );
}

/// JIT compilation is off on the hot pool. A hot statement reads a handful
/// of rows, but a plan left with a join method the session ruled out is
/// costed 10^10, past `jit_above_cost`, and Postgres compiled it with LLVM
/// before running it: the results and releases batch above took 1.1 s on
/// an idle machine and failed on the 5 s `statement_timeout` on a loaded
/// one. The same statement, planned the same way, is compiled on a
/// connection with Postgres's defaults (so this test can fail) and not on
/// the hot pool's.
#[tokio::test]
async fn the_hot_pool_never_compiles_a_statement_with_jit() {
    let (url, hot) = database_with_rows_before().await;
    // A self-join of `tokens` with no join method left: costed past every
    // JIT threshold.
    let statement = "EXPLAIN (ANALYZE, FORMAT JSON)
                     SELECT count(*) FROM tokens a JOIN tokens b ON a.id = b.id";
    let compiled = |plan: &serde_json::Value| plan[0].get("JIT").is_some();

    let defaults: PgConnectOptions = url.parse().expect("url");
    let control = would_merge_join(defaults.options([("enable_mergejoin", "off")])).await;
    let jit_available: bool = sqlx::query_scalar("SELECT pg_jit_available()")
        .fetch_one(&control)
        .await
        .expect("jit available");
    let plan: serde_json::Value = sqlx::query_scalar(statement)
        .fetch_one(&control)
        .await
        .expect("control plan");
    if jit_available {
        assert!(compiled(&plan), "Postgres's defaults compile it: {plan}");
    }

    let pool = would_merge_join(hot).await;
    let plan: serde_json::Value = sqlx::query_scalar(statement)
        .fetch_one(&pool)
        .await
        .expect("hot plan");
    assert!(!compiled(&plan), "the hot pool compiled it: {plan}");
}

/// A consume batch whose items all win reads nothing back and sets up no
/// scan of the partitions of `tokens`: it waits for no lock on a partition
/// none of its items is in. Before V20 the read of the items that did not
/// win was a join on `tokens`, whose plan locked and set up a scan of every
/// partition on every run (about a quarter of Postgres's CPU per consume in
/// batches of 16); now `tokens_row` reads them, called for those items only.
#[tokio::test]
async fn a_consume_batch_whose_items_all_win_touches_no_other_partition() {
    let (url, hot) = database_with_rows_before().await;
    let holder = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("pool");
    let far: String = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
          WHERE i.inhparent = 'tokens'::regclass AND c.relname ~ '^tokens_p[0-9]{8}$'
          ORDER BY c.relname DESC LIMIT 1",
    )
    .fetch_one(&holder)
    .await
    .expect("the last day partition");
    let mut held = holder.begin().await.expect("begin");
    sqlx::query(&format!("LOCK TABLE {far} IN ACCESS EXCLUSIVE MODE"))
        .execute(&mut *held)
        .await
        .expect("lock");

    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(hot)
        .await
        .expect("pool");
    // Twice, fresh tokens each time: a plan cached on the connection
    // behaves the same.
    for run in 0..2 {
        let items: Vec<ConsumeItem> = (run * 10 + 1..=run * 10 + 10)
            .map(|i| ConsumeItem {
                record: record(i),
                fingerprint: None,
                request_id: Some("r-batch".into()),
            })
            .collect();
        let refs: Vec<&ConsumeItem> = items.iter().collect();
        let answers = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            consume_batch(&pool, &refs),
        )
        .await
        .unwrap_or_else(|_| {
            panic!("run {run}: waited for {far}, a partition none of its items is in")
        })
        .expect("batch");
        let won = answers
            .iter()
            .filter(|a| matches!(a, Ok((ConsumeRow::Won { .. }, _))))
            .count();
        assert_eq!(won, 10, "run {run}: {answers:?}");
    }
    held.rollback().await.expect("rollback");
}

/// The journal's apply looks up, for its consume entries, the row each met
/// (a second decider's consume of the same generation is kept as
/// `token.conflict`). The statement's plan is cached (generic) on its
/// connection; planned while the statistics said no row was consumed, it
/// scanned every consumed row of `tokens` once per entry, found by running
/// `scripts/profile` (the drain's batches of 500 took 91 ms, then 650 ms
/// seven seconds later: Postgres spent 735 µs per fast consume). Here the
/// rows before are 20,000 consumed fast tokens the statistics still take
/// for issued (analyzed before their consumes, autovacuum off), and the
/// plan is generic from the first execution.
#[tokio::test]
async fn a_journal_batch_reads_only_its_own_tokens_when_the_statistics_predate_the_consumes() {
    let (url, hot) = database_with_rows_before().await;
    let pg = PgPool::connect(&url).await.expect("pool");
    consumed_behind_the_statistics(&pg, "fast", "like").await;
    let at = Utc::now().timestamp_millis();
    let entries = fast_consumes("stale", "r-journal", at);
    apply_entries(&pg, &entries).await.expect("first apply");
    pg.close().await;

    let pool = generic_plans(hot).await;
    let before = tokens_read(&pool).await;
    // A repeat (every entry meets its row, consumed at its generation),
    // then a second decider's consume of each: both are looked up.
    apply_entries(&pool, &entries).await.expect("repeat");
    let second = fast_consumes("other", "r-other", at + 1);
    apply_entries(&pool, &second).await.expect("second decider");
    let read = tokens_read(&pool).await - before;

    let conflicts: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE kind = 'token.conflict' AND token_id > $1",
    )
    .bind(BEFORE)
    .fetch_one(&pool)
    .await
    .expect("conflicts");
    assert_eq!(conflicts, 10, "each second decider's consume kept once");
    assert!(
        read < BOUND,
        "{read} index entries and rows of tokens read for 20 journal entries"
    );
}

/// The rows before (ids 1 to `BEFORE`) consumed, as tokens of `biz`
/// (`durability`), after the statistics were taken: these still say no row
/// is consumed (autovacuum is off on every partition, so none is analyzed
/// meanwhile), as on a day's partition before its first analyze.
async fn consumed_behind_the_statistics(pg: &PgPool, durability: &str, biz: &str) {
    sqlx::query(
        "DO $$ DECLARE p regclass; BEGIN
           FOR p IN SELECT inhrelid::regclass FROM pg_inherits WHERE inhparent = 'tokens'::regclass LOOP
             EXECUTE format('ALTER TABLE %s SET (autovacuum_enabled = false)', p);
           END LOOP;
         END $$",
    )
    .execute(pg)
    .await
    .expect("autovacuum off");
    sqlx::query(
        "UPDATE tokens SET durability = $2::durability, biz_type = $3, state = 'consumed', gen = 1,
                           consumed_at = now(), request_id = 'r-fill'
          WHERE id <= $1",
    )
    .bind(BEFORE)
    .bind(durability)
    .bind(biz)
    .execute(pg)
    .await
    .expect("fill consumed");
}

/// A pool of one connection with the hot pool's options whose statements
/// are planned generically from their first execution, as a cached plan is.
async fn generic_plans(hot: PgConnectOptions) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(hot.options([("plan_cache_mode", "force_generic_plan")]))
        .await
        .expect("pool")
}

/// The results and releases batch finds its rows by id only. Its updates
/// named the rows' state, and a cached plan made on statistics that saw
/// few consumed rows found the batch's rows through the index of every
/// consumed row (`tokens_consumed_at_idx`): 80,045 rows read for a batch
/// of 10 here. The conditions are now the locked rows', in each of its
/// three statements.
#[tokio::test]
async fn a_result_and_release_batch_reads_only_its_own_tokens_when_the_statistics_predate_the_consumes(
) {
    for mix in Mix::ALL {
        let (url, hot) = database_with_rows_before().await;
        let pg = PgPool::connect(&url).await.expect("pool");
        consumed_behind_the_statistics(&pg, "durable", "order").await;
        pg.close().await;
        let pool = generic_plans(hot).await;
        let read = finish_batch_read(&url, &pool, mix).await;
        assert!(
            read < BOUND,
            "{mix:?}: {read} index entries and rows of tokens read for a batch of 10"
        );
    }
}

/// A result or release that runs alone (the queue was idle, as under light
/// load) is one statement on one id, and it named the row's state too: the
/// same cached plan found that id through the index of every consumed row.
#[tokio::test]
async fn a_lone_result_and_release_read_only_their_own_tokens_when_the_statistics_predate_the_consumes(
) {
    let (url, hot) = database_with_rows_before().await;
    let pg = PgPool::connect(&url).await.expect("pool");
    consumed_behind_the_statistics(&pg, "durable", "order").await;
    pg.close().await;
    let records: Vec<TokenRecord> = (1..=10).map(record).collect();
    for rec in &records {
        consumed(&url, rec).await;
    }

    let pool = generic_plans(hot).await;
    let before = tokens_read(&pool).await;
    for (i, r) in records.iter().enumerate() {
        if i % 2 == 0 {
            let result = serde_json::json!({"payment_id": r.id});
            tokens::set_result_versioned(&pool, r.id, &result, None, Some("r-first"))
                .await
                .expect("result");
        } else {
            tokens::release_with(&pool, r.id, None, Some("r-first"))
                .await
                .expect("release");
        }
    }
    let read = tokens_read(&pool).await - before;

    assert_eq!(results_and_releases_made(&pool).await, (5, 5));
    assert!(
        read < BOUND,
        "{read} index entries and rows of tokens read for 10 lone results and releases"
    );
}

//! Building and running the service: `Application::build(settings, opts, clock)` creates
//! the database when missing, migrates, checks, leases a worker id, binds
//! (port 0 in tests) and starts the background tasks; `run_until_stopped`
//! serves until SIGTERM/SIGINT, then drains requests and flushes buffers.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
use actix_web::{middleware, web, App, HttpServer};
use anyhow::Context;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admin::Admin;
use crate::audit_seal::{self, Seals};
use crate::auth::Clients;
use crate::changes::Changes;
use crate::config::Settings;
use crate::durable::usage::PoolUsage;
use crate::durable::{setup, Pools};
use crate::fast::FastTier;
use crate::http::{self, AppState};
use crate::journal::Drainer;
use crate::lease::WorkerLease;
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::orders::Orders;
use crate::reconcile::Reconciler;
use crate::token::Clock;
use crate::{bloom, journal, reconcile, writer};

#[derive(Debug, Clone, Copy)]
pub struct BuildOptions {
    /// Create the database if missing and apply migrations first.
    pub migrate: bool,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions { migrate: true }
    }
}

pub struct Application {
    port: u16,
    server: Server,
    ledger: Arc<Ledger>,
    pools: Pools,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    writer_task: JoinHandle<()>,
    lease_task: JoinHandle<()>,
}

impl Application {
    /// `clock`: the service's one source of "now" ([`crate::token::SystemClock`] in
    /// production; tests may pass a [`crate::token::ManualClock`]).
    pub async fn build(
        settings: Settings,
        opts: BuildOptions,
        clock: Arc<dyn Clock>,
    ) -> anyhow::Result<Application> {
        crate::tls::install_provider();
        let settings = Arc::new(settings);
        if opts.migrate {
            setup::create_database_if_missing(&settings.postgres.url).await?;
            setup::migrate(&settings.postgres.url).await?;
        }
        let pools = Pools::new(&settings.postgres).context("postgres.url")?;
        setup::check_durability(&pools)
            .await
            .map_err(|e| setup::name_postgres_url(&settings.postgres.url, e))?;

        let metrics = Arc::new(Metrics::new());
        metrics
            .registry
            .register(Box::new(PoolUsage::new(
                &pools,
                settings.postgres.pool_size,
                settings.postgres.admin_pool_size,
            )))
            .context("registering the pool metrics")?;
        metrics
            .registry
            .register(Box::new(reconcile::last_run_metrics(pools.admin.clone())))
            .and_then(|_| {
                metrics
                    .registry
                    .register(Box::new(reconcile::conflict_metric(pools.admin.clone())))
            })
            .context("registering the reconcile metrics")?;
        metrics
            .registry
            .register(Box::new(crate::ledger::uncertain_metric(
                pools.admin.clone(),
                settings.biz.keys().map(|b| b.to_string()).collect(),
            )))
            .context("registering the uncertain items metric")?;
        metrics
            .registry
            .register(Box::new(audit_seal::last_seal_metric(pools.admin.clone())))
            .context("registering the audit seal metric")?;
        let fast = FastTier::new(settings.redis.clone(), metrics.clone(), clock.clone());
        // Cluster: a journal entry whose XADD failed goes to Postgres before
        // the answer (see `FastTier::append_or_queue`).
        let journal_pool = pools.hot.clone();
        fast.set_journal_fallback(Arc::new(move |entry| {
            let pool = journal_pool.clone();
            Box::pin(async move {
                match journal::apply_entries(&pool, std::slice::from_ref(&entry)).await {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(error = %e, "journal entry not applied to postgres directly");
                        false
                    }
                }
            })
        }));
        fast.check_tls().await?;
        metrics
            .registry
            .register(Box::new(journal::lag_metric(&fast)))
            .context("registering the journal metrics")?;
        match fast.maxmemory_policy().await {
            Some(policy) if policy != "noeviction" => {
                metrics.redis_eviction_unsafe.set(1);
                tracing::warn!(
                    %policy,
                    "REDIS maxmemory-policy is not noeviction: under memory pressure Redis evicts tokens, and fast biz types lose their exactly-once guarantee"
                );
            }
            Some(_) => {}
            None => tracing::warn!("could not read redis maxmemory-policy (redis down or cluster)"),
        }

        let lease = WorkerLease::acquire(
            &pools.hot,
            settings.tokens.worker_lease_ttl,
            settings.bloom.horizon * 2,
            clock.clone(),
        )
        .await
        .context("leasing a snowflake worker id")?;
        let (writer, writer_rx) = writer::writer(
            settings.tokens.issue_buffer,
            pools.hot.clone(),
            metrics.clone(),
            clock.clone(),
            lease.clone(),
        );
        let changes = Arc::new(Changes::new(pools.hot.clone()));
        metrics
            .registry
            .register(Box::new(crate::changes::WaitingGauge::new(changes.clone())))
            .context("registering the waiting consumes metric")?;
        let ledger = Arc::new(Ledger::new(
            settings.clone(),
            clock.clone(),
            lease.clone(),
            fast.clone(),
            pools.clone(),
            metrics.clone(),
            writer,
            changes.clone(),
        ));

        let shutdown = CancellationToken::new();
        let writer_task = tokio::spawn(writer_rx.run(shutdown.clone()));
        let lease_task = tokio::spawn(lease.clone().run(pools.hot.clone(), shutdown.clone()));
        let consumer = format!("worker-{}", lease.worker_id());
        // The first report before the first request: the gate for Redis
        // decisions opens only once the fleet has counted this instance.
        ledger.fleet().beat().await;
        let mut tasks = vec![
            tokio::spawn(ledger.fleet().clone().run(shutdown.clone())),
            tokio::spawn(
                Drainer::new(fast.clone(), pools.hot.clone(), consumer).run(shutdown.clone()),
            ),
            tokio::spawn(watch_redis(ledger.clone(), shutdown.clone())),
            tokio::spawn(prune_rate_limiters(ledger.clone(), shutdown.clone())),
            tokio::spawn(changes.listen(shutdown.clone())),
            tokio::spawn(crate::ledger::run_sweeps(ledger.clone(), shutdown.clone())),
        ];
        // Sealed audit checkpoints, on the admin pool (one instance at a time).
        let seals = Seals::new(&settings.audit, pools.admin.clone());
        tasks.push(tokio::spawn(seals.clone().run(shutdown.clone())));
        // The issued-token filter: listen, load, then keep listening. Start-up
        // waits for the first load (bounded): until then it fails open.
        let (bloom_ready, bloom_loaded) = tokio::sync::oneshot::channel();
        tasks.push(tokio::spawn(bloom::run(
            ledger.bloom().clone(),
            settings.postgres.clone(),
            pools.clone(),
            clock.clone(),
            shutdown.clone(),
            bloom_ready,
        )));
        tasks.push(tokio::spawn(bloom::reread_marks(
            ledger.bloom().clone(),
            pools.clone(),
            clock.clone(),
            shutdown.clone(),
        )));
        tasks.push(tokio::spawn(bloom::maintain(
            ledger.bloom().clone(),
            clock.clone(),
            shutdown.clone(),
        )));
        if tokio::time::timeout(Duration::from_secs(60), bloom_loaded)
            .await
            .is_err()
        {
            tracing::warn!(
                "bloom filter still loading; unknown tokens go on to the tiers until it is synced"
            );
        }

        let listener = TcpListener::bind(settings.server.listen)
            .with_context(|| format!("binding {}", settings.server.listen))?;
        let port = listener.local_addr()?.port();
        let state = web::Data::new(AppState {
            ledger: ledger.clone(),
            orders: Orders::new(ledger.clone(), pools.clone()),
            admin: Admin::new(&settings, pools.admin.clone()),
            reconciler: Reconciler::new(
                &settings,
                pools.admin.clone(),
                fast.clone(),
                clock.clone(),
            ),
            clients: Clients::new(settings.clients.clone()),
            limits: settings.limits.clone(),
            seals,
        });
        let mut server = HttpServer::new(move || {
            App::new()
                .app_data(state.clone())
                .wrap(middleware::from_fn(http::limits::guard))
                .wrap(middleware::from_fn(http::observe))
                .configure(http::routes)
        })
        .shutdown_timeout(settings.server.shutdown_timeout.as_secs().max(1))
        .client_request_timeout(settings.limits.request_head_timeout)
        .max_connection_rate(1024);
        if let Some(w) = settings.server.workers {
            server = server.workers(w);
        }
        let server = server.listen(listener)?.run();
        tracing::info!(port, worker_id = lease.worker_id(), "listening");
        Ok(Application {
            port,
            server,
            ledger,
            pools,
            shutdown,
            tasks,
            writer_task,
            lease_task,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// A handle that stops the server gracefully (tests; signals do the same).
    pub fn handle(&self) -> actix_web::dev::ServerHandle {
        self.server.handle()
    }

    /// Serves until stopped, then flushes: in-flight requests finish, queued
    /// issuance records are written, the worker id is given back.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let served = self.server.await;
        tracing::info!("stopping: flushing buffers");
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.writer_task).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), self.lease_task).await;
        for t in self.tasks {
            t.abort();
        }
        self.pools.close().await;
        served.context("http server")
    }
}

/// Forgets the issue-rate buckets of (client, subject) pairs that are full
/// again: subjects are chosen by callers, and each one seen would otherwise
/// hold memory for the life of the process.
async fn prune_rate_limiters(ledger: Arc<Ledger>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(10)) => {}
            _ = shutdown.cancelled() => return,
        }
        ledger.prune_rate_limiters();
    }
}

/// Every 250 ms: [`Ledger::tend_redis`].
async fn watch_redis(ledger: Arc<Ledger>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            _ = shutdown.cancelled() => return,
        }
        ledger.tend_redis().await;
    }
}

//! Building and running the service: `Application::build(settings, opts, clock)` creates
//! the database when missing, migrates, checks, leases a worker id, builds
//! the components, starts the background tasks (one owned, named set:
//! [`crate::tasks`]) and binds (port 0 in tests); `run_until_stopped`
//! serves until SIGTERM/SIGINT, then drains requests, waits for the writes
//! they left running, stops the tasks and flushes buffers, each bounded.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
use actix_web::{middleware, web, App, HttpServer};
use anyhow::Context;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::admin::Admin;
use crate::audit_seal::{self, Seals};
use crate::auth::Clients;
use crate::changes::Changes;
use crate::clock::Clock;
use crate::config::Settings;
use crate::durable::usage::PoolUsage;
use crate::durable::{setup, Pools};
use crate::fast::FastTier;
use crate::fleet::Fleet;
use crate::http::{self, AppState};
use crate::issuance::filter::IssuedFilter;
use crate::issuance::lease::WorkerLease;
use crate::issuance::writer::WriterTask;
use crate::issuance::{filter, writer};
use crate::journal::Drainer;
use crate::ledger::{CatchUp, Issuer, Ledger, Verifier};
use crate::metrics::Metrics;
use crate::orders::Orders;
use crate::reconcile::Reconciler;
use crate::tasks::{OffPath, Tasks};
use crate::token::TokenCodec;
use crate::{journal, reconcile};

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
    /// The fleet-wide filter of issued token ids (the ledger checks tokens
    /// against it; tests look into it).
    filter: Arc<IssuedFilter>,
    pools: Pools,
    tasks: Tasks,
    off_path: OffPath,
}

/// How long shutdown waits for the writes requests left running.
const OFF_PATH_BOUND: Duration = Duration::from_secs(5);
/// How long shutdown waits for the background tasks, all together (the
/// issuance writer's last flush is the longest: [`writer::SHUTDOWN_DRAIN`]).
const TASKS_BOUND: Duration = Duration::from_secs(10);

/// What the service is made of before anything runs: built in this order
/// by [`Parts::assemble`], then shared by the background tasks and the
/// routes.
struct Parts {
    settings: Arc<Settings>,
    clock: Arc<dyn Clock>,
    pools: Pools,
    fast: Arc<FastTier>,
    lease: Arc<WorkerLease>,
    changes: Arc<Changes>,
    /// The fleet's agreement on Redis (see [`crate::fleet`]).
    fleet: Arc<Fleet>,
    /// The fleet-wide filter of issued token ids.
    filter: Arc<IssuedFilter>,
    ledger: Arc<Ledger>,
    seals: Seals,
    off_path: OffPath,
}

impl Application {
    /// `clock`: the service's one source of "now" ([`crate::clock::SystemClock`] in
    /// production; tests may pass a [`crate::clock::ManualClock`]).
    pub async fn build(
        settings: Settings,
        opts: BuildOptions,
        clock: Arc<dyn Clock>,
    ) -> anyhow::Result<Application> {
        crate::tls::install_provider();
        let (parts, writer) = Parts::assemble(Arc::new(settings), opts, clock).await?;
        // The first report before the first request: the gate for Redis
        // decisions opens only once the fleet has counted this instance.
        parts.fleet.beat().await;
        let (tasks, bloom_loaded) = parts.start_tasks(writer);
        // Start-up waits for the filter's first load (bounded): until then
        // it fails open.
        if tokio::time::timeout(Duration::from_secs(60), bloom_loaded)
            .await
            .is_err()
        {
            tracing::warn!(
                "bloom filter still loading; unknown tokens go on to the tiers until it is synced"
            );
        }
        let (server, port) = parts.serve()?;
        tracing::info!(port, worker_id = parts.lease.worker_id(), "listening");
        Ok(Application {
            port,
            server,
            ledger: parts.ledger,
            filter: parts.filter,
            pools: parts.pools,
            tasks,
            off_path: parts.off_path,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// The fleet-wide filter of issued token ids.
    pub fn filter(&self) -> &Arc<IssuedFilter> {
        &self.filter
    }

    /// A handle that stops the server gracefully (tests; signals do the same).
    pub fn handle(&self) -> actix_web::dev::ServerHandle {
        self.server.handle()
    }

    /// Serves until stopped, then flushes: in-flight requests finish, the
    /// writes they left running end, the background tasks stop (queued
    /// issuance records are written, the worker id is given back).
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let served = self.server.await;
        tracing::info!("stopping: flushing buffers");
        self.off_path.drain(OFF_PATH_BOUND).await;
        self.tasks.stop(TASKS_BOUND).await;
        self.pools.close().await;
        served.context("http server")
    }
}

impl Parts {
    /// Postgres (created, migrated and checked), the metrics, Redis, the
    /// worker id, then the components over them; returns the issuance
    /// writer's task with them, not yet started.
    async fn assemble(
        settings: Arc<Settings>,
        opts: BuildOptions,
        clock: Arc<dyn Clock>,
    ) -> anyhow::Result<(Parts, WriterTask)> {
        let pools = open_postgres(&settings, opts).await?;
        let metrics = Arc::new(Metrics::new());
        register_postgres_metrics(&metrics, &pools, &settings)?;
        let fast = open_redis(&settings, &pools, &metrics, &clock).await?;
        let lease = WorkerLease::acquire(
            &pools.hot,
            settings.tokens.worker_lease_ttl,
            settings.bloom.horizon * 2,
            clock.clone(),
        )
        .await
        .context("leasing a snowflake worker id")?;
        let (writer, writer_task) = writer::writer(
            settings.tokens.issue_buffer,
            pools.hot.clone(),
            metrics.clone(),
            clock.clone(),
            lease.clone(),
        );
        let off_path = OffPath::new();
        let changes = Arc::new(Changes::new(pools.hot.clone(), off_path.clone()));
        metrics
            .registry
            .register(Box::new(crate::changes::WaitingGauge::new(changes.clone())))
            .context("registering the waiting consumes metric")?;
        let fleet = Arc::new(Fleet::new(
            &settings,
            pools.hot.clone(),
            pools.deadline,
            fast.clone(),
            clock.clone(),
            &metrics,
        ));
        let filter = Arc::new(IssuedFilter::new(settings.bloom.clone(), metrics.clone()));
        let codec = TokenCodec::new(settings.tokens.signing_keys.clone());
        let verifier = Verifier::new(
            settings.clone(),
            codec.clone(),
            filter.clone(),
            clock.clone(),
            metrics.clone(),
        );
        let issuer = Issuer::new(
            &settings,
            lease.clone(),
            writer.clone(),
            codec,
            filter.clone(),
            fast.clone(),
            clock.clone(),
            metrics.clone(),
        );
        let catch_up = CatchUp::new(
            &settings,
            fast.clone(),
            clock.clone(),
            metrics.clone(),
            off_path.clone(),
        );
        let ledger = Arc::new(Ledger::new(
            settings.clone(),
            clock.clone(),
            fast.clone(),
            pools.clone(),
            metrics,
            writer,
            changes.clone(),
            off_path.clone(),
            fleet.clone(),
            verifier,
            issuer,
            catch_up,
        ));
        // Sealed audit checkpoints, on the admin pool (one instance at a time).
        let seals = Seals::new(&settings.audit, pools.admin.clone());
        let parts = Parts {
            settings,
            clock,
            pools,
            fast,
            lease,
            changes,
            fleet,
            filter,
            ledger,
            seals,
            off_path,
        };
        Ok((parts, writer_task))
    }

    /// Starts every background task; the receiver hears when the
    /// issued-token filter has its first load.
    fn start_tasks(&self, writer: WriterTask) -> (Tasks, oneshot::Receiver<()>) {
        let mut tasks = Tasks::new();
        let ledger = &self.ledger;
        tasks.spawn("issuance_writer", |stop| writer.run(stop));
        let (lease, hot) = (self.lease.clone(), self.pools.hot.clone());
        tasks.spawn("worker_lease", |stop| lease.run(hot, stop));
        tasks.spawn("fleet", |stop| self.fleet.clone().run(stop));
        let consumer = format!("worker-{}", self.lease.worker_id());
        let drainer = Drainer::new(self.fast.clone(), self.pools.hot.clone(), consumer);
        tasks.spawn("journal_drainer", |stop| drainer.run(stop));
        tasks.spawn("redis_watch", |stop| watch_redis(ledger.clone(), stop));
        tasks.spawn("rate_limit_prune", |stop| {
            prune_rate_limiters(ledger.clone(), stop)
        });
        tasks.spawn("changes_listener", |stop| self.changes.clone().listen(stop));
        tasks.spawn("sweeps", |stop| {
            crate::ledger::run_sweeps(ledger.clone(), stop)
        });
        tasks.spawn("audit_seal", |stop| self.seals.clone().run(stop));
        // The issued-token filter: listen, load, then keep listening.
        let (bloom_ready, bloom_loaded) = oneshot::channel();
        tasks.spawn("bloom_sync", |stop| {
            filter::run(
                self.filter.clone(),
                self.settings.postgres.clone(),
                self.pools.clone(),
                self.clock.clone(),
                stop,
                bloom_ready,
            )
        });
        tasks.spawn("bloom_marks", |stop| {
            filter::reread_marks(
                self.filter.clone(),
                self.pools.clone(),
                self.clock.clone(),
                stop,
            )
        });
        tasks.spawn("bloom_maintain", |stop| {
            filter::maintain(self.filter.clone(), self.clock.clone(), stop)
        });
        tracing::debug!(tasks = ?tasks.names(), "background tasks started");
        (tasks, bloom_loaded)
    }

    /// Binds `server.listen` (port 0: any) and starts serving the routes.
    fn serve(&self) -> anyhow::Result<(Server, u16)> {
        let settings = &self.settings;
        let listener = TcpListener::bind(settings.server.listen)
            .with_context(|| format!("binding {}", settings.server.listen))?;
        let port = listener.local_addr()?.port();
        let state = web::Data::new(AppState {
            ledger: self.ledger.clone(),
            fleet: self.fleet.clone(),
            orders: Orders::new(
                self.ledger.clone(),
                self.pools.clone(),
                self.clock.clone(),
                self.off_path.clone(),
            ),
            admin: Admin::new(settings, &self.pools),
            reconciler: Reconciler::new(
                settings,
                self.pools.admin.clone(),
                self.fast.clone(),
                self.clock.clone(),
            ),
            clients: Clients::new(settings.clients.clone()),
            limits: settings.limits.clone(),
            seals: self.seals.clone(),
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
        Ok((server.listen(listener)?.run(), port))
    }
}

/// Creates the database when missing and migrates (`opts.migrate`), opens
/// the pools and checks that Postgres makes a commit durable.
async fn open_postgres(settings: &Settings, opts: BuildOptions) -> anyhow::Result<Pools> {
    if opts.migrate {
        setup::create_database_if_missing(&settings.postgres.url).await?;
        setup::migrate(&settings.postgres.url).await?;
    }
    let pools = Pools::new(&settings.postgres).context("postgres.url")?;
    setup::check_durability(&pools)
        .await
        .map_err(|e| setup::name_postgres_url(&settings.postgres.url, e))?;
    Ok(pools)
}

/// The metrics read from Postgres on scrape: pool usage, reconcile's last
/// run and conflicts, uncertain items, the last audit seal, the read
/// replica's lag (when `postgres.read_url` is set).
fn register_postgres_metrics(
    metrics: &Metrics,
    pools: &Pools,
    settings: &Settings,
) -> anyhow::Result<()> {
    let registry = &metrics.registry;
    registry
        .register(Box::new(PoolUsage::new(
            pools,
            settings.postgres.pool_size,
            settings.postgres.admin_pool_size,
        )))
        .context("registering the pool metrics")?;
    registry
        .register(Box::new(reconcile::last_run_metrics(pools.admin.clone())))
        .and_then(|_| registry.register(Box::new(reconcile::conflict_metric(pools.admin.clone()))))
        .context("registering the reconcile metrics")?;
    registry
        .register(Box::new(crate::ledger::uncertain_metric(
            pools.admin.clone(),
            settings.biz.keys().map(|b| b.to_string()).collect(),
        )))
        .context("registering the uncertain items metric")?;
    registry
        .register(Box::new(audit_seal::last_seal_metric(pools.admin.clone())))
        .context("registering the audit seal metric")?;
    if pools.read_is_replica {
        registry
            .register(Box::new(crate::admin::replica::lag_metric(
                pools.read.clone(),
            )))
            .context("registering the read replica's lag metric")?;
    }
    Ok(())
}

/// The Redis tier: its journal fallback to Postgres (cluster), its TLS
/// checked, the journal lag metric, and a warning when Redis may evict.
async fn open_redis(
    settings: &Settings,
    pools: &Pools,
    metrics: &Arc<Metrics>,
    clock: &Arc<dyn Clock>,
) -> anyhow::Result<Arc<FastTier>> {
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
    Ok(fast)
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

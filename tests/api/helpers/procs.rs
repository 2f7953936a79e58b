//! Private servers for the fault tests: a redis-server, a 6-node Redis Cluster,
//! a Postgres instance (and a streaming replica of it) and the service binary
//! itself, each on free ports in its own temporary directory, killed when
//! dropped. The shared Postgres and
//! Redis are never stopped, paused or reconfigured.

use std::collections::BTreeSet;
use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// Where Postgres's server programs (`initdb`, `pg_ctl`) are:
/// `LEDGER_TEST_PG_BIN`, else `pg_config --bindir`, else the newest
/// `/usr/lib/postgresql/*/bin` (Debian), else the `PATH`.
fn pg_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let has_initdb = |d: &Path| d.join("initdb").exists();
        if let Some(dir) = std::env::var_os("LEDGER_TEST_PG_BIN") {
            return PathBuf::from(dir);
        }
        if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if out.status.success() && has_initdb(&dir) {
                return dir;
            }
        }
        let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let version = e.file_name().to_str()?.parse::<u32>().ok()?;
                Some((version, e.path().join("bin")))
            })
            .filter(|(_, dir)| has_initdb(dir))
            .collect();
        debian.sort();
        debian.pop().map(|(_, dir)| dir).unwrap_or_default()
    })
}

/// A port that is free now, and whose cluster bus port (+10000) is free too.
/// Taken below Linux's ephemeral range (32768 and up), so that no outgoing
/// connection of a test running beside this one can be given it by the
/// kernel before its server binds it (a restart on the same port too), and
/// never handed out twice by this process.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        // 10000..22700: the bus port stays below 32700.
        let port = 10_000 + rand::random::<u16>() % 12_700;
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if given.contains(&port) {
            continue;
        }
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10_000) {
            given.insert(port);
            return port;
        }
    }
}

/// Polls `ready` every 20 ms for at most `secs` seconds; panics with `what`.
fn wait_for(secs: u64, what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ready() {
        assert!(Instant::now() < deadline, "{what} not ready in {secs} s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .arg("-s")
        .arg(sig)
        .arg(pid.to_string())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill -s {sig} {pid}");
}

/// `redis-cli -p PORT args...`, its output (empty when the server is down).
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    run(Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args))
}

// ---- redis --------------------------------------------------------------------

/// One redis-server, standalone or a cluster node.
pub struct RedisProc {
    pub port: u16,
    child: Option<Child>,
    dir: TempDir,
    cluster: bool,
    /// Extra `redis-server` arguments, kept for restarts.
    args: Vec<String>,
}

impl RedisProc {
    /// A standalone server with `DEBUG` enabled, no persistence.
    pub fn start() -> RedisProc {
        Self::start_with(false)
    }

    /// A standalone server started with extra arguments (`--maxmemory ...`).
    pub fn start_with_args(args: &[&str]) -> RedisProc {
        let mut r = RedisProc {
            port: free_port(),
            child: None,
            dir: tempfile::tempdir().expect("tempdir"),
            cluster: false,
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        r.spawn();
        r
    }

    /// A cluster-enabled server that belongs to no cluster yet (for
    /// `redis-cli --cluster add-node`).
    pub fn start_cluster_node() -> RedisProc {
        Self::start_with(true)
    }

    fn start_with(cluster: bool) -> RedisProc {
        let mut r = RedisProc {
            port: free_port(),
            child: None,
            dir: tempfile::tempdir().expect("tempdir"),
            cluster,
            args: Vec::new(),
        };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--enable-debug-command", "local", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.dir.path().join("redis.log"));
        if self.cluster {
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--cluster-node-timeout", "1000"]);
        }
        cmd.args(&self.args);
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        let port = self.port;
        wait_for(10, "redis-server", || {
            redis_cli(port, &["ping"]).contains("PONG")
        });
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGKILL, and reap it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port (empty: nothing is persisted).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// SIGSTOP: the server keeps its sockets and answers nothing.
    pub fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    /// SIGCONT.
    pub fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }

    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("redis connection")
    }
}

impl Drop for RedisProc {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // A stopped process still dies of SIGKILL; CONT just in case.
            let _ = Command::new("kill")
                .args(["-s", "CONT", &c.id().to_string()])
                .stderr(Stdio::null())
                .status();
        }
        self.kill();
    }
}

/// A Redis Cluster of 3 masters and 3 replicas (node timeout 1 s).
pub struct Cluster {
    pub nodes: Vec<RedisProc>,
}

impl Cluster {
    pub fn start() -> Cluster {
        let nodes: Vec<RedisProc> = (0..6).map(|_| RedisProc::start_with(true)).collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = run(Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"]));
        assert!(out.contains("All 16384 slots covered"), "{out}");
        let cluster = Cluster { nodes };
        cluster.wait_healthy(&[]);
        cluster
    }

    /// Seed URLs for `redis.cluster_nodes`.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisProc::url).collect()
    }

    /// The config line that points the service at this cluster.
    pub fn config_line(&self) -> String {
        let nodes: Vec<String> = self.urls().iter().map(|u| format!("\"{u}\"")).collect();
        format!("redis.cluster_nodes = [{}]", nodes.join(", "))
    }

    pub fn is_master(&self, i: usize) -> bool {
        self.nodes[i].cli(&["role"]).starts_with("master")
    }

    /// The index of the replica of master `i`.
    pub fn replica_of(&self, i: usize) -> usize {
        let port = self.nodes[i].port.to_string();
        (0..self.nodes.len())
            .find(|r| {
                let role = self.nodes[*r].cli(&["role"]);
                role.starts_with("slave") && role.lines().nth(2).is_some_and(|p| p.trim() == port)
            })
            .expect("every master has a replica")
    }

    /// Waits until replica `r` has been promoted to master.
    pub fn wait_promoted(&self, r: usize) {
        wait_for(30, "replica promotion", || self.is_master(r));
    }

    /// Waits until every live node says the cluster is ok with all slots
    /// served, and every live replica's link to its master is up.
    pub fn wait_healthy(&self, dead: &[usize]) {
        for (i, n) in self.nodes.iter().enumerate() {
            if dead.contains(&i) {
                continue;
            }
            wait_for(30, "cluster state ok", || {
                let info = n.cli(&["cluster", "info"]);
                info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
            });
            let role = n.cli(&["role"]);
            if role.starts_with("slave") {
                let master_dead = dead.iter().any(|d| {
                    role.lines()
                        .nth(2)
                        .is_some_and(|p| p.trim() == self.nodes[*d].port.to_string())
                });
                if !master_dead {
                    wait_for(30, "replica link", || {
                        n.cli(&["info", "replication"])
                            .contains("master_link_status:up")
                    });
                }
            }
        }
    }
}

// ---- postgres -----------------------------------------------------------------

/// A private Postgres 15 (trust auth, user `postgres`) in a temporary data
/// directory, run as the `postgres` OS user when we are root.
pub struct PgProc {
    pub port: u16,
    max_connections: u32,
    dir: TempDir,
}

fn as_postgres(program: &str) -> Command {
    let root = run(Command::new("id").arg("-u")).trim() == "0";
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(pg_bin().join(program));
        c
    } else {
        Command::new(pg_bin().join(program))
    }
}

impl PgProc {
    /// A private server for a fault test (which may stop or crash it).
    pub fn start() -> PgProc {
        PgProc::start_in(tempfile::tempdir().expect("tempdir"), 50)
    }

    /// initdb into `dir`, then start with room for `max_connections`.
    pub(super) fn start_in(dir: TempDir, max_connections: u32) -> PgProc {
        let _ = run(Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path()));
        let pg = PgProc {
            port: free_port(),
            max_connections,
            dir,
        };
        let out = run(as_postgres("initdb").arg("-D").arg(pg.data()).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-N",
            "--no-instructions",
        ]));
        assert!(
            pg.data().join("PG_VERSION").exists(),
            "initdb (from {}; set LEDGER_TEST_PG_BIN to the directory holding initdb and pg_ctl): {out}",
            pg_bin().display()
        );
        pg.start_again();
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub(super) fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `postgres://postgres@127.0.0.1:PORT`, for `Stores::postgres`.
    pub fn base(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    /// `pg_ctl start -w` on the same port and data.
    pub fn start_again(&self) {
        let opts = format!(
            // fsync off: a stop, even an immediate one, is no OS crash, and
            // the restart's recovery checkpoint is quick.
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c max_connections={} -c fsync=off",
            self.port,
            self.dir.path().display(),
            self.max_connections
        );
        let out = run(as_postgres("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.path().join("pg.log"))
            .args(["-o", &opts, "-w", "-t", "30", "start"]));
        assert!(out.contains("server started"), "pg_ctl start: {out}");
    }

    /// A streaming replica of this server, started on a port of its own:
    /// `pg_basebackup -R` (a hot standby that follows this one; initdb's
    /// `pg_hba.conf` lets local replication in, and Postgres 15's defaults
    /// `wal_level=replica`, `max_wal_senders=10` allow it).
    pub fn replica(&self) -> PgProc {
        let dir = tempfile::tempdir().expect("tempdir");
        let _ = run(Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path()));
        let replica = PgProc {
            port: free_port(),
            max_connections: self.max_connections,
            dir,
        };
        let out = run(as_postgres("pg_basebackup")
            .arg("-D")
            .arg(replica.data())
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-R", "-X", "stream", "-c", "fast"]));
        assert!(
            replica.data().join("standby.signal").exists(),
            "pg_basebackup: {out}"
        );
        replica.start_again();
        replica
    }

    /// `pg_ctl stop -m immediate`: like a crash, no shutdown checkpoint.
    pub fn stop_immediate(&self) {
        stop_immediate(&self.data());
    }
}

/// `pg_ctl stop -m immediate` of the server on `data`, if one runs there.
pub(super) fn stop_immediate(data: &Path) {
    let _ = run(as_postgres("pg_ctl")
        .arg("-D")
        .arg(data)
        .args(["-m", "immediate", "-w", "stop"]));
}

impl Drop for PgProc {
    fn drop(&mut self) {
        self.stop_immediate();
    }
}

// ---- the service binary -------------------------------------------------------

/// The real `idempotency-ledger serve`, started with a config file.
pub struct LedgerProc {
    pub port: u16,
    child: Option<Child>,
    pub log: PathBuf,
    config: PathBuf,
}

impl LedgerProc {
    /// Writes `config` (TOML; `server.listen` is added) into `dir` and serves.
    pub fn start(dir: &Path, name: &str, config: &str) -> LedgerProc {
        let port = free_port();
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(
            &path,
            format!("[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 2\n{config}"),
        )
        .expect("config written");
        let log = dir.join(format!("{name}.log"));
        let mut p = LedgerProc {
            port,
            child: None,
            log,
            config: path,
        };
        p.spawn();
        p
    }

    fn spawn(&mut self) {
        let log = File::create(&self.log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_idempotency-ledger"))
            .arg("--config")
            .arg(&self.config)
            .arg("serve")
            .env(
                "RUST_LOG",
                std::env::var("LEDGER_TEST_LOG").unwrap_or_else(|_| "warn".to_owned()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("the service starts");
        self.child = Some(child);
    }

    pub fn address(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Waits until `/healthz` answers.
    pub async fn wait_ready(&mut self) {
        let url = format!("{}/healthz", self.address());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = reqwest::get(&url).await {
                if r.status().is_success() {
                    return;
                }
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!(
                    "the service exited ({status}): {}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "the service did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL, and reap it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Starts the binary again on the same port and config (after `kill`,
    /// or after it exited by itself); a running one is killed first.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Whether the process is still running (not exited, not killed).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(_) => {
                self.child = None;
                false
            }
            None => false,
        }
    }

    /// SIGSTOP: frozen, as a paused VM or a stop-the-world stall.
    pub fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    /// SIGCONT.
    pub fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    /// Waits at most `within` for the process to exit by itself (after a
    /// SIGTERM, say); its status, `None` if it is still running.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for LedgerProc {
    fn drop(&mut self) {
        self.kill();
    }
}

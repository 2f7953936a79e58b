//! The suite's own Postgres: one private server per test process, started
//! from a fresh `initdb` on the first test that needs it, with room for as
//! many connections as the suite opens at once. The machine's Postgres keeps
//! its stock settings (`max_connections` 100) and is never touched by the
//! suite, and the suite does not depend on how it was configured.
//!
//! `LEDGER_TEST_POSTGRES=postgres://user@host:port` runs the suite against
//! that server instead (it then needs `max_connections` of 80 per test
//! thread).
//!
//! The server is stopped when the test process exits (an `atexit` hook). A
//! process killed before that leaves its server running: the next run stops
//! it (each server's directory records the pid of the process it served).

use std::sync::OnceLock;

use super::procs::{stop_immediate, PgProc};

/// Connections the suite's server allows per test thread: up to three
/// instances (pool_size 8 + admin 2 + listeners each) and the test's own
/// pools, with room to spare.
const CONNECTIONS_PER_THREAD: u32 = 80;
const DIR_PREFIX: &str = "ledger-suite-pg-";

/// Connections the suite's server allows: enough for every test thread at
/// once (`--test-threads N`, else `RUST_TEST_THREADS`, else room for 8).
fn max_connections() -> u32 {
    let args: Vec<String> = std::env::args().collect();
    let from_args =
        args.iter()
            .enumerate()
            .find_map(|(i, a)| match a.strip_prefix("--test-threads") {
                Some("") => args.get(i + 1).cloned(),
                Some(rest) => rest.strip_prefix('=').map(str::to_owned),
                None => None,
            });
    let threads = from_args
        .or_else(|| std::env::var("RUST_TEST_THREADS").ok())
        .and_then(|t| t.parse::<u32>().ok())
        .unwrap_or(8)
        .clamp(2, 64);
    CONNECTIONS_PER_THREAD * threads + 50
}

/// Raises this process's soft limit on open files to its hard limit: the
/// suite's instances, links and pools open thousands at once, more than
/// a shell's usual soft limit of 1024.
fn raise_open_files_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: both calls only read or write the struct passed in.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
static SUITE: OnceLock<Suite> = OnceLock::new();

enum Suite {
    Private(PgProc),
    Given(String),
}

/// `postgres://postgres@127.0.0.1:PORT` of the suite's server.
pub fn base() -> String {
    match suite() {
        Suite::Private(pg) => pg.base(),
        Suite::Given(base) => base.clone(),
    }
}

/// The TCP port of the suite's server (for a link in front of it).
pub fn port() -> u16 {
    match suite() {
        Suite::Private(pg) => pg.port,
        Suite::Given(base) => url::Url::parse(base)
            .ok()
            .and_then(|u| u.port())
            .unwrap_or(5432),
    }
}

fn suite() -> &'static Suite {
    SUITE.get_or_init(|| {
        raise_open_files_limit();
        if let Ok(base) = std::env::var("LEDGER_TEST_POSTGRES") {
            return Suite::Given(base.trim_end_matches('/').to_owned());
        }
        stop_orphans();
        let dir = tempfile::Builder::new()
            .prefix(DIR_PREFIX)
            .tempdir()
            .expect("a directory for the suite's Postgres");
        std::fs::write(dir.path().join("owner.pid"), std::process::id().to_string())
            .expect("owner pid written");
        let pg = PgProc::start_in(dir, max_connections());
        // SAFETY: `stop_at_exit` is a plain `extern "C" fn()` that touches
        // only this static; registering it has no other precondition.
        unsafe { libc::atexit(stop_at_exit) };
        Suite::Private(pg)
    })
}

extern "C" fn stop_at_exit() {
    if let Some(Suite::Private(pg)) = SUITE.get() {
        pg.stop_immediate();
        let _ = std::fs::remove_dir_all(pg.dir());
    }
}

/// Stops the servers of earlier test processes that died before their
/// `atexit` hook ran, and removes their directories.
fn stop_orphans() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(DIR_PREFIX) {
            continue;
        }
        let dir = entry.path();
        let owner = std::fs::read_to_string(dir.join("owner.pid")).unwrap_or_default();
        let alive = owner.trim().parse::<i32>().is_ok_and(|pid| {
            // SAFETY: signal 0 only asks whether the process exists.
            unsafe { libc::kill(pid, 0) == 0 }
        });
        if !alive {
            stop_immediate(&dir.join("data"));
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

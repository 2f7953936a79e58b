//! The suite's own Postgres: one private server per test process, started
//! from a fresh `initdb` on the first test that needs it, with room for as
//! many connections as the suite opens at once. The machine's Postgres keeps
//! its stock settings (`max_connections` 100) and is never touched by the
//! suite, and the suite does not depend on how it was configured.
//!
//! `LEDGER_TEST_POSTGRES=postgres://user@host:port` runs the suite against
//! that server instead (it then needs `max_connections` of 300 or more).
//!
//! The server is stopped when the test process exits (an `atexit` hook). A
//! process killed before that leaves its server running: the next run stops
//! it (each server's directory records the pid of the process it served).

use std::sync::OnceLock;

use super::procs::{stop_immediate, PgProc};

/// Connections the suite's server allows: two test threads, each with up to
/// three in-process instances (pool_size 8 + admin 2 + listeners) and its own
/// test pools, with room to spare.
const MAX_CONNECTIONS: u32 = 300;
const DIR_PREFIX: &str = "ledger-suite-pg-";

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
        let pg = PgProc::start_in(dir, MAX_CONNECTIONS);
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

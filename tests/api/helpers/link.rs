//! [`Link`]: a TCP proxy between one instance and one server, which a test
//! stalls (bytes held until it opens again), slows (every chunk delayed) or
//! cuts (connections closed, new ones closed at once), so that one
//! instance's link fails while the server stays healthy for everyone else.
//! It can also close the connections open now when their client next writes
//! ([`Link::close_idle_on_write`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the link does with the bytes it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkState {
    Open,
    /// Holds every byte (both ways) until the link opens again.
    Stalled,
    /// Delays every chunk (both ways) by this much.
    Slow(Duration),
    /// Closes every connection, and every new one at once.
    Cut,
}

pub struct Link {
    port: u16,
    state: Arc<watch::Sender<LinkState>>,
    /// Connections numbered below this are closed when their client next
    /// writes (see [`Link::close_idle_on_write`]); each connection takes the
    /// next number of `made`.
    doomed_below: Arc<AtomicU64>,
    made: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl Link {
    /// A proxy on a free local port to `127.0.0.1:target`.
    pub async fn to(target: u16) -> Link {
        // Port 0: the kernel picks one that is free now (a port found free
        // first and bound later can be taken by another test in between).
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .expect("link port");
        let port = listener.local_addr().expect("link address").port();
        let (tx, _) = watch::channel(LinkState::Open);
        let state = Arc::new(tx);
        let st = state.clone();
        let doomed_below = Arc::new(AtomicU64::new(0));
        let made = Arc::new(AtomicU64::new(0));
        let (doomed, numbers) = (doomed_below.clone(), made.clone());
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let st = st.clone();
                let number = numbers.fetch_add(1, Ordering::SeqCst);
                let doomed = Doomed {
                    number,
                    below: doomed.clone(),
                };
                tokio::spawn(async move {
                    if *st.borrow() == LinkState::Cut {
                        return;
                    }
                    let Ok(outbound) = TcpStream::connect(("127.0.0.1", target)).await else {
                        return;
                    };
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    let mut up = tokio::spawn(pump(ri, wo, st.subscribe(), Some(doomed)));
                    let mut down = tokio::spawn(pump(ro, wi, st.subscribe(), None));
                    // Either direction ending ends the connection: the other
                    // is stopped, so both sockets close.
                    tokio::select! {
                        _ = &mut up => down.abort(),
                        _ = &mut down => up.abort(),
                    }
                });
            }
        });
        Link {
            port,
            state,
            doomed_below,
            made,
            accept,
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn set(&self, s: LinkState) {
        self.state.send_replace(s);
    }

    pub fn open(&self) {
        self.set(LinkState::Open);
    }
    pub fn stall(&self) {
        self.set(LinkState::Stalled);
    }
    pub fn cut(&self) {
        self.set(LinkState::Cut);
    }
    pub fn slow(&self, by: Duration) {
        self.set(LinkState::Slow(by));
    }

    /// Closes each connection open now when its client next writes, without
    /// passing the bytes on: a server that closed an idle connection, seen
    /// by the client only when it sends its next command on it (the command
    /// did not run). Connections made after this call pass as the link's
    /// state says.
    pub fn close_idle_on_write(&self) {
        self.doomed_below
            .store(self.made.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

/// A connection's number, and the bound below which it is closed on its
/// client's next write.
struct Doomed {
    number: u64,
    below: Arc<AtomicU64>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.set(LinkState::Cut);
        self.accept.abort();
    }
}

/// Copies `from` to `to` chunk by chunk, obeying the link's state before
/// forwarding each chunk; returns when either side closes, the link is cut,
/// or (the client's side, `doomed`) a chunk comes on a connection
/// [`Link::close_idle_on_write`] doomed.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut state: watch::Receiver<LinkState>,
    doomed: Option<Doomed>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            changed = state.changed() => {
                if changed.is_err() || *state.borrow() == LinkState::Cut {
                    return;
                }
                continue;
            }
        };
        if doomed
            .as_ref()
            .is_some_and(|d| d.number < d.below.load(Ordering::SeqCst))
        {
            return;
        }
        loop {
            let now = *state.borrow_and_update();
            match now {
                LinkState::Open => break,
                LinkState::Cut => return,
                LinkState::Slow(d) => {
                    tokio::time::sleep(d).await;
                    break;
                }
                LinkState::Stalled => {
                    if state.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

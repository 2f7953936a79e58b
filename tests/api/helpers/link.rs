//! [`Link`]: a TCP proxy between one instance and one server, which a test
//! stalls (bytes held until it opens again), slows (every chunk delayed) or
//! cuts (connections closed, new ones closed at once), so that one
//! instance's link fails while the server stays healthy for everyone else.

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
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let st = st.clone();
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
                    let up = tokio::spawn(pump(ri, wo, st.subscribe()));
                    let down = tokio::spawn(pump(ro, wi, st.subscribe()));
                    // Either direction ending ends the connection.
                    tokio::select! {
                        _ = up => {}
                        _ = down => {}
                    }
                });
            }
        });
        Link {
            port,
            state,
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
}

impl Drop for Link {
    fn drop(&mut self) {
        self.set(LinkState::Cut);
        self.accept.abort();
    }
}

/// Copies `from` to `to` chunk by chunk, obeying the link's state before
/// forwarding each chunk; returns when either side closes or the link is cut.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut state: watch::Receiver<LinkState>,
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

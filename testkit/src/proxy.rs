//! A loopback TCP proxy that tests put between a client and its server, to cut,
//! refuse, blackhole or stall the connection, or lose the server's answers,
//! while the server itself stays up.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

const PASS: u8 = 0;
const CUT: u8 = 1;
const BLACKHOLE: u8 = 2;
const STALL: u8 = 3;
const LOSE_ANSWERS: u8 = 4;
/// Loses the next answer only, then forwards again (see [`TcpProxy::lose_next_answer`]).
const LOSE_ONE_ANSWER: u8 = 5;

#[derive(Debug, Default)]
struct State {
    mode: AtomicU8,
    /// The copy tasks of every open connection.
    live: Mutex<Vec<AbortHandle>>,
}

/// A proxy on a free loopback port forwarding to `upstream`. Dropping it stops it
/// and closes every connection through it.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    state: Arc<State>,
    accept: JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on `127.0.0.1:0` and forwards each connection to `upstream`.
    /// Must be called inside a Tokio runtime, which runs the proxy.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
        let accept = tokio::spawn(accept_loop(listener, upstream, Arc::clone(&state)));
        Ok(Self {
            addr,
            state,
            accept,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every open connection and refuses new ones (accepted, then closed at
    /// once) until [`heal`](Self::heal): a server that went away.
    pub fn cut(&self) {
        self.state.mode.store(CUT, Ordering::SeqCst);
        for task in self.lock_live().drain(..) {
            task.abort();
        }
    }

    /// Keeps connections open but drops every byte in both directions until
    /// [`heal`](Self::heal): a network that swallows packets. New connections are
    /// accepted and swallowed too.
    pub fn blackhole(&self) {
        self.state.mode.store(BLACKHOLE, Ordering::SeqCst);
    }

    /// Holds every byte in both directions (nothing is lost) until
    /// [`heal`](Self::heal), which delivers them late: a congested network or a
    /// server that froze and woke up.
    pub fn stall(&self) {
        self.state.mode.store(STALL, Ordering::SeqCst);
    }

    /// Forwards requests to the server, but when the server's answer comes back
    /// drops it and closes that connection, until [`heal`](Self::heal): the server
    /// did the work and the client never learns it (a connection lost after the
    /// commit, before the reply was read).
    pub fn lose_answers(&self) {
        self.state.mode.store(LOSE_ANSWERS, Ordering::SeqCst);
    }

    /// Forwards every request, drops the first answer the server sends back and
    /// closes that connection, then forwards again: exactly one answer is lost,
    /// after the server did the work, and a client that re-sends the request
    /// on a new connection gets through. The write a driver repeats because its
    /// answer never came.
    pub fn lose_next_answer(&self) {
        self.state.mode.store(LOSE_ONE_ANSWER, Ordering::SeqCst);
    }

    /// Whether [`lose_next_answer`](Self::lose_next_answer)'s answer has been
    /// lost yet (`false` once it has, or when it was never asked).
    pub fn answer_pending_loss(&self) -> bool {
        self.state.mode.load(Ordering::SeqCst) == LOSE_ONE_ANSWER
    }

    /// Forwards again. Connections cut meanwhile stay closed; clients reconnect.
    pub fn heal(&self) {
        self.state.mode.store(PASS, Ordering::SeqCst);
    }

    fn lock_live(&self) -> std::sync::MutexGuard<'_, Vec<AbortHandle>> {
        self.state.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for task in self.lock_live().drain(..) {
            task.abort();
        }
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, state: Arc<State>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Out of descriptors or the like: back off instead of spinning.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        if state.mode.load(Ordering::SeqCst) == CUT {
            drop(client);
            continue;
        }
        let task = tokio::spawn(forward(client, upstream, Arc::clone(&state)));
        let mut live = state.live.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|t| !t.is_finished());
        live.push(task.abort_handle());
    }
}

async fn forward(client: TcpStream, upstream: SocketAddr, state: Arc<State>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, Arc::clone(&state), false);
    let down = pump(server_read, client_write, state, true);
    // Either side closing ends the connection.
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<State>,
    answers: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut mode = state.mode.load(Ordering::SeqCst);
        while mode == STALL {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            mode = state.mode.load(Ordering::SeqCst);
        }
        match mode {
            LOSE_ANSWERS if answers => return, // the answer is dropped, the connection closed
            // Only the first answer to arrive is lost; the others pass.
            LOSE_ONE_ANSWER
                if answers
                    && state
                        .mode
                        .compare_exchange(LOSE_ONE_ANSWER, PASS, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok() =>
            {
                return;
            }
            PASS | LOSE_ANSWERS | LOSE_ONE_ANSWER => {
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
            BLACKHOLE => {} // swallowed
            _ => return,
        }
    }
}

/// The `host:port` of a URL such as `postgres://user@127.0.0.1:5432/db` or
/// `redis://127.0.0.1:6379/0`, resolved, and the URL with that authority replaced
/// by `via` (to send the same client through a [`TcpProxy`]).
pub fn reroute(url: &str, via: SocketAddr) -> io::Result<(SocketAddr, String)> {
    use std::net::ToSocketAddrs;
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("no host:port in {url}"),
        )
    };
    let (scheme, rest) = url.split_once("://").ok_or_else(bad)?;
    let auth_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(auth_end);
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((user, hp)) => (format!("{user}@"), hp),
        None => (String::new(), authority),
    };
    let upstream = hostport.to_socket_addrs()?.next().ok_or_else(bad)?;
    Ok((upstream, format!("{scheme}://{userinfo}{via}{tail}")))
}

/// A proxy in front of the server of `url`, and the same URL through it: what a
/// conformance fixture hands out as its faulty handle's way to the server.
pub async fn proxied(url: &str) -> io::Result<(TcpProxy, String)> {
    let placeholder = SocketAddr::from(([127, 0, 0, 1], 1));
    let (upstream, _) = reroute(url, placeholder)?;
    let proxy = TcpProxy::start(upstream).await?;
    let (_, via) = reroute(url, proxy.addr())?;
    Ok((proxy, via))
}

/// The conformance suite's fault switch over a proxy: broken cuts every
/// connection through it and refuses new ones, healed forwards again; a lost
/// answer is [`TcpProxy::lose_next_answer`].
#[derive(Debug)]
pub struct ProxyFault(pub TcpProxy);

#[async_trait::async_trait]
impl dedupe_conformance::FaultSwitch for ProxyFault {
    async fn set_broken(&self, broken: bool) -> Result<(), dedupe_core::Error> {
        if broken {
            self.0.cut();
        } else {
            self.0.heal();
        }
        Ok(())
    }

    async fn lose_next_answer(&self) -> Result<bool, dedupe_core::Error> {
        self.0.lose_next_answer();
        Ok(true)
    }

    async fn answer_was_lost(&self) -> Result<bool, dedupe_core::Error> {
        let lost = !self.0.answer_pending_loss();
        // Never leave the mode armed for the next call.
        self.0.heal();
        Ok(lost)
    }
}

/// The fault switch over several proxies, one per server of a store (a
/// Cluster's nodes): broken cuts them all, healed forwards again through
/// all; a lost answer is armed on every one, so whichever node the next
/// call reaches loses its answer, and all are disarmed after.
#[derive(Debug)]
pub struct ProxiesFault(pub Vec<TcpProxy>);

#[async_trait::async_trait]
impl dedupe_conformance::FaultSwitch for ProxiesFault {
    async fn set_broken(&self, broken: bool) -> Result<(), dedupe_core::Error> {
        for proxy in &self.0 {
            if broken {
                proxy.cut();
            } else {
                proxy.heal();
            }
        }
        Ok(())
    }

    async fn lose_next_answer(&self) -> Result<bool, dedupe_core::Error> {
        for proxy in &self.0 {
            proxy.lose_next_answer();
        }
        Ok(true)
    }

    async fn answer_was_lost(&self) -> Result<bool, dedupe_core::Error> {
        let lost = self.0.iter().any(|p| !p.answer_pending_loss());
        for proxy in &self.0 {
            proxy.heal();
        }
        Ok(lost)
    }
}

//! `health`: asks a running service over plain HTTP and exits 0 when it
//! answers 2xx, 1 otherwise. For container health checks in an image without
//! curl: `idempotency-ledger health` asks `http://<server.listen>/readyz` of
//! the same configuration as `serve` (an unspecified listen address such as
//! `0.0.0.0` is asked on loopback).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::config::Settings;

/// `health` options.
#[derive(Debug, Args)]
pub struct HealthArgs {
    /// What to ask, e.g. http://127.0.0.1:8080/healthz. Default:
    /// http://<server.listen>/readyz.
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// Give up after this long (counts as unhealthy).
    #[arg(long, value_name = "DURATION", default_value = "3s", value_parser = super::admin::parse_duration)]
    pub timeout: Duration,
}

/// The address to ask for a service listening on `listen`.
pub fn local_address(listen: SocketAddr) -> SocketAddr {
    let ip = match listen.ip() {
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, listen.port())
}

pub fn run(file: Option<&Path>, args: HealthArgs) -> ExitCode {
    let url = match args.url {
        Some(u) => u,
        None => match Settings::load(file) {
            Ok(s) => format!("http://{}/readyz", local_address(s.server.listen)),
            Err(e) => {
                eprintln!("idempotency-ledger: {e}");
                return ExitCode::from(2);
            }
        },
    };
    let target = match Target::parse(&url) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("idempotency-ledger: --url: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("idempotency-ledger: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let timeout = args.timeout;
    match runtime.block_on(async { tokio::time::timeout(timeout, target.status()).await }) {
        Ok(Ok(status)) if (200..300).contains(&status) => ExitCode::SUCCESS,
        Ok(Ok(status)) => {
            eprintln!("idempotency-ledger: {url} answered {status}");
            ExitCode::from(1)
        }
        Ok(Err(e)) => {
            eprintln!("idempotency-ledger: {url}: {e:#}");
            ExitCode::from(1)
        }
        Err(_) => {
            eprintln!(
                "idempotency-ledger: {url}: no answer within {:?}",
                args.timeout
            );
            ExitCode::from(1)
        }
    }
}

/// A plain `http://host:port/path` to ask.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    host: String,
    port: u16,
    path: String,
}

impl Target {
    fn parse(text: &str) -> Result<Target, String> {
        let url = url::Url::parse(text).map_err(|e| format!("`{text}`: {e}"))?;
        if url.scheme() != "http" {
            return Err(format!(
                "`{text}`: only http:// (the service serves plain HTTP)"
            ));
        }
        let host = match url.host() {
            Some(url::Host::Ipv6(a)) => a.to_string(),
            Some(h) => h.to_string(),
            None => return Err(format!("`{text}` has no host")),
        };
        let mut path = url.path().to_owned();
        if let Some(q) = url.query() {
            path.push('?');
            path.push_str(q);
        }
        Ok(Target {
            host,
            port: url.port().unwrap_or(80),
            path,
        })
    }

    /// One `GET`, HTTP/1.1, `Connection: close`; the answer's status code.
    async fn status(&self) -> anyhow::Result<u16> {
        let mut stream = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .with_context(|| format!("connecting to {}:{}", self.host, self.port))?;
        let host = if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        };
        let request = format!(
            "GET {} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: idempotency-ledger-health\r\nConnection: close\r\n\r\n",
            self.path
        );
        stream.write_all(request.as_bytes()).await?;
        // The status line is all we need: `HTTP/1.1 200 OK`.
        let mut head = Vec::new();
        let mut buf = [0u8; 512];
        while !head.contains(&b'\n') && head.len() < 4096 {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        parse_status(&head).context("not an HTTP answer")
    }
}

fn parse_status(head: &[u8]) -> Option<u16> {
    let line = head.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/"))?;
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_and_status_lines() {
        assert_eq!(
            Target::parse("http://127.0.0.1:8080/readyz").unwrap(),
            Target {
                host: "127.0.0.1".into(),
                port: 8080,
                path: "/readyz".into()
            }
        );
        assert_eq!(Target::parse("http://[::1]:9/x?y=1").unwrap().host, "::1");
        assert!(Target::parse("https://127.0.0.1/readyz").is_err());
        assert!(Target::parse("nonsense").is_err());
        assert_eq!(
            parse_status(b"HTTP/1.1 503 Service Unavailable\r\n"),
            Some(503)
        );
        assert_eq!(parse_status(b"SSH-2.0-OpenSSH\r\n"), None);
        assert_eq!(
            local_address("0.0.0.0:8080".parse().unwrap()),
            "127.0.0.1:8080".parse().unwrap()
        );
        assert_eq!(
            local_address("[::]:8080".parse().unwrap()),
            "[::1]:8080".parse().unwrap()
        );
    }
}

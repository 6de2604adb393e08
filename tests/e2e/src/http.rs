//! A plain HTTP/1.1 GET of a local endpoint (`/metrics`, `/healthz`, `/readyz`), as a probe or a
//! scraper makes it.

use std::io::{Read, Write};
use std::time::Duration;

/// `GET path` on `127.0.0.1:port`: the status code and the body.
///
/// # Errors
/// When the endpoint cannot be reached within 10 s or answers no status line.
pub async fn get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let answer = get_at((std::net::Ipv4Addr::LOCALHOST, port).into(), path, None).await?;
    Ok((answer.status, answer.body))
}

/// An HTTP answer.
#[derive(Clone, Debug, Default)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The status line and the headers, as sent.
    pub head: String,
    /// The body.
    pub body: String,
}

/// `GET path` on `address`, with `Authorization: Bearer <token>` when `token` is given, as
/// Prometheus scrapes with `authorization.credentials_file`.
///
/// # Errors
/// When the endpoint cannot be reached within 10 s or answers no status line.
pub async fn get_at(
    address: std::net::SocketAddr,
    path: &str,
    token: Option<&str>,
) -> std::io::Result<Answer> {
    let path = path.to_owned();
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(10))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\n{authorization}Connection: close\r\n\r\n"
        )?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("GET {path}: no status line")))?;
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        Ok(Answer {
            status,
            head: head.to_owned(),
            body: body.to_owned(),
        })
    })
    .await
    .map_err(std::io::Error::other)?
}

/// The value of the sample `name` (with its labels, exactly as exposed) in a metrics text.
pub fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

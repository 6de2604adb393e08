//! A plain HTTP/1.1 GET of a local endpoint (`/metrics`, `/healthz`, `/readyz`), as a probe or a
//! scraper makes it.

use std::io::{Read, Write};
use std::time::Duration;

/// `GET path` on `127.0.0.1:port`: the status code and the body.
///
/// # Errors
/// When the endpoint cannot be reached within 10 s or answers no status line.
pub async fn get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("GET {path}: no status line")))?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((status, body))
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

//! An HTTP/1.1 GET of an endpoint (`/metrics`, `/usage`, `/healthz`, `/readyz`), plain or over
//! TLS, as a probe or a scraper makes it.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

/// How an endpoint is reached.
#[derive(Clone, Debug, Default)]
pub enum Transport {
    /// Plain HTTP.
    #[default]
    Plain,
    /// TLS accepting any certificate, as the kubelet's HTTPS probes and Prometheus's
    /// `insecure_skip_verify` do (the plugin's self-signed certificate).
    TlsAnyCertificate,
    /// TLS verified against a CA, for a name the certificate must hold.
    TlsVerified {
        /// The CA certificate, PEM.
        ca_pem: String,
        /// The server name checked against the certificate.
        server_name: String,
    },
}

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
    get_via(address, path, token, Transport::Plain).await
}

/// `GET path` on `address` over `transport`, with `Authorization: Bearer <token>` when `token`
/// is given.
///
/// # Errors
/// When the endpoint cannot be reached within 10 s, the TLS handshake fails (the certificate
/// is refused, or the endpoint speaks plain HTTP), or it answers no status line.
pub async fn get_via(
    address: std::net::SocketAddr,
    path: &str,
    token: Option<&str>,
    transport: Transport,
) -> std::io::Result<Answer> {
    let path = path.to_owned();
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    tokio::task::spawn_blocking(move || {
        let tcp = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(10))?;
        tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
        let config = match transport {
            Transport::Plain => return exchange(tcp, &path, &authorization),
            Transport::TlsAnyCertificate => (
                gpu_kubelet_plugin::http::tls::unverified_client_config(),
                "localhost".to_owned(),
            ),
            Transport::TlsVerified {
                ca_pem,
                server_name,
            } => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
                    roots
                        .add(cert.map_err(std::io::Error::other)?)
                        .map_err(std::io::Error::other)?;
                }
                let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(std::io::Error::other)?
                .with_root_certificates(roots)
                .with_no_client_auth();
                (config, server_name)
            }
        };
        let name = ServerName::try_from(config.1).map_err(std::io::Error::other)?;
        let connection = rustls::ClientConnection::new(Arc::new(config.0), name)
            .map_err(std::io::Error::other)?;
        exchange(
            rustls::StreamOwned::new(connection, tcp),
            &path,
            &authorization,
        )
    })
    .await
    .map_err(std::io::Error::other)?
}

/// One request on `s`, read to its end.
fn exchange(mut s: impl Read + Write, path: &str, authorization: &str) -> std::io::Result<Answer> {
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\n{authorization}Connection: close\r\n\r\n"
    )?;
    let mut bytes = Vec::new();
    match s.read_to_end(&mut bytes) {
        Ok(_) => {}
        // A TLS peer that closes without close_notify has still sent what it read into
        // `bytes` (read_to_end keeps it); an empty answer is an error below.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !bytes.is_empty() => {}
        Err(e) => return Err(e),
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
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
}

/// The value of the sample `name` (with its labels, exactly as exposed) in a metrics text.
pub fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

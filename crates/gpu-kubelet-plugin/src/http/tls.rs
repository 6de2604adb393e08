//! TLS for the plugin's HTTP endpoint (`--http-tls`): callers send bearer tokens to `/metrics`
//! and `/usage` ([`super::auth`]), which must not cross the pod network in the clear.
//!
//! - **Files** (`--http-tls-cert-file`, `--http-tls-key-file`): a PEM certificate chain (leaf
//!   first) and its PEM private key (PKCS#8, PKCS#1 or SEC1), e.g. a `kubernetes.io/tls` Secret
//!   mounted by the chart (`http.tls.secretName`) or written by cert-manager. They are read
//!   again every [`RELOAD_INTERVAL`]; a renewed pair is served from the next handshake on. A
//!   pair that cannot be read, parsed or does not match is logged and the last good one stays.
//! - **Self-signed** (no files): a certificate made at start (ECDSA P-256, valid
//!   [`SELF_SIGNED_DAYS`] days, names `localhost`, `127.0.0.1`, `::1` and the node's name),
//!   as controller-runtime's metrics server does without a certificate directory. Its SHA-256
//!   fingerprint is logged so a client can pin it. Callers that cannot verify it skip
//!   verification: the kubelet's HTTPS probes always do (`k8s.io/kubernetes`
//!   `pkg/probe/http/http.go` `New`), Prometheus with `tls_config.insecure_skip_verify`.
//!
//! Each handshake must finish within [`HANDSHAKE_TIMEOUT`], so a client that opens a
//! connection and sends nothing holds no task for long. ALPN offers `http/1.1` only, the one
//! protocol served. TLS 1.2 and 1.3 with rustls's defaults (ring).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use sha2::{Digest, Sha256};
use tokio_rustls::TlsAcceptor;
use tracing::{info, warn};

/// How long a client has to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the certificate and key files are read again.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(60);

/// Validity of the self-signed certificate, in days (the plugin makes a new one at each start).
pub const SELF_SIGNED_DAYS: i64 = 365;

pub use crate::config::{HalfTlsPair, TlsSource};

/// The endpoint's certificate could not be made or loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no PEM object of the kind needed.
    #[error("{what} {path}: {reason}")]
    File {
        /// "certificate" or "private key".
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The key does not fit the certificate, or rustls refused either.
    #[error("certificate {cert} with key {key}: {source}")]
    Pair {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's verdict.
        source: rustls::Error,
    },
    /// The self-signed certificate could not be made.
    #[error("making a self-signed certificate: {0}")]
    SelfSigned(String),
    /// rustls refused the server configuration.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// The certificate served, swapped in place when the files change.
#[derive(Debug)]
struct Current {
    key: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // A poisoned lock still holds the last good key.
        Some(Arc::clone(
            &self.key.read().unwrap_or_else(|e| e.into_inner()),
        ))
    }
}

/// The endpoint's TLS: an acceptor whose certificate follows [`TlsSource`].
pub struct ServerTls {
    acceptor: TlsAcceptor,
    current: Arc<Current>,
    source: TlsSource,
    provider: Arc<CryptoProvider>,
}

impl ServerTls {
    /// Makes or loads the certificate (file reads run on the blocking pool).
    ///
    /// # Errors
    /// [`TlsError`] naming the file and the cause; the plugin does not start without its
    /// certificate, rather than serve tokens in the clear.
    pub async fn new(source: TlsSource) -> Result<Self, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = {
            let (source, provider) = (source.clone(), Arc::clone(&provider));
            tokio::task::spawn_blocking(move || load(&source, &provider))
                .await
                .map_err(|e| TlsError::SelfSigned(format!("the loading task failed: {e}")))??
        };
        info!(
            certificate = %describe(&source),
            sha256 = %fingerprint(&key),
            "serving the HTTP endpoint over TLS"
        );
        let current = Arc::new(Current {
            key: RwLock::new(key),
        });
        let mut config = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(&current) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            current,
            source,
            provider,
        })
    }

    /// The acceptor for each connection.
    pub fn acceptor(&self) -> TlsAcceptor {
        self.acceptor.clone()
    }

    /// The SHA-256 fingerprint (lowercase hex) of the leaf certificate served now.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.current.key.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Reads the files again and serves their pair when it differs from the one served;
    /// `Ok(false)` when unchanged or self-signed.
    ///
    /// # Errors
    /// [`TlsError`]; the pair served stays.
    pub async fn reload(&self) -> Result<bool, TlsError> {
        if matches!(self.source, TlsSource::SelfSigned { .. }) {
            return Ok(false);
        }
        let (source, provider) = (self.source.clone(), Arc::clone(&self.provider));
        let fresh = tokio::task::spawn_blocking(move || load(&source, &provider))
            .await
            .map_err(|e| TlsError::SelfSigned(format!("the loading task failed: {e}")))??;
        let mut served = self.current.key.write().unwrap_or_else(|e| e.into_inner());
        if served.cert == fresh.cert {
            return Ok(false);
        }
        *served = fresh;
        Ok(true)
    }

    /// Reloads every [`RELOAD_INTERVAL`] until the task is dropped or aborted.
    pub async fn keep_reloading(self: Arc<Self>) {
        let mut tick = tokio::time::interval(RELOAD_INTERVAL);
        tick.tick().await;
        loop {
            tick.tick().await;
            match self.reload().await {
                Ok(true) => info!(
                    certificate = %describe(&self.source),
                    sha256 = %self.fingerprint(),
                    "serving the renewed certificate"
                ),
                Ok(false) => {}
                Err(e) => warn!(error = %e, "the certificate files could not be loaded again; \
                    the last good certificate stays"),
            }
        }
    }
}

fn describe(source: &TlsSource) -> String {
    match source {
        TlsSource::SelfSigned { names } => format!("self-signed for {}", names.join(", ")),
        TlsSource::Files { cert, .. } => cert.display().to_string(),
    }
}

fn fingerprint(key: &CertifiedKey) -> String {
    key.cert.first().map_or_else(String::new, |leaf| {
        Sha256::digest(leaf.as_ref())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    })
}

/// Blocking: makes or reads the pair.
fn load(source: &TlsSource, provider: &CryptoProvider) -> Result<Arc<CertifiedKey>, TlsError> {
    match source {
        TlsSource::SelfSigned { names } => {
            let made = self_signed(names)?;
            let key =
                PrivateKeyDer::try_from(made.1).map_err(|e| TlsError::SelfSigned(e.to_owned()))?;
            let key = CertifiedKey::from_der(vec![made.0], key, provider)
                .map_err(|e| TlsError::SelfSigned(e.to_string()))?;
            Ok(Arc::new(key))
        }
        TlsSource::Files { cert, key } => {
            let chain = read_chain(cert)?;
            let private = read_key(key)?;
            CertifiedKey::from_der(chain, private, provider)
                .map(Arc::new)
                .map_err(|source| TlsError::Pair {
                    cert: cert.clone(),
                    key: key.clone(),
                    source,
                })
        }
    }
}

fn self_signed(names: &[String]) -> Result<(CertificateDer<'static>, Vec<u8>), TlsError> {
    let err = |e: rcgen::Error| TlsError::SelfSigned(e.to_string());
    let mut params = rcgen::CertificateParams::new(names.to_vec()).map_err(err)?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "drust gpu-kubelet-plugin");
    let start = time::OffsetDateTime::now_utc();
    params.not_before = start;
    params.not_after = start + time::Duration::days(SELF_SIGNED_DAYS);
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let key = rcgen::KeyPair::generate().map_err(err)?;
    let cert = params.self_signed(&key).map_err(err)?;
    Ok((cert.der().clone(), key.serialize_der()))
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let err = |reason: String| TlsError::File {
        what: "certificate",
        path: path.to_owned(),
        reason,
    };
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(e.to_string()))?;
    if chain.is_empty() {
        return Err(err("no PEM CERTIFICATE block".into()));
    }
    Ok(chain)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::File {
        what: "private key",
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// A TLS client configuration that accepts any certificate the endpoint shows, while still
/// checking that the endpoint holds its key (the handshake's signatures are verified).
///
/// For callers whose channel to the plugin is already authenticated end to end: `dractl top`
/// reads `/usage` through a port-forward, which the API server and the kubelet carry over their
/// own authenticated TLS into the plugin pod's network namespace, so nothing between could
/// present another certificate. It is what the kubelet's HTTPS probes do (above), and what a
/// self-signed certificate ([`TlsSource::SelfSigned`]) leaves any other caller.
pub fn unverified_client_config() -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = Arc::new(AnyCertificate(Arc::clone(&provider)));
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap_or_else(|_| unreachable!("ring's default provider supports TLS 1.2 and 1.3"))
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config
}

/// Accepts any certificate chain; verifies handshake signatures with the provider's algorithms.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::ServerName;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A PEM pair made by rcgen for `localhost`, written to `dir` as `name.crt`/`name.key`.
    fn write_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (c, k) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }

    /// One HTTP/1.1 exchange over TLS with a client that trusts only `trusted` (DER).
    async fn exchange(tls: &ServerTls, trusted: CertificateDer<'static>) -> Result<String, String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let acceptor = tls.acceptor();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let Ok(mut stream) = acceptor.accept(tcp).await else {
                return;
            };
            let mut buf = [0u8; 64];
            let _ = stream.read(&mut buf).await;
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await;
            let _ = stream.shutdown().await;
        });
        let mut roots = rustls::RootCertStore::empty();
        roots.add(trusted).unwrap();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
        let result = async {
            let mut stream = connector
                .connect(ServerName::try_from("localhost").unwrap(), tcp)
                .await
                .map_err(|e| e.to_string())?;
            stream
                .write_all(b"GET / HTTP/1.1\r\n\r\n")
                .await
                .map_err(|e| e.to_string())?;
            let mut answer = String::new();
            stream
                .read_to_string(&mut answer)
                .await
                .map_err(|e| e.to_string())?;
            Ok(answer)
        }
        .await;
        let _ = server.await;
        result
    }

    fn served(tls: &ServerTls) -> CertificateDer<'static> {
        tls.current.key.read().unwrap().cert[0].clone()
    }

    #[tokio::test]
    async fn a_self_signed_certificate_serves_its_names_to_a_client_that_pins_it() {
        let source = TlsSource::from_flags(None, None, "gpu-node-a").unwrap();
        assert_eq!(
            source,
            TlsSource::SelfSigned {
                names: ["localhost", "127.0.0.1", "::1", "gpu-node-a"]
                    .map(String::from)
                    .to_vec()
            }
        );
        let tls = ServerTls::new(source).await.unwrap();
        assert_eq!(tls.fingerprint().len(), 64);
        let answer = exchange(&tls, served(&tls)).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        // Self-signed: nothing to reload.
        assert!(!tls.reload().await.unwrap());
    }

    #[tokio::test]
    async fn a_client_that_trusts_another_certificate_is_refused() {
        let tls = ServerTls::new(TlsSource::from_flags(None, None, "n").unwrap())
            .await
            .unwrap();
        let other = ServerTls::new(TlsSource::from_flags(None, None, "n").unwrap())
            .await
            .unwrap();
        let err = exchange(&tls, served(&other)).await.unwrap_err();
        assert!(err.contains("invalid peer certificate"), "{err}");
    }

    #[tokio::test]
    async fn files_are_served_and_a_renewed_pair_replaces_them_at_the_next_reload() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = write_pair(dir.path(), "tls");
        let tls = ServerTls::new(TlsSource::Files {
            cert: cert.clone(),
            key: key.clone(),
        })
        .await
        .unwrap();
        let first = served(&tls);
        assert!(exchange(&tls, first.clone()).await.is_ok());
        assert!(!tls.reload().await.unwrap(), "unchanged files");

        // Renewed (as cert-manager rewrites a Secret): served from the next handshake.
        let (c2, k2) = write_pair(dir.path(), "renewed");
        std::fs::rename(c2, &cert).unwrap();
        std::fs::rename(k2, &key).unwrap();
        let before = tls.fingerprint();
        assert!(tls.reload().await.unwrap());
        assert_ne!(tls.fingerprint(), before);
        let renewed = served(&tls);
        assert!(exchange(&tls, renewed.clone()).await.is_ok());
        assert!(
            exchange(&tls, first).await.is_err(),
            "the old certificate is gone"
        );

        // A broken write: an error naming the file; the renewed pair stays.
        std::fs::write(&cert, "not PEM").unwrap();
        let err = tls.reload().await.unwrap_err().to_string();
        assert!(
            err.contains("certificate") && err.contains("tls.crt"),
            "{err}"
        );
        assert!(exchange(&tls, renewed).await.is_ok());
    }

    #[tokio::test]
    async fn bad_files_are_refused_at_start_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, _) = write_pair(dir.path(), "a");
        let (_, other_key) = write_pair(dir.path(), "b");
        let missing = dir.path().join("missing.key");
        for (key, want) in [
            (other_key, "with key"),
            (missing.clone(), "private key"),
            (cert.clone(), "private key"),
        ] {
            let err = ServerTls::new(TlsSource::Files {
                cert: cert.clone(),
                key: key.clone(),
            })
            .await
            .err()
            .expect("refused")
            .to_string();
            assert!(
                err.contains(want) && err.contains(&*key.to_string_lossy()),
                "{key:?}: {err}"
            );
        }
        assert!(TlsSource::from_flags(Some(cert), None, "n").is_err());
    }

    #[tokio::test]
    async fn the_unverified_client_reaches_a_self_signed_endpoint() {
        let tls = ServerTls::new(TlsSource::from_flags(None, None, "n").unwrap())
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let acceptor = tls.acceptor();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut stream = acceptor.accept(tcp).await.unwrap();
            stream.write_all(b"hello").await.unwrap();
            stream.shutdown().await.unwrap();
        });
        let connector = tokio_rustls::TlsConnector::from(Arc::new(unverified_client_config()));
        let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
        let mut stream = connector
            .connect(ServerName::try_from("anything").unwrap(), tcp)
            .await
            .unwrap();
        let mut got = String::new();
        stream.read_to_string(&mut got).await.unwrap();
        assert_eq!(got, "hello");
        server.await.unwrap();
    }
}

//! Scrapes an endpoint the way Prometheus does: one job of a `prometheus.yml`
//! (`scrape_configs` entry) run by `tests/gotools/promcheck -scrape`, which loads it into
//! Prometheus's own HTTP client configuration and client (`prometheus/common/config`), sends
//! Prometheus's Accept header, and parses the body with Prometheus's parser
//! (`model/textparse`).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

/// How long one scrape may take, promcheck's start included.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(30);

/// What one scrape saw.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Scrape {
    /// The HTTP status.
    pub status: u16,
    /// The answer's Content-Type.
    pub content_type: String,
    /// How many series samples parsed.
    #[serde(default)]
    pub samples: u64,
    /// The metric names seen.
    #[serde(default)]
    pub metrics: Vec<String>,
}

/// Scrapes `target` once with `job` (a `scrape_configs` entry, as JSON), written to `dir` so
/// that its relative file names (`ca_file`, `credentials_file`) resolve there.
///
/// # Errors
/// Why the scrape failed (the job does not load, the TLS handshake or the request failed, a
/// status other than 200, a body Prometheus cannot parse), with promcheck's words, or that it
/// did not finish within [`SCRAPE_TIMEOUT`].
pub async fn scrape(
    job: &serde_json::Value,
    dir: &Path,
    target: SocketAddr,
) -> Result<Scrape, String> {
    let tool = drust_gotools::go_module_tool("promcheck")?;
    let file = dir.join("scrape-job.yaml");
    let yaml = serde_yaml_ng::to_string(job).map_err(|e| e.to_string())?;
    std::fs::write(&file, yaml).map_err(|e| format!("{}: {e}", file.display()))?;
    let run = tokio::process::Command::new(tool)
        .arg("-scrape")
        .arg(&file)
        .arg("-target")
        .arg(target.to_string())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(SCRAPE_TIMEOUT, run)
        .await
        .map_err(|_| format!("promcheck -scrape did not finish within {SCRAPE_TIMEOUT:?}"))?
        .map_err(|e| format!("promcheck -scrape: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("promcheck's answer: {e}"))
}

//! Helm, built from its Go module by `tests/scripts/build-helm.sh`, run against the chart in
//! `deploy/helm/drust`.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use crate::manifests::repo_path;

/// Path of the build script, from this crate's manifest directory (`tests/e2e`).
const BUILD_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/scripts/build-helm.sh"
);

/// Running Helm failed.
#[derive(Debug, thiserror::Error)]
pub enum HelmError {
    /// Helm could not be started.
    #[error("running {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        source: std::io::Error,
    },
    /// The build script could not run or failed.
    #[error(transparent)]
    Build(#[from] crate::scripts::ScriptError),
    /// The build script's last line is not an executable.
    #[error("{script} printed {printed:?}, which is not the helm binary")]
    BinaryMissing {
        /// The script.
        script: String,
        /// Its last stdout line.
        printed: String,
    },
    /// helm ran and failed.
    #[error("helm {args} failed ({status}): {stderr}")]
    Failed {
        /// Its arguments, space-separated.
        args: String,
        /// How it exited.
        status: std::process::ExitStatus,
        /// What it printed to stderr.
        stderr: String,
    },
}

/// The chart's directory.
pub fn chart_path() -> PathBuf {
    repo_path("deploy/helm/drust")
}

/// Builds Helm once (cached in `$DRUST_CACHE_DIR/helm/<version>/`, default `~/.cache/drust`)
/// and returns the binary; the build's progress goes to stderr.
///
/// # Errors
/// [`HelmError`] when the script cannot run or fails.
pub async fn helm_binary() -> Result<PathBuf, HelmError> {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    if let Some(bin) = BUILT.get() {
        return Ok(bin.clone());
    }
    let printed = crate::scripts::last_line(Path::new(BUILD_SCRIPT), &[]).await?;
    let bin = PathBuf::from(&printed);
    if !bin.is_file() {
        return Err(HelmError::BinaryMissing {
            script: BUILD_SCRIPT.to_owned(),
            printed,
        });
    }
    Ok(BUILT.get_or_init(|| bin).clone())
}

/// Runs `helm <args>` and returns its stdout.
///
/// # Errors
/// [`HelmError::Failed`] with helm's stderr when it exits non-zero.
pub async fn helm(args: &[&str]) -> Result<String, HelmError> {
    helm_in(None, args).await
}

/// Runs `helm <args>` with its cache, configuration and data (`HELM_CACHE_HOME`,
/// `HELM_CONFIG_HOME`, `HELM_DATA_HOME`) under `home` when given, so a test leaves nothing in
/// the user's home; returns its stdout.
///
/// # Errors
/// [`HelmError::Failed`] with helm's stderr when it exits non-zero.
pub async fn helm_in(home: Option<&Path>, args: &[&str]) -> Result<String, HelmError> {
    let bin = helm_binary().await?;
    let mut command = tokio::process::Command::new(&bin);
    if let Some(home) = home {
        command
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"));
    }
    let output = command
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|source| HelmError::Spawn {
            program: bin.display().to_string(),
            source,
        })?;
    if !output.status.success() {
        return Err(HelmError::Failed {
            args: args.join(" "),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// `helm template <release> deploy/helm/drust --namespace <namespace>` with `--set` for each of
/// `set` (`key=value`): the manifests an install would apply.
///
/// # Errors
/// [`HelmError::Failed`] with helm's message (a schema violation, a failed check).
pub async fn template(release: &str, namespace: &str, set: &[&str]) -> Result<String, HelmError> {
    let chart = chart_path();
    let chart = chart.to_string_lossy();
    let mut args = vec!["template", release, &chart, "--namespace", namespace];
    for s in set {
        args.extend(["--set", s]);
    }
    helm(&args).await
}

/// Applies the DeviceClasses the chart renders with `set` (as `helm install` would create them)
/// and returns them, as rendered.
///
/// # Errors
/// When the chart does not render, or the API server refuses a class.
pub async fn apply_device_classes(
    client: &kube::Client,
    set: &[&str],
) -> Result<Vec<serde_json::Value>, String> {
    use serde::Deserialize as _;
    let rendered = template("drust", "drust-system", set)
        .await
        .map_err(|e| e.to_string())?;
    let mut classes = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&rendered) {
        let value = serde_yaml_ng::Value::deserialize(doc).map_err(|e| e.to_string())?;
        if value["kind"].as_str() != Some("DeviceClass") {
            continue;
        }
        let text = serde_yaml_ng::to_string(&value).map_err(|e| e.to_string())?;
        crate::manifests::apply_yaml(client, &text, Path::new("chart DeviceClass"))
            .await
            .map_err(|e| e.to_string())?;
        classes.push(serde_json::to_value(&value).map_err(|e| e.to_string())?);
    }
    Ok(classes)
}

/// `helm install <release>` of the chart into `namespace` (created), against the API server of
/// `kubeconfig`, with `home` as Helm's directories ([`helm_in`]): the chart's pods reach the API
/// server at `api` (`KUBERNETES_SERVICE_HOST`/`_PORT` through `extraEnv`, since the test nodes
/// run no kube-proxy), and each of `sets` is a `--set`. Returns helm's output, which says
/// `STATUS: deployed`.
///
/// # Errors
/// [`HelmError::Failed`] when helm fails, or says anything but deployed.
pub async fn install_chart(
    home: &Path,
    kubeconfig: &Path,
    release: &str,
    namespace: &str,
    api: (std::net::IpAddr, u16),
    sets: &[String],
) -> Result<String, HelmError> {
    let env = serde_json::json!([
        {"name": "KUBERNETES_SERVICE_HOST", "value": api.0.to_string()},
        {"name": "KUBERNETES_SERVICE_PORT", "value": api.1.to_string()},
    ]);
    let mut args = vec![
        "install".to_owned(),
        release.to_owned(),
        chart_path().display().to_string(),
        "--namespace".to_owned(),
        namespace.to_owned(),
        "--create-namespace".to_owned(),
        format!("--kubeconfig={}", kubeconfig.display()),
        "--set-json".to_owned(),
        format!("extraEnv={env}"),
    ];
    for s in sets {
        args.extend(["--set".to_owned(), s.clone()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let installed = helm_in(Some(home), &args).await?;
    if !installed.contains("STATUS: deployed") {
        return Err(HelmError::Failed {
            args: args.join(" "),
            status: std::process::ExitStatus::default(),
            stderr: installed,
        });
    }
    Ok(installed)
}

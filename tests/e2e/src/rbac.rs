//! Identities holding only the roles the project ships in `deploy/rbac/`, for tests that run a
//! tool as a user would.

use std::path::Path;

use crate::ControlPlane;
use crate::manifests::{apply_file, apply_yaml, repo_path};

/// Writes to `path` a kubeconfig for ServiceAccount `default/topper`, bound to the role of
/// `deploy/rbac/dractl-top.yaml` (in `drust-system`) and to nothing else, applying both with
/// `client` (an admin).
///
/// # Errors
/// Applying the role or the binding, minting the token or writing the file failed.
pub async fn dractl_top_kubeconfig(
    cp: &ControlPlane,
    client: &kube::Client,
    path: &Path,
) -> anyhow::Result<()> {
    apply_file(client, &repo_path("deploy/rbac/dractl-top.yaml")).await?;
    apply_yaml(
        client,
        r#"
apiVersion: v1
kind: ServiceAccount
metadata: {name: topper, namespace: default}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: dractl-top, namespace: drust-system}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: dractl-top}
subjects: [{kind: ServiceAccount, name: topper, namespace: default}]
"#,
        Path::new("topper identity"),
    )
    .await?;
    cp.write_kubeconfig(path, &cp.service_account_token("default", "topper").await?)?;
    Ok(())
}

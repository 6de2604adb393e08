//! Identities holding only the roles the project ships in `deploy/rbac/`, for tests that run a
//! tool as a user would.

use std::path::Path;

use crate::ControlPlane;
use crate::manifests::{apply_file, apply_yaml, repo_path};

/// Writes to `path` a kubeconfig for ServiceAccount `default/topper`, bound to the roles of
/// `deploy/rbac/dractl-top.yaml` (the Role in `drust-system` and the ClusterRole for every
/// namespace's usage) and to nothing else, applying them with `client` (an admin).
///
/// # Errors
/// Applying the roles or the bindings, minting the token or writing the file failed.
pub async fn dractl_top_kubeconfig(
    cp: &ControlPlane,
    client: &kube::Client,
    path: &Path,
) -> anyhow::Result<()> {
    apply_yaml(
        client,
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: topper, namespace: default}\n",
        Path::new("topper identity"),
    )
    .await?;
    bind_dractl_top(
        client,
        "topper",
        "{kind: ServiceAccount, name: topper, namespace: default}",
        true,
    )
    .await?;
    cp.write_kubeconfig(path, &cp.service_account_token("default", "topper").await?)?;
    Ok(())
}

/// Writes to `path` a kubeconfig for ServiceAccount `default/<account>`, bound to the
/// ClusterRole of `deploy/rbac/dractl-explain.yaml` (what `dractl explain` and a live `dractl
/// simulate` read) and to nothing else, applying it with `client` (an admin).
///
/// # Errors
/// Applying the role or the binding, minting the token or writing the file failed.
pub async fn dractl_explain_kubeconfig(
    cp: &ControlPlane,
    client: &kube::Client,
    account: &str,
    path: &Path,
) -> anyhow::Result<()> {
    apply_file(client, &repo_path("deploy/rbac/dractl-explain.yaml")).await?;
    apply_yaml(
        client,
        &format!(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: {account}, namespace: default}}\n\
             ---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\n\
             metadata: {{name: dractl-explain-{account}}}\n\
             roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: dractl-explain}}\n\
             subjects: [{{kind: ServiceAccount, name: {account}, namespace: default}}]\n"
        ),
        Path::new("dractl explain identity"),
    )
    .await?;
    cp.write_kubeconfig(path, &cp.service_account_token("default", account).await?)?;
    Ok(())
}

/// Applies `deploy/rbac/dractl-top.yaml` and binds its Role (reach the node plugins) to
/// `subject` (an RBAC subject as a YAML flow mapping), and with `every_namespace` its ClusterRole
/// (`get /usage`) too; the bindings are named `dractl-top-<name>`.
///
/// # Errors
/// Applying the roles or the bindings failed.
pub async fn bind_dractl_top(
    client: &kube::Client,
    name: &str,
    subject: &str,
    every_namespace: bool,
) -> anyhow::Result<()> {
    apply_file(client, &repo_path("deploy/rbac/dractl-top.yaml")).await?;
    let mut bindings = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\n\
         metadata: {{name: dractl-top-{name}, namespace: drust-system}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: dractl-top}}\n\
         subjects: [{subject}]\n"
    );
    if every_namespace {
        bindings.push_str(&format!(
            "---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\n\
             metadata: {{name: dractl-top-usage-{name}}}\n\
             roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, \
             name: dractl-top-usage}}\n\
             subjects: [{subject}]\n"
        ));
    }
    apply_yaml(client, &bindings, Path::new("dractl top bindings")).await?;
    Ok(())
}

/// Writes to `path` a kubeconfig of the chart's node plugin on `node` (release `drust` in
/// `drust-system`): ServiceAccount `drust-kubelet-plugin` with a token bound to the DaemonSet's
/// pod that the scheduler bound to `node`, as the kubelet projects it, once that pod exists
/// (within `timeout`). Returns the pod.
///
/// # Errors
/// No such pod within `timeout`, or minting the token or writing the file failed.
pub async fn chart_plugin_kubeconfig(
    cp: &ControlPlane,
    admin: &kube::Client,
    node: &str,
    path: &Path,
    timeout: std::time::Duration,
) -> anyhow::Result<k8s_openapi::api::core::v1::Pod> {
    use k8s_openapi::api::core::v1::Pod;
    let pods: kube::Api<Pod> = kube::Api::namespaced(admin.clone(), "drust-system");
    let pod = crate::wait::until(
        &format!("the chart's plugin pod bound to {node}"),
        timeout,
        || async {
            let list = pods
                .list(&kube::api::ListParams::default().labels("app.kubernetes.io/instance=drust"))
                .await
                .map_err(|e| e.to_string())?;
            Ok(list
                .items
                .into_iter()
                .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)))
        },
    )
    .await?;
    let token = cp
        .pod_bound_service_account_token(
            "drust-system",
            "drust-kubelet-plugin",
            pod.metadata.name.as_deref().unwrap_or_default(),
            pod.metadata.uid.as_deref().unwrap_or_default(),
        )
        .await?;
    cp.write_kubeconfig(path, &token)?;
    Ok(pod)
}

//! Keys, certificates, bearer tokens and kubeconfigs for one control plane.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use super::{Error, KUBERNETES_SERVICE_IP};

/// The temporary files components and clients read.
pub(super) struct Files {
    pub(super) ca_cert: PathBuf,
    pub(super) serving_cert: PathBuf,
    pub(super) serving_key: PathBuf,
    pub(super) sa_private_key: PathBuf,
    pub(super) sa_public_key: PathBuf,
    pub(super) tokens: PathBuf,
    pub(super) admin_kubeconfig: PathBuf,
    pub(super) certificate_user_kubeconfig: PathBuf,
    pub(super) controller_manager_kubeconfig: PathBuf,
    pub(super) scheduler_kubeconfig: PathBuf,
}

/// PEMs and bearer tokens for one control plane.
pub(super) struct Credentials {
    pub(super) ca_pem: String,
    pub(super) serving_cert_pem: String,
    pub(super) serving_key_pem: String,
    pub(super) sa_private_key_pem: String,
    pub(super) sa_public_key_pem: String,
    pub(super) admin_token: String,
    pub(super) controller_manager_token: String,
    pub(super) scheduler_token: String,
    /// The client certificate and key of user [`CERTIFICATE_USER`] (no group).
    pub(super) certificate_user_pem: (String, String),
}

/// The user of the kubeconfig that authenticates with a client certificate (a cluster whose
/// users hold no bearer token); no role is bound to it.
pub const CERTIFICATE_USER: &str = "cert-user";

impl Credentials {
    /// A fresh CA and certificates; the serving certificate also names `extra_address`.
    pub(super) fn generate(extra_address: Option<std::net::IpAddr>) -> Result<Self, Error> {
        let gen_err = |what| move |source| Error::GenerateCertificate { what, source };

        // rcgen's default key pair is ECDSA P-256, serialized as PKCS#8 "PRIVATE KEY", which
        // both Go's crypto/x509 and the service-account key loader accept.
        let ca_key = KeyPair::generate().map_err(gen_err("the CA key"))?;
        let mut ca_params =
            CertificateParams::new(Vec::<String>::new()).map_err(gen_err("the CA certificate"))?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "drust-e2e-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca_params, ca_key)
            .map_err(gen_err("the CA certificate"))?;

        let serving_key = KeyPair::generate().map_err(gen_err("the serving key"))?;
        let mut serving_params = CertificateParams::new(
            vec![
                "127.0.0.1".to_owned(),
                "localhost".to_owned(),
                KUBERNETES_SERVICE_IP.to_owned(),
                "kubernetes".to_owned(),
                "kubernetes.default".to_owned(),
                "kubernetes.default.svc".to_owned(),
            ]
            .into_iter()
            .chain(extra_address.map(|a| a.to_string()))
            .collect::<Vec<_>>(),
        )
        .map_err(gen_err("the serving certificate"))?;
        serving_params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving_params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        serving_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert = serving_params
            .signed_by(&serving_key, &ca)
            .map_err(gen_err("the serving certificate"))?;

        let sa_key = KeyPair::generate().map_err(gen_err("the service-account key"))?;

        let user_key = KeyPair::generate().map_err(gen_err("the client certificate key"))?;
        let mut user_params = CertificateParams::new(Vec::<String>::new())
            .map_err(gen_err("the client certificate"))?;
        user_params
            .distinguished_name
            .push(DnType::CommonName, CERTIFICATE_USER);
        user_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        user_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let user_cert = user_params
            .signed_by(&user_key, &ca)
            .map_err(gen_err("the client certificate"))?;

        Ok(Self {
            ca_pem: ca.pem(),
            serving_cert_pem: serving_cert.pem(),
            serving_key_pem: serving_key.serialize_pem(),
            sa_private_key_pem: sa_key.serialize_pem(),
            sa_public_key_pem: sa_key.public_key_pem(),
            admin_token: random_token()?,
            controller_manager_token: random_token()?,
            scheduler_token: random_token()?,
            certificate_user_pem: (user_cert.pem(), user_key.serialize_pem()),
        })
    }

    pub(super) fn write(&self, root: &Path, server_url: &str) -> Result<Files, Error> {
        let files = Files {
            ca_cert: root.join("ca.crt"),
            serving_cert: root.join("serving.crt"),
            serving_key: root.join("serving.key"),
            sa_private_key: root.join("sa.key"),
            sa_public_key: root.join("sa.pub"),
            tokens: root.join("tokens.csv"),
            admin_kubeconfig: root.join("admin.kubeconfig"),
            certificate_user_kubeconfig: root.join("cert-user.kubeconfig"),
            controller_manager_kubeconfig: root.join("controller-manager.kubeconfig"),
            scheduler_kubeconfig: root.join("scheduler.kubeconfig"),
        };
        write_file(&files.ca_cert, &self.ca_pem)?;
        write_file(&files.serving_cert, &self.serving_cert_pem)?;
        write_file(&files.serving_key, &self.serving_key_pem)?;
        write_file(&files.sa_private_key, &self.sa_private_key_pem)?;
        write_file(&files.sa_public_key, &self.sa_public_key_pem)?;
        // --token-auth-file rows: token,user,uid,"group,group". The scheduler runs as itself so
        // the bootstrap RBAC role `system:kube-scheduler` is what it gets, as in a real cluster.
        // The controller-manager gets system:masters: its own bootstrap role only suffices with
        // --use-service-account-credentials, which costs a token round trip per controller.
        let tokens = format!(
            "{admin},admin,admin,\"system:masters\"\n\
             {cm},system:kube-controller-manager,system:kube-controller-manager,\"system:masters\"\n\
             {sched},system:kube-scheduler,system:kube-scheduler\n",
            admin = self.admin_token,
            cm = self.controller_manager_token,
            sched = self.scheduler_token,
        );
        write_file(&files.tokens, &tokens)?;
        write_kubeconfig(
            &files.admin_kubeconfig,
            server_url,
            &self.ca_pem,
            "admin",
            &self.admin_token,
        )?;
        write_kubeconfig_with(
            &files.certificate_user_kubeconfig,
            server_url,
            &self.ca_pem,
            CERTIFICATE_USER,
            serde_json::json!({
                "client-certificate-data": base64::engine::general_purpose::STANDARD
                    .encode(&self.certificate_user_pem.0),
                "client-key-data": base64::engine::general_purpose::STANDARD
                    .encode(&self.certificate_user_pem.1),
            }),
        )?;
        write_kubeconfig(
            &files.controller_manager_kubeconfig,
            server_url,
            &self.ca_pem,
            "system:kube-controller-manager",
            &self.controller_manager_token,
        )?;
        write_kubeconfig(
            &files.scheduler_kubeconfig,
            server_url,
            &self.ca_pem,
            "system:kube-scheduler",
            &self.scheduler_token,
        )?;
        Ok(files)
    }
}

/// 32 hex characters from /dev/urandom.
fn random_token() -> Result<String, Error> {
    let mut bytes = [0u8; 16];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|source| Error::GenerateToken { source })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn write_file(path: &Path, contents: &str) -> Result<(), Error> {
    std::fs::write(path, contents).map_err(|source| Error::WriteFile {
        path: path.to_owned(),
        source,
    })
}

pub(super) fn write_kubeconfig(
    path: &Path,
    server_url: &str,
    ca_pem: &str,
    user: &str,
    token: &str,
) -> Result<(), Error> {
    write_kubeconfig_with(
        path,
        server_url,
        ca_pem,
        user,
        serde_json::json!({ "token": token }),
    )
}

/// A kubeconfig whose user `user` authenticates with `credentials` (a kubeconfig `user` entry).
fn write_kubeconfig_with(
    path: &Path,
    server_url: &str,
    ca_pem: &str,
    user: &str,
    credentials: serde_json::Value,
) -> Result<(), Error> {
    let ca_data = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let kubeconfig = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{
            "name": "drust-e2e",
            "cluster": { "server": server_url, "certificate-authority-data": ca_data },
        }],
        "users": [{ "name": user, "user": credentials }],
        "contexts": [{
            "name": "drust-e2e",
            "context": { "cluster": "drust-e2e", "user": user, "namespace": "default" },
        }],
        "current-context": "drust-e2e",
    });
    let text = serde_yaml_ng::to_string(&kubeconfig).map_err(|source| Error::RenderKubeconfig {
        path: path.to_owned(),
        source,
    })?;
    write_file(path, &text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controlplane::load_config;

    #[tokio::test]
    async fn kubeconfigs_load_with_the_server_the_ca_and_the_token() {
        let dir = tempfile::tempdir().unwrap();
        let credentials = Credentials::generate(None).unwrap();
        let files = credentials
            .write(dir.path(), "https://127.0.0.1:6443")
            .unwrap();
        let config = load_config(&files.admin_kubeconfig).await.unwrap();
        assert_eq!(config.cluster_url.to_string(), "https://127.0.0.1:6443/");
        assert_eq!(config.default_namespace, "default");
        let roots = config.root_cert.expect("CA data");
        assert_eq!(roots.len(), 1);
        use kube::config::AuthInfo;
        let AuthInfo { token, .. } = config.auth_info;
        assert!(token.is_some(), "bearer token missing");

        let tokens = std::fs::read_to_string(&files.tokens).unwrap();
        assert!(tokens.contains(&format!(
            "{},admin,admin,\"system:masters\"",
            credentials.admin_token
        )));
    }
}

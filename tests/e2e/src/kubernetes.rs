//! Which Kubernetes minor the harness builds and starts, chosen by the `DRUST_K8S` environment
//! variable (`1.36`, the default and CI's, or `1.37`), and what differs between the two for the
//! tests: the workload-aware feature gates and the served `scheduling.k8s.io` version of
//! Workload and PodGroup.
//!
//! `tests/scripts/build-controlplane.sh` and `build-node.sh` read the same variable and build
//! from `tests/gotools/go.mod` (v1.36.3) or `tests/gotools/k8s137/go.mod` (v1.37.2).

/// The environment variable that selects the version.
pub const VERSION_ENV: &str = "DRUST_K8S";

/// A Kubernetes minor the harness can build and start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KubernetesVersion {
    /// v1.36.3 (`tests/gotools/go.mod`): CI's.
    #[default]
    V1_36,
    /// v1.37.2 (`tests/gotools/k8s137/go.mod`).
    V1_37,
}

/// `DRUST_K8S` names no version the harness knows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{VERSION_ENV}={0:?}: expected 1.36 (the default) or 1.37")]
pub struct UnknownVersion(pub String);

impl KubernetesVersion {
    /// The version `DRUST_K8S` selects: unset or empty is 1.36.
    ///
    /// # Errors
    /// [`UnknownVersion`] for any other value than `1.36` and `1.37`.
    pub fn from_env() -> Result<Self, UnknownVersion> {
        Self::parse(&std::env::var(VERSION_ENV).unwrap_or_default())
    }

    /// Reads `1.36` or `1.37` (surrounding blanks ignored; empty is 1.36).
    ///
    /// # Errors
    /// [`UnknownVersion`] for anything else.
    pub fn parse(text: &str) -> Result<Self, UnknownVersion> {
        match text.trim() {
            "" | "1.36" => Ok(Self::V1_36),
            "1.37" => Ok(Self::V1_37),
            other => Err(UnknownVersion(other.to_owned())),
        }
    }

    /// `1.36` or `1.37`, as `DRUST_K8S` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1_36 => "1.36",
            Self::V1_37 => "1.37",
        }
    }

    /// The `scheduling.k8s.io` version serving Workload and PodGroup: `v1alpha2` in 1.36,
    /// `v1beta1` in 1.37, which removed `v1alpha2` (v1.37.2
    /// `pkg/registry/scheduling/rest/storage_scheduling.go` serves `v1beta1` and `v1alpha3`).
    pub fn scheduling_version(self) -> &'static str {
        match self {
            Self::V1_36 => "v1alpha2",
            Self::V1_37 => "v1beta1",
        }
    }

    /// `scheduling.k8s.io/<`[`Self::scheduling_version`]`>`, a manifest's `apiVersion`.
    pub fn scheduling_api_version(self) -> String {
        format!("scheduling.k8s.io/{}", self.scheduling_version())
    }

    /// The feature gates that turn workload-aware scheduling on (Workload, PodGroup, gang
    /// and topology-aware placement, PodGroup claims, Jobs with a Workload), from each
    /// version's `pkg/features/kube_features.go`. 1.37 has no `GangScheduling`: gang placement
    /// comes with `GenericWorkload` (beta there, still off by default), and the API server
    /// refuses a gate it does not know.
    pub fn workload_aware_gates(self) -> &'static [&'static str] {
        match self {
            Self::V1_36 => &[
                "GenericWorkload",
                "GangScheduling",
                "TopologyAwareWorkloadScheduling",
                "DRAWorkloadResourceClaims",
                "WorkloadWithJob",
            ],
            Self::V1_37 => &[
                "GenericWorkload",
                "TopologyAwareWorkloadScheduling",
                "DRAWorkloadResourceClaims",
                "WorkloadWithJob",
            ],
        }
    }
}

impl std::fmt::Display for KubernetesVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_is_the_default_and_other_minors_are_refused() {
        assert_eq!(KubernetesVersion::parse(""), Ok(KubernetesVersion::V1_36));
        assert_eq!(
            KubernetesVersion::parse(" 1.37\n"),
            Ok(KubernetesVersion::V1_37)
        );
        assert_eq!(
            KubernetesVersion::parse("1.38"),
            Err(UnknownVersion("1.38".to_owned()))
        );
        for v in [KubernetesVersion::V1_36, KubernetesVersion::V1_37] {
            assert_eq!(KubernetesVersion::parse(v.as_str()), Ok(v));
        }
    }

    #[test]
    fn gang_scheduling_is_a_gate_of_1_36_only() {
        assert!(
            KubernetesVersion::V1_36
                .workload_aware_gates()
                .contains(&"GangScheduling")
        );
        assert!(
            !KubernetesVersion::V1_37
                .workload_aware_gates()
                .contains(&"GangScheduling")
        );
        assert_eq!(
            KubernetesVersion::V1_37.scheduling_api_version(),
            "scheduling.k8s.io/v1beta1"
        );
    }
}

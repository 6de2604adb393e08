//! Code generated from `proto/` by tonic-prost-build. Module paths follow the protobuf packages.

#![allow(missing_docs, clippy::all, clippy::pedantic)]

/// `k8s.io.kubelet.pkg.apis.dra.v1`: the DRAPlugin service, v1.
pub mod dra_v1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// `k8s.io.kubelet.pkg.apis.dra.v1beta1`: the DRAPlugin service, v1beta1.
pub mod dra_v1beta1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
}

/// `pluginregistration`: the kubelet plugin watcher's registration service.
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// `v1alpha1`: the DRAResourceHealth service (KEP-4680).
pub mod health_v1alpha1 {
    tonic::include_proto!("v1alpha1");
}

/// `v1`: the kubelet's PodResources API, the part drust calls ([`crate::pod_resources`]).
pub mod podresources_v1 {
    tonic::include_proto!("v1");
}

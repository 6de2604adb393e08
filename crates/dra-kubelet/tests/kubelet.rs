//! Our sockets called by the kubelet's own code (v1.36.3, through `tests/gotools/cmd/kubeletpeer`):
//! its plugin watcher and registration operation dial the registration socket with grpc-go's
//! `DialContext` on the bare path, its DRA plugin manager dials `unix:<endpoint>`, and its
//! `DRAPlugin` makes the prepare, unprepare and health calls. What passes here is what a real
//! kubelet can do with a plugin built on this crate.

mod common;

use std::time::Duration;

use common::*;
use dra_kubelet::proto::{dra_v1, health_v1alpha1};
use dra_kubelet::{HealthStatus, RegistrationStatus};
use drust_gotools::{KubeletPeer, PeerEvent, Service};
use prost::Message;

async fn registered(status: &mut tokio::sync::watch::Receiver<RegistrationStatus>) {
    tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| *s != RegistrationStatus::Pending),
    )
    .await
    .expect("NotifyRegistrationStatus within 10 s")
    .expect("server running");
    assert_eq!(*status.borrow(), RegistrationStatus::Registered);
}

/// The next message of the health stream the kubelet opened, within 30 s.
async fn next_health(
    events: &mut tokio::sync::broadcast::Receiver<PeerEvent>,
) -> health_v1alpha1::NodeWatchResourcesResponse {
    let next = async {
        loop {
            if let PeerEvent::Health { response, .. } = events.recv().await.expect("events") {
                return health_v1alpha1::NodeWatchResourcesResponse::decode(response.as_slice())
                    .expect("a NodeWatchResourcesResponse");
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), next)
        .await
        .expect("a health message within 30 s")
}

#[tokio::test]
async fn the_kubelets_plugin_watcher_registers_the_plugin_and_every_rpc_succeeds() {
    let (mut r, health_tx, advertised) =
        start_with_health(vec![health("gpu-0", HealthStatus::Healthy, "")]).await;
    let kubelet = KubeletPeer::watch(&r.sockets.registrar_dir)
        .await
        .expect("kubelet peer");
    let mut events = kubelet.events();

    // Registration: the plugin watcher finds the socket, GetInfo, NotifyRegistrationStatus.
    let reg = kubelet
        .wait_registered("example.com", Duration::from_secs(60))
        .await
        .expect("the kubelet registers the plugin");
    assert_eq!(reg.endpoint, r.sockets.dra_socket().to_string_lossy());
    assert_eq!(reg.services, advertised);
    registered(&mut r.status).await;

    // v1: one good and one bad claim, each with its own result.
    let request = dra_v1::NodePrepareResourcesRequest {
        claims: vec![
            v1_claim("ns", "good", "00000000-0000-4000-8000-0000000000a1"),
            v1_claim("ns", "bad", "00000000-0000-4000-8000-0000000000a2"),
        ],
    };
    let resp: dra_v1::NodePrepareResourcesResponse = kubelet
        .prepare("example.com", Service::V1, &request)
        .await
        .expect("v1 NodePrepareResources");
    assert_eq!(
        resp.claims["00000000-0000-4000-8000-0000000000a1"].error,
        ""
    );
    assert_eq!(
        resp.claims["00000000-0000-4000-8000-0000000000a1"].devices[0].cdi_device_ids,
        ["example.com/claim=00000000-0000-4000-8000-0000000000a1-gpu-0"]
    );
    assert!(
        resp.claims["00000000-0000-4000-8000-0000000000a2"]
            .error
            .contains("not allocated")
    );
    let resp: dra_v1::NodeUnprepareResourcesResponse = kubelet
        .unprepare(
            "example.com",
            Service::V1,
            &dra_v1::NodeUnprepareResourcesRequest {
                claims: vec![v1_claim(
                    "ns",
                    "good",
                    "00000000-0000-4000-8000-0000000000a1",
                )],
            },
        )
        .await
        .expect("v1 NodeUnprepareResources");
    assert_eq!(
        resp.claims["00000000-0000-4000-8000-0000000000a1"].error,
        ""
    );

    // v1beta1, the way the kubelet calls a plugin that offers only v1beta1.
    let resp: dra_v1::NodePrepareResourcesResponse = kubelet
        .prepare(
            "example.com",
            Service::V1beta1,
            &dra_v1::NodePrepareResourcesRequest {
                claims: vec![v1_claim(
                    "ns",
                    "beta",
                    "00000000-0000-4000-8000-0000000000a3",
                )],
            },
        )
        .await
        .expect("v1beta1 NodePrepareResources");
    assert_eq!(
        resp.claims["00000000-0000-4000-8000-0000000000a3"].devices[0].cdi_device_ids,
        ["example.com/claim=00000000-0000-4000-8000-0000000000a3-gpu-0"]
    );
    let resp: dra_v1::NodeUnprepareResourcesResponse = kubelet
        .unprepare(
            "example.com",
            Service::V1beta1,
            &dra_v1::NodeUnprepareResourcesRequest {
                claims: vec![v1_claim(
                    "ns",
                    "beta",
                    "00000000-0000-4000-8000-0000000000a3",
                )],
            },
        )
        .await
        .expect("v1beta1 NodeUnprepareResources");
    assert_eq!(
        resp.claims["00000000-0000-4000-8000-0000000000a3"].error,
        ""
    );
    let calls: Vec<_> = r
        .driver
        .calls
        .lock()
        .unwrap()
        .iter()
        .map(|(what, claims)| (*what, claims.iter().map(|c| c.uid.clone()).collect()))
        .collect();
    assert_eq!(
        calls,
        [
            (
                "prepare",
                vec![
                    "00000000-0000-4000-8000-0000000000a1".to_owned(),
                    "00000000-0000-4000-8000-0000000000a2".to_owned()
                ]
            ),
            (
                "unprepare",
                vec!["00000000-0000-4000-8000-0000000000a1".to_owned()]
            ),
            (
                "prepare",
                vec!["00000000-0000-4000-8000-0000000000a3".to_owned()]
            ),
            (
                "unprepare",
                vec!["00000000-0000-4000-8000-0000000000a3".to_owned()]
            ),
        ]
    );

    // The health stream the kubelet opened on registration carries the snapshot, then changes.
    let first = next_health(&mut events).await;
    assert_eq!(
        first.devices[0].health(),
        health_v1alpha1::HealthStatus::Healthy
    );
    health_tx.send_replace(vec![health("gpu-0", HealthStatus::Unhealthy, "xid-79")]);
    let second = next_health(&mut events).await;
    assert_eq!(
        second.devices[0].health(),
        health_v1alpha1::HealthStatus::Unhealthy
    );
    assert_eq!(second.devices[0].message, "xid-79");

    // Shutdown removes the registration socket; the plugin watcher deregisters the plugin.
    r.stop.send(()).unwrap();
    let gone = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let PeerEvent::Deregistered { driver, .. } = events.recv().await.expect("events") {
                return driver;
            }
        }
    })
    .await
    .expect("the kubelet deregisters the plugin");
    assert_eq!(gone, "example.com");
    r.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn one_registration_of_a_named_socket_goes_through_the_kubelets_dial() {
    let mut r = start().await;
    let kubelet = KubeletPeer::start().await.expect("kubelet peer");
    let reg = kubelet
        .register(&r.sockets.registration_socket("example.com"))
        .await
        .expect("the kubelet's registration operation succeeds");
    assert_eq!(reg.driver, "example.com");
    assert_eq!(reg.services, ["v1.DRAPlugin", "v1beta1.DRAPlugin"]);
    registered(&mut r.status).await;
}

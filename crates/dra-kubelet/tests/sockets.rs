//! The public API over real Unix sockets: we act as the kubelet against a recording driver.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use dra_kubelet::client::{
    DraPluginV1Client, DraPluginV1beta1Client, DraResourceHealthClient, RegistrationClient, connect,
};
use dra_kubelet::proto::{dra_v1, dra_v1beta1, health_v1alpha1, pluginregistration};
use dra_kubelet::{
    ClaimRef, Driver, HealthStatus, PluginServer, PluginSockets, PrepareResult, RegistrationStatus,
    UnprepareResult,
};

mod common;
use common::*;

#[tokio::test]
async fn registration_advertises_both_dra_versions_and_the_dra_socket() {
    let r = start().await;
    let mut reg = RegistrationClient::new(
        connect(r.sockets.registration_socket("example.com"))
            .await
            .unwrap(),
    );
    let info = reg
        .get_info(pluginregistration::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "example.com");
    assert_eq!(info.endpoint, r.sockets.dra_socket().to_string_lossy());
    assert_eq!(
        info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );

    reg.notify_registration_status(pluginregistration::RegistrationStatus {
        plugin_registered: false,
        error: "version skew".into(),
    })
    .await
    .unwrap();
    assert_eq!(
        *r.status.borrow(),
        RegistrationStatus::Failed("version skew".into())
    );
}

#[tokio::test]
async fn one_bad_claim_gets_an_error_entry_and_the_others_are_prepared() {
    let r = start().await;
    let mut dra = DraPluginV1Client::new(connect(r.sockets.dra_socket()).await.unwrap());
    let resp = dra
        .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
            claims: vec![
                v1_claim("ns", "good", "00000000-0000-4000-8000-000000000001"),
                v1_claim("ns", "bad-claim", "00000000-0000-4000-8000-000000000002"),
                v1_claim("", "no-namespace", "00000000-0000-4000-8000-000000000003"),
                v1_claim("ns", "good", "00000000-0000-4000-8000-000000000001"),
                // Would name a path outside the CDI directory.
                v1_claim("ns", "traversal", "../../../etc/cron.d/x"),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.claims.len(), 4);
    assert!(
        resp.claims["../../../etc/cron.d/x"]
            .error
            .contains("`uid` is not an RFC 4122 UUID"),
        "{}",
        resp.claims["../../../etc/cron.d/x"].error
    );
    let good = &resp.claims["00000000-0000-4000-8000-000000000001"];
    assert_eq!(good.error, "");
    assert_eq!(
        good.devices[0].cdi_device_ids,
        ["example.com/claim=00000000-0000-4000-8000-000000000001-gpu-0"]
    );
    assert!(
        resp.claims["00000000-0000-4000-8000-000000000002"]
            .error
            .contains("not allocated")
    );
    assert!(
        resp.claims["00000000-0000-4000-8000-000000000003"]
            .error
            .contains("`namespace`")
    );
    // The invalid claim never reached the driver, and the repeated one was passed once.
    let calls = r.driver.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        calls[0]
            .1
            .iter()
            .map(|c| c.uid.as_str())
            .collect::<Vec<_>>(),
        [
            "00000000-0000-4000-8000-000000000001",
            "00000000-0000-4000-8000-000000000002"
        ]
    );
}

#[tokio::test]
async fn v1beta1_prepare_and_unprepare_reach_the_same_driver() {
    let r = start().await;
    let mut dra = DraPluginV1beta1Client::new(connect(r.sockets.dra_socket()).await.unwrap());
    let claim = dra_v1beta1::Claim {
        namespace: "ns".into(),
        name: "c".into(),
        uid: "00000000-0000-4000-8000-000000000009".into(),
    };
    let resp = dra
        .node_prepare_resources(dra_v1beta1::NodePrepareResourcesRequest {
            claims: vec![claim.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.claims["00000000-0000-4000-8000-000000000009"].devices[0].device_name,
        "gpu-0"
    );
    let resp = dra
        .node_unprepare_resources(dra_v1beta1::NodeUnprepareResourcesRequest {
            claims: vec![claim],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.claims["00000000-0000-4000-8000-000000000009"].error,
        ""
    );
    let kinds: Vec<_> = r.driver.calls.lock().unwrap().iter().map(|c| c.0).collect();
    assert_eq!(kinds, ["prepare", "unprepare"]);
}

#[tokio::test]
async fn shutdown_removes_both_socket_files_even_with_a_client_still_connected() {
    let r = start().await;
    let (dra, reg) = (
        r.sockets.dra_socket(),
        r.sockets.registration_socket("example.com"),
    );
    assert!(dra.exists() && reg.exists());
    // A kubelet that keeps its connection open must not hold the plugin up.
    let mut client = DraPluginV1Client::new(connect(&dra).await.unwrap());
    client
        .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest { claims: vec![] })
        .await
        .unwrap();
    r.stop.send(()).unwrap();
    // The client is still connected: stopping at all shows the server did not wait for it
    // (the bound is only a safety net).
    tokio::time::timeout(
        dra_kubelet::SHUTDOWN_GRACE + Duration::from_secs(60),
        r.task,
    )
    .await
    .expect("stopped with a client still connected")
    .unwrap()
    .unwrap();
    drop(client);
    assert!(!dra.exists(), "dra.sock left behind");
    assert!(!reg.exists(), "registration socket left behind");
}

#[tokio::test]
async fn a_stale_socket_file_from_a_crashed_run_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let sockets = PluginSockets {
        plugin_dir: dir.path().join("p"),
        registrar_dir: dir.path().join("r"),
        instance_id: None,
    };
    std::fs::create_dir_all(&sockets.plugin_dir).unwrap();
    std::fs::write(sockets.dra_socket(), b"stale").unwrap();
    let server = PluginServer::new(
        "example.com",
        sockets.clone(),
        Arc::new(Recorder::default()),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.serve(async {
        let _ = stopped.await;
    }));
    // The stale DRA socket file is there from the start; the registration socket comes last.
    wait_for(&sockets.registration_socket("example.com")).await;
    let mut dra = DraPluginV1Client::new(connect(sockets.dra_socket()).await.unwrap());
    let resp = dra
        .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest {
            claims: vec![v1_claim("ns", "c", "00000000-0000-4000-8000-0000000000b1")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.claims["00000000-0000-4000-8000-0000000000b1"].error,
        ""
    );
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}

/// Prepares after a pause, so a call can be in flight when shutdown begins; says when a call
/// has arrived.
struct Slow {
    pause: Duration,
    arrived: tokio::sync::Notify,
}

impl Driver for Slow {
    type Error = String;

    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult<String>> {
        self.arrived.notify_one();
        tokio::time::sleep(self.pause).await;
        claims.into_iter().map(|c| (c.uid, Ok(vec![]))).collect()
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, UnprepareResult<String>> {
        claims.into_iter().map(|c| (c.uid, Ok(()))).collect()
    }
}

async fn wait_for(path: &std::path::Path) {
    for _ in 0..3000 {
        if path.exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{} never appeared", path.display());
}

#[tokio::test]
async fn two_instances_serve_side_by_side_and_each_removes_only_its_own_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let sockets = |id: &str| PluginSockets {
        plugin_dir: dir.path().join("plugins/example.com"),
        registrar_dir: dir.path().join("plugins_registry"),
        instance_id: Some(id.into()),
    };
    let (a, b) = (sockets("uid-a"), sockets("uid-b"));
    assert_eq!(
        a.registration_socket("example.com"),
        dir.path()
            .join("plugins_registry/example.com-uid-a-reg.sock")
    );
    assert_eq!(
        a.dra_socket(),
        dir.path().join("plugins/example.com/dra-uid-a.sock")
    );
    let mut stops = Vec::new();
    let mut tasks = Vec::new();
    for s in [&a, &b] {
        let server = PluginServer::new("example.com", s.clone(), Arc::new(Recorder::default()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tasks.push(tokio::spawn(server.serve(async {
            let _ = stopped.await;
        })));
        stops.push(stop);
        wait_for(&s.registration_socket("example.com")).await;
    }
    // Both registrations advertise their own DRA socket, and both answer.
    for s in [&a, &b] {
        let mut reg =
            RegistrationClient::new(connect(s.registration_socket("example.com")).await.unwrap());
        let info = reg
            .get_info(pluginregistration::InfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.endpoint, s.dra_socket().to_string_lossy());
        let mut dra = DraPluginV1Client::new(connect(s.dra_socket()).await.unwrap());
        let resp = dra
            .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
                claims: vec![v1_claim("ns", "c", "00000000-0000-4000-8000-0000000000b1")],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            resp.claims["00000000-0000-4000-8000-0000000000b1"].error,
            ""
        );
    }
    // Stopping A leaves B's sockets alone.
    let stop_a = stops.remove(0);
    stop_a.send(()).unwrap();
    tasks.remove(0).await.unwrap().unwrap();
    assert!(!a.dra_socket().exists() && !a.registration_socket("example.com").exists());
    assert!(b.dra_socket().exists() && b.registration_socket("example.com").exists());
    let mut dra = DraPluginV1Client::new(connect(b.dra_socket()).await.unwrap());
    dra.node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest {
        claims: vec![v1_claim("ns", "c", "00000000-0000-4000-8000-0000000000b1")],
    })
    .await
    .unwrap();
    stops.remove(0).send(()).unwrap();
    tasks.remove(0).await.unwrap().unwrap();
}

#[test]
fn instance_ids_must_be_plain_file_name_parts() {
    for ok in ["0f8b2c3e-1d2a-4c1b-9a7e-5b6c7d8e9f00", "a", "pod_1.2"] {
        assert!(dra_kubelet::valid_instance_id(ok), "{ok}");
    }
    for bad in ["", ".hidden", "a/b", "../x", "a b", &"x".repeat(129)] {
        assert!(!dra_kubelet::valid_instance_id(bad), "{bad}");
    }
}

#[tokio::test]
async fn serve_returns_only_after_a_call_in_flight_at_shutdown_was_answered() {
    let dir = tempfile::tempdir().unwrap();
    let sockets = PluginSockets {
        plugin_dir: dir.path().join("p"),
        registrar_dir: dir.path().join("r"),
        instance_id: None,
    };
    // Longer than the grace for clients, so only the drain keeps the server up long enough:
    // once `serve` returns, the process exits and a call still running would be lost.
    let pause = dra_kubelet::SHUTDOWN_GRACE + Duration::from_millis(500);
    let slow = Arc::new(Slow {
        pause,
        arrived: tokio::sync::Notify::new(),
    });
    let server = PluginServer::new("example.com", sockets.clone(), Arc::clone(&slow));
    let serving = server.serving();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.serve(async {
        let _ = stopped.await;
    }));
    wait_for(&sockets.registration_socket("example.com")).await;
    assert!(*serving.borrow());
    let mut dra = DraPluginV1Client::new(connect(sockets.dra_socket()).await.unwrap());
    let call = tokio::spawn(async move {
        dra.node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim("ns", "c", "00000000-0000-4000-8000-0000000000b2")],
        })
        .await
    });
    // Shutdown begins once the call is in the driver, however long it took to get there.
    slow.arrived.notified().await;
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    // Had serve returned before answering, the connection would be gone without an answer.
    let resp = call
        .await
        .unwrap()
        .expect("the call in flight was answered");
    assert_eq!(
        resp.into_inner().claims["00000000-0000-4000-8000-0000000000b2"].error,
        ""
    );
    assert!(!*serving.borrow());
    assert!(!sockets.dra_socket().exists());
}

#[tokio::test]
async fn registration_advertises_the_health_service_after_the_dra_versions_when_served() {
    let (r, _tx, advertised) = start_with_health(vec![]).await;
    let mut reg = RegistrationClient::new(
        connect(r.sockets.registration_socket("example.com"))
            .await
            .unwrap(),
    );
    let info = reg
        .get_info(pluginregistration::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    assert_eq!(info.supported_versions, advertised);
}

#[tokio::test]
async fn the_health_stream_sends_the_current_snapshot_then_every_change() {
    let (r, tx, _) = start_with_health(vec![health("gpu-0", HealthStatus::Healthy, "")]).await;
    let mut client = DraResourceHealthClient::new(connect(r.sockets.dra_socket()).await.unwrap());
    let mut stream = client
        .node_watch_resources(health_v1alpha1::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().expect("initial snapshot");
    assert_eq!(first.devices.len(), 1);
    assert_eq!(
        first.devices[0].health(),
        health_v1alpha1::HealthStatus::Healthy
    );
    assert_eq!(first.devices[0].health_check_timeout_seconds, 60);

    tx.send_replace(vec![
        health("gpu-0", HealthStatus::Unhealthy, "xid-79"),
        health("gpu-1", HealthStatus::Healthy, ""),
    ]);
    let second = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("a change is sent")
        .unwrap()
        .expect("stream open");
    let by_name: BTreeMap<_, _> = second
        .devices
        .iter()
        .map(|d| {
            (
                d.device.as_ref().unwrap().device_name.clone(),
                (d.health(), d.message.clone()),
            )
        })
        .collect();
    assert_eq!(
        by_name["gpu-0"],
        (
            health_v1alpha1::HealthStatus::Unhealthy,
            "xid-79".to_owned()
        )
    );
    assert_eq!(by_name["gpu-1"].0, health_v1alpha1::HealthStatus::Healthy);

    // The plugin dropping its sender ends the stream; the kubelet would call again.
    drop(tx);
    let end = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("the stream ends");
    assert!(matches!(end, Ok(None)), "{end:?}");
}

#[tokio::test]
async fn shutdown_ends_open_health_streams_instead_of_waiting_for_them() {
    let (r, _tx, _) = start_with_health(vec![health("gpu-0", HealthStatus::Healthy, "")]).await;
    let mut client = DraResourceHealthClient::new(connect(r.sockets.dra_socket()).await.unwrap());
    let mut stream = client
        .node_watch_resources(health_v1alpha1::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().expect("initial snapshot");
    r.stop.send(()).unwrap();
    let end = tokio::time::timeout(dra_kubelet::SHUTDOWN_GRACE, stream.message())
        .await
        .expect("the stream ends before the grace period is over");
    assert!(matches!(end, Ok(None)), "{end:?}");
    r.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn without_health_the_service_is_neither_served_nor_advertised() {
    let r = start().await;
    let mut client = DraResourceHealthClient::new(connect(r.sockets.dra_socket()).await.unwrap());
    let err = client
        .node_watch_resources(health_v1alpha1::NodeWatchResourcesRequest {})
        .await
        .expect_err("not served");
    assert_eq!(err.code(), tonic::Code::Unimplemented);
}

/// A `MakeWriter` that keeps everything logged.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Self;
    fn make_writer(&'a self) -> Self {
        self.clone()
    }
}

fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

#[tokio::test]
async fn a_request_the_http2_layer_resets_is_logged_at_warn_with_the_socket_and_the_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let r = start().await;
    let socket = r.sockets.registration_socket("example.com");
    let mut conn = tokio::net::UnixStream::connect(&socket).await.unwrap();
    // A request without :scheme, which RFC 9113 calls malformed: h2 resets it itself.
    let block = loona_hpack::Encoder::new().encode([
        (&b":method"[..], &b"POST"[..]),
        (b":path", b"/pluginregistration.Registration/GetInfo"),
        (b":authority", b"localhost"),
        (b"user-agent", b"malformed-test/1"),
    ]);
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(h2_frame(0x4, 0, 0, &[]));
    out.extend(h2_frame(0x1, 0x4 | 0x1, 1, &block));
    conn.write_all(&out).await.unwrap();
    // Read until the server's RST_STREAM for stream 1 arrives.
    let mut seen = Vec::new();
    let reset = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        loop {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "connection closed without a reset");
            seen.extend_from_slice(&buf[..n]);
            let mut at = 0;
            while seen.len() >= at + 9 {
                let len = usize::from(seen[at]) << 16
                    | usize::from(seen[at + 1]) << 8
                    | usize::from(seen[at + 2]);
                if seen[at + 3] == 0x3 && seen.len() >= at + 9 + len {
                    return u32::from_be_bytes(seen[at + 9..at + 13].try_into().unwrap());
                }
                at += 9 + len;
            }
        }
    })
    .await
    .expect("the server resets the stream");
    assert_eq!(reset, 1, "PROTOCOL_ERROR");
    let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let line = logged
        .lines()
        .find(|l| l.contains("reset the peer's request"))
        .unwrap_or_else(|| panic!("no warning in {logged:?}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains(&*socket.to_string_lossy()), "{line}");
    assert!(line.contains("PROTOCOL_ERROR"), "{line}");
    assert!(
        line.contains("/pluginregistration.Registration/GetInfo"),
        "{line}"
    );
    assert!(line.contains("malformed-test/1"), "{line}");
}

//! Thin adapters from the generated DRAPlugin servers (v1, v1beta1) to a [`Driver`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::calls::{CallObserver, CallRecord, InFlight, Method};
use crate::convert::InvalidClaim;
use crate::driver::{ClaimRef, Driver, PreparedDevice};
use crate::proto::{dra_v1, dra_v1beta1};

/// What every DRAPlugin adapter shares: the driver, the in-flight count, the observer.
pub(crate) struct Shared<D> {
    pub(crate) driver: Arc<D>,
    pub(crate) in_flight: InFlight,
    pub(crate) observer: Option<Arc<dyn CallObserver>>,
}

impl<D> Shared<D> {
    /// Reports a finished call to the observer, if any.
    fn finished<T>(
        &self,
        method: Method,
        api_version: &'static str,
        started: Instant,
        outcome: &Outcome<T>,
    ) {
        if let Some(observer) = &self.observer {
            observer.call_finished(&CallRecord {
                method,
                api_version,
                claims: outcome.len(),
                failed: outcome.values().filter(|r| r.is_err()).count(),
                elapsed: started.elapsed(),
            });
        }
    }
}

/// Per-claim outcome with the driver's error already rendered for the kubelet.
type Outcome<T> = BTreeMap<String, Result<T, String>>;

/// Splits request claims into valid references and per-claim errors keyed by the sent UID.
fn sort_claims<'a, C: 'a>(
    claims: impl IntoIterator<Item = &'a C>,
    uid: impl Fn(&C) -> &str,
) -> (Vec<ClaimRef>, BTreeMap<String, String>)
where
    for<'c> ClaimRef: TryFrom<&'c C, Error = InvalidClaim>,
{
    let mut valid = Vec::new();
    let mut invalid = BTreeMap::new();
    for c in claims {
        match ClaimRef::try_from(c) {
            // The kubelet keys results by UID; a claim repeated in one request is prepared once.
            Ok(r) if valid.iter().any(|v: &ClaimRef| v.uid == r.uid) => {}
            Ok(r) => valid.push(r),
            Err(e) => {
                warn!(error = %e, "claim refused");
                invalid.insert(uid(c).to_owned(), e.to_string());
            }
        }
    }
    (valid, invalid)
}

async fn prepare<D: Driver>(
    driver: &D,
    claims: Vec<ClaimRef>,
    invalid: BTreeMap<String, String>,
) -> Outcome<Vec<PreparedDevice>> {
    let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
    info!(claims = ?claims, "NodePrepareResources");
    let mut results = driver.prepare(claims).await;
    let mut out: Outcome<Vec<PreparedDevice>> =
        invalid.into_iter().map(|(k, v)| (k, Err(v))).collect();
    for uid in uids {
        let r = match results.remove(&uid) {
            Some(Ok(devices)) => Ok(devices),
            Some(Err(e)) => Err(e.to_string()),
            None => Err(format!("claim uid {uid}: driver returned no result")),
        };
        if let Err(e) = &r {
            warn!(claim_uid = %uid, error = %e, "prepare failed");
        }
        out.insert(uid, r);
    }
    out
}

async fn unprepare<D: Driver>(
    driver: &D,
    claims: Vec<ClaimRef>,
    invalid: BTreeMap<String, String>,
) -> Outcome<()> {
    let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
    info!(claims = ?claims, "NodeUnprepareResources");
    let mut results = driver.unprepare(claims).await;
    let mut out: Outcome<()> = invalid.into_iter().map(|(k, v)| (k, Err(v))).collect();
    for uid in uids {
        let r = match results.remove(&uid) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(e.to_string()),
            None => Err(format!("claim uid {uid}: driver returned no result")),
        };
        if let Err(e) = &r {
            warn!(claim_uid = %uid, error = %e, "unprepare failed");
        }
        out.insert(uid, r);
    }
    out
}

macro_rules! dra_plugin_service {
    ($name:ident, $version:literal, $proto:ident) => {
        #[doc = concat!("The `", $version, ".DRAPlugin` gRPC service over a [`Driver`].")]
        pub struct $name<D>(pub(crate) Arc<Shared<D>>);

        impl<D> Clone for $name<D> {
            fn clone(&self) -> Self {
                Self(Arc::clone(&self.0))
            }
        }

        #[tonic::async_trait]
        impl<D: Driver> $proto::dra_plugin_server::DraPlugin for $name<D> {
            async fn node_prepare_resources(
                &self,
                request: Request<$proto::NodePrepareResourcesRequest>,
            ) -> Result<Response<$proto::NodePrepareResourcesResponse>, Status> {
                let req = request.into_inner();
                // An empty call (a liveness probe) proves the server answers; the driver is not
                // asked, so it answers even while the driver waits to become active.
                if req.claims.is_empty() {
                    return Ok(Response::new(Default::default()));
                }
                let _in_flight = self.0.in_flight.enter();
                let started = Instant::now();
                let (valid, invalid) = sort_claims(&req.claims, |c| &c.uid);
                let outcome = prepare(&*self.0.driver, valid, invalid).await;
                self.0
                    .finished(Method::Prepare, $version, started, &outcome);
                let claims = outcome
                    .into_iter()
                    .map(|(uid, r)| {
                        let resp = match r {
                            Ok(devices) => $proto::NodePrepareResourceResponse {
                                devices: devices.into_iter().map(Into::into).collect(),
                                error: String::new(),
                            },
                            Err(error) => $proto::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error,
                            },
                        };
                        (uid, resp)
                    })
                    .collect();
                Ok(Response::new($proto::NodePrepareResourcesResponse {
                    claims,
                }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$proto::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$proto::NodeUnprepareResourcesResponse>, Status> {
                let req = request.into_inner();
                if req.claims.is_empty() {
                    return Ok(Response::new(Default::default()));
                }
                let _in_flight = self.0.in_flight.enter();
                let started = Instant::now();
                let (valid, invalid) = sort_claims(&req.claims, |c| &c.uid);
                let outcome = unprepare(&*self.0.driver, valid, invalid).await;
                self.0
                    .finished(Method::Unprepare, $version, started, &outcome);
                let claims = outcome
                    .into_iter()
                    .map(|(uid, r)| {
                        let error = r.err().unwrap_or_default();
                        (uid, $proto::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($proto::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

dra_plugin_service!(DraPluginV1, "v1", dra_v1);
dra_plugin_service!(DraPluginV1beta1, "v1beta1", dra_v1beta1);

//! Who may read the plugin's `/metrics` and `/usage` (issue 41, defect 9): the caller shows a
//! bearer token, the API server says whose it is (a TokenReview) and whether that user may make
//! the request (a SubjectAccessReview), as controller-runtime's metrics filter
//! (`pkg/metrics/filters`, `WithAuthenticationAndAuthorization`) and kube-rbac-proxy do. What is
//! asked is named as RBAC names it: a non-resource URL and a verb (`get /metrics`, granted by
//! `nonResourceURLs: ["/metrics"]`, `verbs: ["get"]`), or a verb on a resource in a namespace.
//!
//! - no bearer token, or one the API server does not accept: 401;
//! - a user the API server does not allow: 403, naming the user and what was asked;
//! - a review the API server could not answer: 503 when it did not answer within the deadline
//!   (`--api-timeout-seconds`) or could not be reached, 500 when it refused the review (the
//!   plugin's ServiceAccount may not create reviews), each naming the cause. A failed review is
//!   never cached.
//!
//! Answers are cached ([`DecisionCache`]): a token's user (or its rejection) for
//! [`AUTHENTICATION_TTL`], an allowed request for [`ALLOWED_TTL`], a denied one for
//! [`DENIED_TTL`], so a Prometheus scraping every 15 s costs no review three times out of four.
//! Reviews run in the request's own task under the deadline: a slow API server holds back only
//! the requests that wait for a review, never the probes or other connections.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use hyper::StatusCode;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use serde::Serialize;

use super::decision_cache::{DecisionCache, Key};

/// How long the API server's answer about a token (its user, or that it is not valid) is kept;
/// the API server's own delegated authentication keeps it as long (`CacheTTL`, 1 minute in
/// controller-runtime's filter).
pub const AUTHENTICATION_TTL: Duration = Duration::from_secs(60);
/// How long an allowed request is kept allowed: a revoked role takes effect within this.
pub const ALLOWED_TTL: Duration = Duration::from_secs(60);
/// How long a denied request is kept denied: a granted role takes effect within this.
pub const DENIED_TTL: Duration = Duration::from_secs(30);
/// How many answers each cache holds (tokens; users and requests).
pub const CACHE_CAPACITY: usize = 1024;

/// Who a token belongs to, as the API server's TokenReview answered.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct User {
    /// The user name (`system:serviceaccount:<namespace>:<name>` for a ServiceAccount).
    pub name: String,
    /// The user's UID, where the authenticator gives one.
    pub uid: String,
    /// The user's groups.
    pub groups: Vec<String>,
    /// The authenticator's extra attributes (a bound token's pod and node, for example).
    pub extra: BTreeMap<String, Vec<String>>,
}

/// What a request asks to do, as a SubjectAccessReview (and RBAC) names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Attributes {
    /// `verb` on the non-resource URL `path` (the request's path, without its query).
    NonResource {
        /// The URL path, e.g. `/metrics`.
        path: String,
        /// The verb, e.g. `get`.
        verb: String,
    },
    /// `verb` on `resource` of API group `group` in `namespace`.
    Resource {
        /// The API group (`""` for the core group).
        group: String,
        /// The resource, plural.
        resource: String,
        /// The verb, e.g. `list`.
        verb: String,
        /// The namespace.
        namespace: String,
    },
}

impl Attributes {
    /// `get` on the non-resource URL `path`.
    pub fn get(path: &str) -> Self {
        Self::NonResource {
            path: path.to_owned(),
            verb: "get".to_owned(),
        }
    }

    /// `list` on `resource` of `group` in `namespace`.
    pub fn list_in(group: &str, resource: &str, namespace: &str) -> Self {
        Self::Resource {
            group: group.to_owned(),
            resource: resource.to_owned(),
            verb: "list".to_owned(),
            namespace: namespace.to_owned(),
        }
    }
}

impl fmt::Display for Attributes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NonResource { path, verb } => write!(f, "{verb} {path}"),
            Self::Resource {
                group,
                resource,
                verb,
                namespace,
            } if group.is_empty() => write!(f, "{verb} {resource} in namespace {namespace}"),
            Self::Resource {
                group,
                resource,
                verb,
                namespace,
            } => write!(f, "{verb} {resource}.{group} in namespace {namespace}"),
        }
    }
}

/// A review the API server did not answer.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// No answer within the deadline.
    #[error("the API server did not answer the {review} within {after:?}")]
    TimedOut {
        /// `TokenReview` or `SubjectAccessReview`.
        review: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// The API server refused the review, or could not be reached.
    #[error("creating a {review}: {source}")]
    Failed {
        /// `TokenReview` or `SubjectAccessReview`.
        review: &'static str,
        /// The client's error.
        source: kube::Error,
    },
}

impl ReviewError {
    /// 500 when the API server answered with an error (the review is refused: the plugin's
    /// ServiceAccount lacks the role, or the API server failed); 503 when it did not answer.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Failed {
                source: kube::Error::Api(_),
                ..
            } => StatusCode::INTERNAL_SERVER_ERROR,
            Self::TimedOut { .. } | Self::Failed { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// Why a request is not let through.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// No bearer token, or the API server does not accept it.
    #[error("Unauthorized: {0}")]
    Unauthenticated(&'static str),
    /// The API server does not allow the token's user what the request asks.
    #[error("Forbidden: user {user:?} may not {asked}")]
    Forbidden {
        /// The token's user.
        user: String,
        /// What was asked (each alternative, joined by "or").
        asked: String,
    },
    /// The API server could not answer a review.
    #[error("checking the caller's access: {0}")]
    Review(#[source] ReviewError),
}

impl Refusal {
    /// The HTTP status that says it: 401, 403, or [`ReviewError::status`].
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Self::Forbidden { .. } => StatusCode::FORBIDDEN,
            Self::Review(e) => e.status(),
        }
    }
}

/// The API server's reviews, behind a seam so that the caching can be tested alone.
pub trait Reviews: Send + Sync {
    /// The user `token` authenticates as, or `None` when the API server does not accept it.
    ///
    /// # Errors
    /// [`ReviewError`] when the API server does not answer.
    fn authenticate(
        &self,
        token: &str,
    ) -> impl Future<Output = Result<Option<User>, ReviewError>> + Send;

    /// Whether `user` may do `attributes`, with the API server's reason.
    ///
    /// # Errors
    /// [`ReviewError`] when the API server does not answer.
    fn authorize(
        &self,
        user: &User,
        attributes: &Attributes,
    ) -> impl Future<Output = Result<(bool, String), ReviewError>> + Send;
}

/// [`Reviews`] through the API server: TokenReviews and SubjectAccessReviews created with the
/// plugin's client (RBAC: `create` on `tokenreviews` and `subjectaccessreviews`), each within
/// a deadline.
#[derive(Clone)]
pub struct ApiServerReviews {
    client: kube::Client,
    timeout: Duration,
}

impl ApiServerReviews {
    /// Reviews through `client`, each call bounded by `timeout` (`--api-timeout-seconds`).
    pub fn new(client: kube::Client, timeout: Duration) -> Self {
        Self { client, timeout }
    }

    async fn within<T>(
        &self,
        review: &'static str,
        call: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, ReviewError> {
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| ReviewError::TimedOut {
                review,
                after: self.timeout,
            })?
            .map_err(|source| ReviewError::Failed { review, source })
    }
}

impl Reviews for ApiServerReviews {
    async fn authenticate(&self, token: &str) -> Result<Option<User>, ReviewError> {
        // No audiences: the token must be one the API server itself accepts, as a client's
        // kubeconfig token or a pod's ServiceAccount token is.
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let answer = self
            .within("TokenReview", api.create(&PostParams::default(), &review))
            .await?;
        let status = answer.status.unwrap_or_default();
        let user = status.user.unwrap_or_default();
        Ok(match (status.authenticated, user.username) {
            (Some(true), Some(name)) if !name.is_empty() => Some(User {
                name,
                uid: user.uid.unwrap_or_default(),
                groups: user.groups.unwrap_or_default(),
                extra: user.extra.unwrap_or_default(),
            }),
            _ => None,
        })
    }

    async fn authorize(
        &self,
        user: &User,
        attributes: &Attributes,
    ) -> Result<(bool, String), ReviewError> {
        let mut spec = SubjectAccessReviewSpec {
            user: Some(user.name.clone()),
            uid: (!user.uid.is_empty()).then(|| user.uid.clone()),
            groups: Some(user.groups.clone()),
            extra: Some(user.extra.clone()),
            ..SubjectAccessReviewSpec::default()
        };
        match attributes {
            Attributes::NonResource { path, verb } => {
                spec.non_resource_attributes = Some(NonResourceAttributes {
                    path: Some(path.clone()),
                    verb: Some(verb.clone()),
                });
            }
            Attributes::Resource {
                group,
                resource,
                verb,
                namespace,
            } => {
                spec.resource_attributes = Some(ResourceAttributes {
                    group: Some(group.clone()),
                    resource: Some(resource.clone()),
                    verb: Some(verb.clone()),
                    namespace: Some(namespace.clone()),
                    ..ResourceAttributes::default()
                });
            }
        }
        let review = SubjectAccessReview {
            spec,
            ..SubjectAccessReview::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let answer = self
            .within(
                "SubjectAccessReview",
                api.create(&PostParams::default(), &review),
            )
            .await?;
        let status = answer.status.unwrap_or_default();
        Ok((status.allowed, status.reason.unwrap_or_default()))
    }
}

/// The token of an `Authorization: Bearer <token>` header value, as the API server's bearer
/// token authenticator reads it (k8s.io/apiserver `pkg/authentication/request/bearertoken`):
/// the scheme in any case, then the token.
fn bearer_token(authorization: Option<&[u8]>) -> Result<&str, Refusal> {
    const NONE: Refusal =
        Refusal::Unauthenticated("no bearer token (Authorization: Bearer <token>)");
    let value = authorization
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::trim)
        .ok_or(NONE)?;
    let (scheme, token) = value.split_once(' ').ok_or(NONE)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(NONE);
    }
    match token.trim() {
        "" => Err(Refusal::Unauthenticated("an empty bearer token")),
        token => Ok(token),
    }
}

/// Lets a request through when its bearer token authenticates and its user may do what it asks,
/// remembering the API server's answers for a while.
pub struct Gate<R> {
    reviews: R,
    users: DecisionCache<Option<User>>,
    decisions: DecisionCache<bool>,
}

impl<R: Reviews> Gate<R> {
    /// A gate asking `reviews`, with empty caches of [`CACHE_CAPACITY`] answers each.
    pub fn new(reviews: R) -> Self {
        Self {
            reviews,
            users: DecisionCache::new(CACHE_CAPACITY),
            decisions: DecisionCache::new(CACHE_CAPACITY),
        }
    }

    /// The user of the bearer token in `authorization` (the `Authorization` header's value),
    /// when that user may do any one of `alternatives` (tried in order; at least one).
    ///
    /// # Errors
    /// [`Refusal`]: unauthenticated, forbidden (every alternative denied), or a review the API
    /// server could not answer (when no alternative was allowed).
    pub async fn admit(
        &self,
        authorization: Option<&[u8]>,
        alternatives: &[Attributes],
    ) -> Result<User, Refusal> {
        self.admit_at(authorization, alternatives, Instant::now())
            .await
    }

    async fn admit_at(
        &self,
        authorization: Option<&[u8]>,
        alternatives: &[Attributes],
        now: Instant,
    ) -> Result<User, Refusal> {
        let token = bearer_token(authorization)?;
        let user = self.authenticate(token, now).await?;
        let mut failed = None;
        for attributes in alternatives {
            match self.authorize(&user, attributes, now).await {
                Ok(true) => return Ok(user),
                Ok(false) => {}
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        // A denial is certain only when every alternative was answered.
        match failed {
            Some(e) => Err(Refusal::Review(e)),
            None => Err(Refusal::Forbidden {
                user: user.name,
                asked: alternatives
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" or "),
            }),
        }
    }

    async fn authenticate(&self, token: &str, now: Instant) -> Result<User, Refusal> {
        let key = Key::of(&[token.as_bytes()]);
        let user = match self.users.get(&key, now) {
            Some(user) => user,
            None => {
                let user = self
                    .reviews
                    .authenticate(token)
                    .await
                    .map_err(Refusal::Review)?;
                self.users
                    .insert(key, user.clone(), AUTHENTICATION_TTL, now);
                user
            }
        };
        user.ok_or(Refusal::Unauthenticated(
            "the API server does not accept the bearer token",
        ))
    }

    async fn authorize(
        &self,
        user: &User,
        attributes: &Attributes,
        now: Instant,
    ) -> Result<bool, ReviewError> {
        // Keyed by everything the review is asked about, as the API server's webhook
        // authorizer keys its cache by the review's spec.
        let asked = serde_json::to_vec(&(user, attributes)).unwrap_or_default();
        let key = Key::of(&[&asked]);
        if let Some(allowed) = self.decisions.get(&key, now) {
            return Ok(allowed);
        }
        let (allowed, reason) = self.reviews.authorize(user, attributes).await?;
        if !allowed {
            tracing::debug!(user = %user.name, asked = %attributes, %reason, "denied");
        }
        let ttl = if allowed { ALLOWED_TTL } else { DENIED_TTL };
        self.decisions.insert(key, allowed, ttl, now);
        Ok(allowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The API server as a table: tokens to users, and the (user, attributes) allowed; it can
    /// be made to fail. Counts the reviews asked for.
    #[derive(Default)]
    struct Table {
        users: BTreeMap<&'static str, &'static str>,
        allowed: Vec<(&'static str, Attributes)>,
        failing: Mutex<bool>,
        authentications: AtomicUsize,
        authorizations: AtomicUsize,
    }

    impl Table {
        fn failure(&self, review: &'static str) -> Result<(), ReviewError> {
            if *self.failing.lock().unwrap() {
                return Err(ReviewError::TimedOut {
                    review,
                    after: Duration::from_secs(5),
                });
            }
            Ok(())
        }
    }

    impl Reviews for Table {
        async fn authenticate(&self, token: &str) -> Result<Option<User>, ReviewError> {
            self.authentications.fetch_add(1, Ordering::SeqCst);
            self.failure("TokenReview")?;
            Ok(self.users.get(token).map(|name| User {
                name: (*name).to_owned(),
                ..User::default()
            }))
        }

        async fn authorize(
            &self,
            user: &User,
            attributes: &Attributes,
        ) -> Result<(bool, String), ReviewError> {
            self.authorizations.fetch_add(1, Ordering::SeqCst);
            self.failure("SubjectAccessReview")?;
            let allowed = self
                .allowed
                .iter()
                .any(|(name, a)| *name == user.name && a == attributes);
            Ok((allowed, String::new()))
        }
    }

    fn gate() -> Gate<Table> {
        Gate::new(Table {
            users: BTreeMap::from([("t-prom", "prometheus"), ("t-tenant", "tenant")]),
            allowed: vec![
                ("prometheus", Attributes::get("/metrics")),
                (
                    "tenant",
                    Attributes::list_in("resource.k8s.io", "resourceclaims", "team-a"),
                ),
            ],
            ..Table::default()
        })
    }

    fn counts(gate: &Gate<Table>) -> (usize, usize) {
        (
            gate.reviews.authentications.load(Ordering::SeqCst),
            gate.reviews.authorizations.load(Ordering::SeqCst),
        )
    }

    fn status(r: Result<User, Refusal>) -> u16 {
        match r {
            Ok(_) => 200,
            Err(e) => e.status().as_u16(),
        }
    }

    #[tokio::test]
    async fn the_answer_is_200_401_or_403_as_the_api_server_decides() {
        let gate = gate();
        let metrics = [Attributes::get("/metrics")];
        for (header, want) in [
            (None, 401),
            (Some("Basic dXNlcjpwYXNz"), 401),
            (Some("Bearer"), 401),
            (Some("Bearer   "), 401),
            (Some("Bearer t-unknown"), 401),
            (Some("Bearer t-tenant"), 403),
            (Some("Bearer t-prom"), 200),
            (Some("bearer t-prom"), 200),
        ] {
            let got = status(gate.admit(header.map(str::as_bytes), &metrics).await);
            assert_eq!(got, want, "{header:?}");
        }
    }

    #[tokio::test]
    async fn any_one_allowed_alternative_lets_the_request_through() {
        let gate = gate();
        let usage = |ns: &str| {
            [
                Attributes::get("/usage"),
                Attributes::list_in("resource.k8s.io", "resourceclaims", ns),
            ]
        };
        let tenant = Some(b"Bearer t-tenant".as_slice());
        assert_eq!(status(gate.admit(tenant, &usage("team-a")).await), 200);
        match gate.admit(tenant, &usage("team-b")).await {
            Err(e @ Refusal::Forbidden { .. }) => assert_eq!(
                e.to_string(),
                "Forbidden: user \"tenant\" may not get /usage or list \
                 resourceclaims.resource.k8s.io in namespace team-b"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(status(gate.admit(tenant, &usage("team-b")[..1]).await), 403);
    }

    #[tokio::test]
    async fn repeated_requests_within_the_ttls_ask_the_api_server_once() {
        let gate = gate();
        let t0 = Instant::now();
        let prom = Some(b"Bearer t-prom".as_slice());
        let metrics = [Attributes::get("/metrics")];
        // A scrape every 15 s for 45 s, then one after the TTLs.
        for s in [0, 15, 30, 45] {
            let at = t0 + Duration::from_secs(s);
            assert!(gate.admit_at(prom, &metrics, at).await.is_ok());
        }
        assert_eq!(counts(&gate), (1, 1));
        let later = t0 + AUTHENTICATION_TTL.max(ALLOWED_TTL);
        assert!(gate.admit_at(prom, &metrics, later).await.is_ok());
        assert_eq!(counts(&gate), (2, 2));

        // Rejections are kept too: an unknown token, a denied request.
        let unknown = Some(b"Bearer t-unknown".as_slice());
        let tenant = Some(b"Bearer t-tenant".as_slice());
        for s in [0, 10, 20] {
            let at = t0 + Duration::from_secs(s);
            assert!(gate.admit_at(unknown, &metrics, at).await.is_err());
            assert!(gate.admit_at(tenant, &metrics, at).await.is_err());
        }
        assert_eq!(counts(&gate), (4, 3));
        // The denial expires before the token's user does.
        let at = t0 + DENIED_TTL;
        assert!(gate.admit_at(tenant, &metrics, at).await.is_err());
        assert_eq!(counts(&gate), (4, 4));
    }

    #[tokio::test]
    async fn a_review_the_api_server_does_not_answer_is_503_and_not_kept() {
        let gate = gate();
        let prom = Some(b"Bearer t-prom".as_slice());
        let metrics = [Attributes::get("/metrics")];
        *gate.reviews.failing.lock().unwrap() = true;
        match gate.admit(prom, &metrics).await {
            Err(e) => {
                assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
                assert!(e.to_string().contains("TokenReview within 5s"), "{e}");
            }
            Ok(u) => panic!("{u:?}"),
        }
        *gate.reviews.failing.lock().unwrap() = false;
        assert!(gate.admit(prom, &metrics).await.is_ok());
        assert_eq!(counts(&gate), (2, 1));
        assert_eq!((gate.users.len(), gate.decisions.len()), (1, 1));
    }

    #[tokio::test]
    async fn a_failed_alternative_is_an_error_unless_another_is_allowed() {
        let gate = gate();
        let tenant = Some(b"Bearer t-tenant".as_slice());
        // Authenticated first, then the authorizer fails.
        assert_eq!(
            status(gate.admit(tenant, &[Attributes::get("/usage")]).await),
            403
        );
        *gate.reviews.failing.lock().unwrap() = true;
        let own = Attributes::list_in("resource.k8s.io", "resourceclaims", "team-a");
        let other = Attributes::list_in("resource.k8s.io", "resourceclaims", "team-b");
        // `get /usage` is denied from the cache; the namespace cannot be checked: not a 403.
        assert_eq!(
            status(
                gate.admit(tenant, &[Attributes::get("/usage"), other.clone()])
                    .await
            ),
            503
        );
        *gate.reviews.failing.lock().unwrap() = false;
        assert_eq!(
            status(gate.admit(tenant, &[Attributes::get("/usage"), own]).await),
            200
        );
        assert_eq!(
            status(
                gate.admit(tenant, &[Attributes::get("/usage"), other])
                    .await
            ),
            403
        );
    }

    #[test]
    fn a_refused_review_is_500_and_an_unreachable_api_server_503() {
        let refused = ReviewError::Failed {
            review: "TokenReview",
            source: kube::Error::Api(
                kube::core::Status::failure("tokenreviews is forbidden", "Forbidden")
                    .with_code(403)
                    .boxed(),
            ),
        };
        assert_eq!(refused.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let timed_out = ReviewError::TimedOut {
            review: "TokenReview",
            after: Duration::from_secs(5),
        };
        assert_eq!(timed_out.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
}

//! Leader election on a coordination.k8s.io/v1 Lease, so two or more
//! replicas can run and only one reconciles. Correctness of binding does not
//! depend on it (every bind is an optimistic-locked write); it keeps
//! replicas from wasting work on conflicts.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, PostParams};
use tracing::{info, warn};

/// Errors of leader election.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// An API call failed.
    #[error("lease api call failed: {0}")]
    Kube(#[source] kube::Error),
    /// The lease could not be renewed within its duration.
    #[error("lost the lease {0}")]
    Lost(String),
}

/// Parameters of the election.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This replica's identity (holderIdentity).
    pub identity: String,
    /// How long a lease is valid without renewal.
    pub lease_duration: Duration,
    /// How often the holder renews.
    pub renew_every: Duration,
}

/// Campaigns for and holds one Lease.
#[derive(Debug)]
pub struct Elector {
    api: Api<Lease>,
    cfg: LeaseConfig,
}

/// How long a standby waits before its next attempt, having campaigned for
/// `waited` and seen another holder whose lease has `left` to run (`None`:
/// unknown, or a write lost to another replica).
fn standby_wait(cfg: &LeaseConfig, waited: Duration, left: Option<Duration>) -> Duration {
    let Some(left) = left else {
        return cfg.renew_every;
    };
    let at_expiry = left + Duration::from_millis(50);
    if at_expiry >= cfg.renew_every {
        return cfg.renew_every;
    }
    if waited + at_expiry >= cfg.lease_duration {
        at_expiry
    } else {
        // a newcomer: the established standby goes first
        at_expiry + cfg.renew_every / 2
    }
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

impl Elector {
    /// An elector for `cfg` using `client`.
    pub fn new(client: Client, cfg: LeaseConfig) -> Self {
        Self {
            api: Api::namespaced(client, &cfg.namespace),
            cfg,
        }
    }

    /// Blocks until this replica holds the lease.
    /// A standby tries again every `renew_every`, or as soon as the
    /// holder's lease expires when that is sooner: it takes over within the
    /// lease duration of the holder's last renewal. A replica that started
    /// less than one lease duration before that expiry (the Deployment's
    /// replacement for a killed leader) gives an established standby half a
    /// renewal period's head start, so the survivor takes over.
    pub async fn acquire(&self) -> Result<(), LeaderError> {
        let started = tokio::time::Instant::now();
        loop {
            let wait = match self.attempt().await {
                Ok((true, _)) => {
                    info!(lease = %self.cfg.name, identity = %self.cfg.identity, "acquired leadership");
                    return Ok(());
                }
                Ok((false, left)) => standby_wait(&self.cfg, started.elapsed(), left),
                Err(e) => {
                    warn!(error = %e, "lease attempt failed");
                    self.cfg.renew_every
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// The time this replica keeps to stop its controllers once it gives up
    /// the lease: one renewal period, so the last confirmed renewal's lease
    /// outlives both the give-up and the stop ([`Self::stop_grace`]).
    pub fn stop_window(&self) -> Duration {
        self.cfg
            .renew_every
            .min(self.cfg.lease_duration / 2)
            .max(Duration::from_millis(100))
    }

    /// How long controllers may take to stop after [`Self::hold`] returned:
    /// half the stop window, so they are gone before the lease can expire
    /// for another replica.
    pub fn stop_grace(&self) -> Duration {
        self.stop_window() / 2
    }

    /// Renews the lease until a renewal cannot be confirmed before the lease
    /// duration minus the [stop window](Self::stop_window) since the last
    /// confirmed one; then returns `Lost` (the caller must stop reconciling
    /// within [`Self::stop_grace`]). Each renewal is bounded by that
    /// deadline: an API server that accepts the request and never answers
    /// cannot keep this replica leading past its lease.
    pub async fn hold(&self) -> LeaderError {
        let lost = || LeaderError::Lost(self.cfg.name.clone());
        let keep = self.cfg.lease_duration.saturating_sub(self.stop_window());
        let mut last_ok = tokio::time::Instant::now();
        let mut wait = self.cfg.renew_every;
        loop {
            let deadline = last_ok + keep;
            let next = (tokio::time::Instant::now() + wait).min(deadline);
            tokio::time::sleep_until(next).await;
            let started = tokio::time::Instant::now();
            if started >= deadline {
                warn!(lease = %self.cfg.name, "no renewal confirmed in time; giving up the lease before it can expire");
                return lost();
            }
            match tokio::time::timeout_at(deadline, self.try_acquire_or_renew()).await {
                Ok(Ok(true)) => {
                    last_ok = started;
                    wait = self.cfg.renew_every;
                }
                Ok(Ok(false)) => return lost(),
                Ok(Err(e)) => {
                    warn!(error = %e, "lease renewal failed");
                    wait = self.cfg.renew_every / 2;
                }
                Err(_) => {
                    warn!(lease = %self.cfg.name, "lease renewal unanswered; giving up the lease before it can expire");
                    return lost();
                }
            }
        }
    }

    /// One attempt: create the lease, take it over when expired or free, or
    /// renew it when ours. Every write carries the resourceVersion read.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, LeaderError> {
        self.attempt().await.map(|(held, _)| held)
    }

    /// [`Self::try_acquire_or_renew`], and when another replica holds the
    /// lease, how long until it expires without a renewal.
    async fn attempt(&self) -> Result<(bool, Option<Duration>), LeaderError> {
        let secs = i32::try_from(self.cfg.lease_duration.as_secs())
            .unwrap_or(15)
            .max(1);
        let Some(mut lease) = self
            .api
            .get_opt(&self.cfg.name)
            .await
            .map_err(LeaderError::Kube)?
        else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.cfg.name.clone()),
                    namespace: Some(self.cfg.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.cfg.identity.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(now()),
                    renew_time: Some(now()),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok((true, None)),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok((false, None)),
                Err(e) => Err(LeaderError::Kube(e)),
            };
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let ours = holder == self.cfg.identity;
        if !ours && !holder.is_empty() {
            let duration = i64::from(spec.lease_duration_seconds.unwrap_or(secs));
            let left = spec.renew_time.as_ref().and_then(|t| {
                let end =
                    t.0.saturating_add(SignedDuration::from_secs(duration))
                        .ok()?;
                Duration::try_from(end.duration_since(Timestamp::now()))
                    .ok()
                    .filter(|d| !d.is_zero())
            });
            if left.is_some() {
                return Ok((false, left));
            }
        }
        if !ours {
            spec.holder_identity = Some(self.cfg.identity.clone());
            spec.acquire_time = Some(now());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.lease_duration_seconds = Some(secs);
        spec.renew_time = Some(now());
        match self
            .api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok((true, None)),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok((false, None)),
            Err(e) => Err(LeaderError::Kube(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An API server that accepts connections and never answers.
    async fn silent_server() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((sock, _)) = listener.accept().await {
                held.push(sock);
            }
        });
        (addr, task)
    }

    #[tokio::test]
    async fn a_renewal_the_api_server_never_answers_gives_up_before_the_lease_expires() {
        let (addr, server) = silent_server().await;
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let cfg = LeaseConfig {
            lease_duration: Duration::from_secs(6),
            renew_every: Duration::from_secs(2),
            ..cfg()
        };
        let elector = Elector::new(client, cfg.clone());
        let t = tokio::time::Instant::now();
        // Bounded by the lease itself: a hang here is the bug.
        let lost = tokio::time::timeout(cfg.lease_duration * 2, elector.hold()).await;
        let took = t.elapsed();
        server.abort();
        assert!(
            matches!(lost, Ok(LeaderError::Lost(_))),
            "hold still waiting on an unanswered renewal after {took:?}"
        );
        // Given up at lease - stop window (4 s): the controllers' grace
        // (1 s) still ends before the lease (6 s) could expire.
        assert!(
            took + elector.stop_grace() < cfg.lease_duration,
            "gave up after {took:?}"
        );
        assert!(
            took >= cfg.lease_duration - elector.stop_window(),
            "{took:?}"
        );
    }

    fn cfg() -> LeaseConfig {
        LeaseConfig {
            namespace: "ns".into(),
            name: "lease".into(),
            identity: "me".into(),
            lease_duration: Duration::from_secs(15),
            renew_every: Duration::from_secs(5),
        }
    }

    #[test]
    fn a_standby_polls_every_renewal_while_the_holder_is_fresh() {
        let c = cfg();
        assert_eq!(
            standby_wait(&c, Duration::from_secs(60), Some(Duration::from_secs(12))),
            c.renew_every
        );
        assert_eq!(
            standby_wait(&c, Duration::from_secs(60), None),
            c.renew_every
        );
    }

    #[test]
    fn an_established_standby_tries_at_the_holders_expiry() {
        let c = cfg();
        assert_eq!(
            standby_wait(&c, Duration::from_secs(60), Some(Duration::from_secs(3))),
            Duration::from_millis(3050)
        );
    }

    #[test]
    fn a_newcomer_lets_the_established_standby_go_first() {
        let c = cfg();
        // started 2 s ago, the holder (just killed) expires in 3 s
        let newcomer = standby_wait(&c, Duration::from_secs(2), Some(Duration::from_secs(3)));
        let survivor = standby_wait(&c, Duration::from_secs(60), Some(Duration::from_secs(3)));
        assert!(
            newcomer >= survivor + Duration::from_secs(2),
            "{newcomer:?} vs {survivor:?}"
        );
        // still within a renewal period of the expiry
        assert!(newcomer < Duration::from_secs(3) + c.renew_every);
    }
}

//! The one way the manager runs a controller.
//!
//! Every controller (claims, readiness, ipam, validity, lifecycle) is built
//! from a [`Scope`] (the kube `Client`, the watched namespace, the metrics,
//! the event `Recorder` with this replica's identity and the cancellation
//! token of the current leadership term) and driven by [`drive`]:
//!
//! - the watched kinds come from [`Scope::api`]: `Api::namespaced` when the
//!   manager runs with `--namespace`, `Api::all` only when it is unset;
//! - reconciles are counted by kind; failures go through one
//!   [`error_policy`]: the object's namespace/name in the log line, the
//!   error's fixed kind ([`ReconcileError::kind`]) as a metric label (no
//!   per-object labels), a quick requeue ([`CONFLICT_REQUEUE`]) on 409
//!   Conflict and a slower one ([`ERROR_REQUEUE`]) otherwise;
//! - each controller writes under its own constant field manager
//!   ([`Identity::field_manager`], see [`patch_params`]);
//! - the controller stops (graceful: running reconciles finish) when the
//!   scope's token is cancelled, which the runtime does on shutdown and when
//!   the leader Lease is lost.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt, TryFuture};
use kube::api::{Api, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, warn};

use crate::metrics::Metrics;

/// Requeue after a 409 Conflict: the object changed under us, the next read
/// is fresh, so try again almost at once.
pub const CONFLICT_REQUEUE: Duration = Duration::from_millis(200);
/// Requeue after any other failure.
pub const ERROR_REQUEUE: Duration = Duration::from_secs(5);

/// Who a controller is: its task and span name, the kind it reconciles (a
/// metric label) and the field manager of its writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Task and span name, e.g. `claims`.
    pub name: &'static str,
    /// Kind reconciled, e.g. `MachineClaim`.
    pub kind: &'static str,
    /// Field manager of every write, e.g. `anneal-claims`.
    pub field_manager: &'static str,
}

/// `PatchParams` carrying `field_manager`.
pub fn patch_params(field_manager: &str) -> PatchParams {
    PatchParams {
        field_manager: Some(field_manager.to_string()),
        ..PatchParams::default()
    }
}

/// The error of a reconcile, as the shared error policy needs it.
pub trait ReconcileError: std::error::Error + Send + 'static {
    /// True when the API server refused a write with 409 Conflict.
    fn is_conflict(&self) -> bool;
    /// A fixed, low-cardinality name of the error (a metric label).
    fn kind(&self) -> &'static str;
}

/// True for a 409 Conflict from the API server.
pub fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// What a controller gets from the runtime.
#[derive(Clone)]
pub struct Scope {
    /// The API client.
    pub client: Client,
    /// The watched namespace; `None` watches all.
    pub namespace: Option<String>,
    /// The manager's metrics.
    pub metrics: Arc<Metrics>,
    /// Events, reported as `anneal-manager` with this replica's identity.
    pub recorder: Recorder,
    /// Cancelled when the controller must stop.
    pub cancel: CancellationToken,
}

impl Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

/// The longest Event note the API server accepts (events.k8s.io/v1 refuses
/// a longer one, and the Event is lost).
pub const EVENT_NOTE_MAX: usize = 1024;

/// `note` cut to [`EVENT_NOTE_MAX`] bytes at a character boundary, ending
/// in `…` when cut (the full text stays in the object's status).
pub fn event_note(mut note: String) -> String {
    if note.len() <= EVENT_NOTE_MAX {
        return note;
    }
    let mut end = EVENT_NOTE_MAX - '…'.len_utf8();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note.truncate(end);
    note.push('…');
    note
}

/// The Event action for `note`: `action` plus a digest of the note. kube's
/// Recorder folds a repeat of the same (type, action, reason, object) into
/// the first Event's series and keeps the first note, so a second failure
/// with another message (a deploy that failed for another reason) would show
/// the old one in `kubectl describe`; with the digest only a repeat of the
/// same note is folded.
pub fn event_action(action: &str, note: &str) -> String {
    format!("{action}-{}", &anneal_api::digest(note)[..8])
}

/// Publishes an Event about `obj` off the reconcile path (an event write
/// must not hold one of the reconcile slots); a failure is logged at debug.
pub fn publish_event(
    recorder: &Recorder,
    obj: &impl Resource<DynamicType = ()>,
    type_: kube::runtime::events::EventType,
    action: &str,
    reason: &str,
    note: String,
) {
    let ev = kube::runtime::events::Event {
        type_,
        reason: reason.to_string(),
        action: event_action(action, &note),
        note: Some(event_note(note)),
        secondary: None,
    };
    let recorder = recorder.clone();
    let reference = obj.object_ref(&());
    tokio::spawn(async move {
        if let Err(e) = recorder.publish(&ev, &reference).await {
            debug!(error = %e, "publishing event failed");
        }
    });
}

/// The reporter of the manager's Events: `anneal-manager`, with the
/// replica's identity when there is one.
pub fn reporter(identity: Option<String>) -> Reporter {
    Reporter {
        controller: "anneal-manager".into(),
        instance: identity,
    }
}

impl Scope {
    /// A scope outside the runtime (tests, compatibility entry points): all
    /// namespaces, fresh metrics, no replica identity.
    pub fn standalone(client: Client, cancel: CancellationToken) -> Self {
        Self {
            recorder: Recorder::new(client.clone(), reporter(None)),
            client,
            namespace: None,
            metrics: Metrics::new(),
            cancel,
        }
    }

    /// `Api<K>` of the watched namespace, or of every namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        scoped(&self.client, self.namespace.as_deref())
    }

    /// A cached watch of `K` in the scope: the cache and the stream of
    /// touched objects for `Controller::watches_stream`.
    pub fn reflected<K>(
        &self,
    ) -> (
        Store<K>,
        impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
    )
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + DeserializeOwned
            + Debug
            + Send
            + Sync
            + 'static,
        K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
    {
        reflected(self.api::<K>())
    }

    /// A future that resolves when the scope is cancelled.
    pub fn cancelled(&self) -> impl Future<Output = ()> + Send + Sync + 'static {
        self.cancel.clone().cancelled_owned()
    }
}

/// `Api<K>` of `namespace`, or of every namespace when `None`.
pub fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// A watch of `api` that keeps a cache: the cache, and the stream of touched
/// objects to hand to `Controller::watches_stream`.
pub fn reflected<K>(
    api: Api<K>,
) -> (
    Store<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    let (store, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(slim)
        .reflect(writer)
        .touched_objects();
    (store, stream)
}

/// What a cache never needs of an object: its managedFields (often larger
/// than the spec) and kubectl's last-applied copy. Dropped before the object
/// enters a store, so a cache of 10,000 objects holds only what reconciles
/// read. Nothing writes a cached object back whole.
pub fn slim<K: Resource>(obj: &mut K) {
    obj.managed_fields_mut().clear();
    if let Some(a) = obj.meta_mut().annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

/// The error policy of every controller: counts the failure by kind and
/// error kind, logs it with the object's namespace/name, and requeues
/// quickly on a conflict, slower otherwise.
pub fn error_policy<K, E>(id: &Identity, metrics: &Metrics, obj: &K, err: &E) -> Action
where
    K: Resource,
    E: ReconcileError,
{
    metrics.failed(id.kind, err.kind());
    let namespace = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    if err.is_conflict() {
        debug!(controller = id.name, %namespace, %name, error = %err, "conflict; requeued");
        Action::requeue(CONFLICT_REQUEUE)
    } else {
        warn!(
            controller = id.name,
            %namespace,
            %name,
            error_kind = err.kind(),
            error = %err,
            "reconcile failed; requeued"
        );
        Action::requeue(ERROR_REQUEUE)
    }
}

/// Runs `controller` with `reconcile` until the scope is cancelled, under
/// the span `controller{name}`, with the shared [`error_policy`] and a
/// reconcile count by kind.
pub async fn drive<K, Ctx, Fut, E>(
    id: Identity,
    scope: &Scope,
    controller: Controller<K>,
    mut reconcile: impl FnMut(Arc<K>, Arc<Ctx>) -> Fut,
    ctx: Arc<Ctx>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Debug + Unpin,
    Fut: TryFuture<Ok = Action, Error = E> + Send + 'static,
    E: ReconcileError,
    Ctx: Send + Sync + 'static,
{
    let counted = scope.metrics.clone();
    let metrics = scope.metrics.clone();
    controller
        .graceful_shutdown_on(scope.cancelled())
        .run(
            move |obj, ctx| {
                counted.reconciled(id.kind);
                reconcile(obj, ctx)
            },
            move |obj, err, _ctx| error_policy(&id, &metrics, obj.as_ref(), err),
            ctx,
        )
        .for_each(|res| async move {
            if let Err(e) = res {
                debug!(error = %e, "reconcile ended with an error");
            }
        })
        .instrument(tracing::info_span!("controller", name = id.name))
        .await;
}

/// A secondary index of a watched kind (for example: free Machines per
/// namespace), kept in step with its cache by the same watch stream, so a
/// reconcile looks up what it needs instead of scanning every object.
pub trait Index<K>: Default + Send + 'static {
    /// `obj` was added or changed (the index forgets what it knew of it).
    fn upsert(&mut self, obj: &K);
    /// `obj` is gone.
    fn remove(&mut self, obj: &K);
}

/// An [`Index`] shared by the watch that updates it and the reconcilers
/// that read it. A re-list builds a fresh index and swaps it in when the
/// list is complete, as the reflector does with its store.
#[derive(Debug, Default)]
pub struct Indexed<I> {
    live: std::sync::RwLock<I>,
    rebuilding: std::sync::Mutex<Option<I>>,
}

impl<I> Indexed<I> {
    /// Reads the index.
    pub fn read<R>(&self, f: impl FnOnce(&I) -> R) -> R {
        let guard = self.live.read().unwrap_or_else(|p| p.into_inner());
        f(&guard)
    }

    /// Applies one watch event.
    pub fn apply<K>(&self, event: &watcher::Event<K>)
    where
        I: Index<K>,
    {
        let mut rebuilding = self.rebuilding.lock().unwrap_or_else(|p| p.into_inner());
        match event {
            watcher::Event::Init => *rebuilding = Some(I::default()),
            watcher::Event::InitApply(obj) => {
                if let Some(next) = rebuilding.as_mut() {
                    next.upsert(obj);
                }
            }
            watcher::Event::InitDone => {
                if let Some(next) = rebuilding.take() {
                    *self.live.write().unwrap_or_else(|p| p.into_inner()) = next;
                }
            }
            watcher::Event::Apply(obj) => self
                .live
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .upsert(obj),
            watcher::Event::Delete(obj) => self
                .live
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .remove(obj),
        }
    }
}

/// [`reflected`] plus an index `I` kept by the same stream.
pub fn indexed<K, I>(
    api: Api<K>,
) -> (
    Store<K>,
    Arc<Indexed<I>>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
    I: Index<K> + Sync,
{
    let (store, writer) = reflector::store();
    let index: Arc<Indexed<I>> = Arc::default();
    let feed = index.clone();
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(slim)
        .reflect(writer)
        .map(move |ev| {
            if let Ok(ev) = &ev {
                feed.apply(ev);
            }
            ev
        })
        .touched_objects();
    (store, index, stream)
}

#[cfg(test)]
mod note_tests {
    use super::*;

    #[test]
    fn event_notes_fit_the_api_servers_limit() {
        assert_eq!(event_note("short".into()), "short");
        let exact = "x".repeat(EVENT_NOTE_MAX);
        assert_eq!(event_note(exact.clone()), exact);
        // multi-byte characters straddling the limit are not split
        let long = "é".repeat(EVENT_NOTE_MAX);
        let cut = event_note(long);
        assert!(cut.len() <= EVENT_NOTE_MAX, "{}", cut.len());
        assert!(cut.ends_with('…'));
        assert!(cut.trim_end_matches('…').chars().all(|c| c == 'é'));
    }

    #[test]
    fn only_a_repeat_of_the_same_note_shares_an_event() {
        let a = event_action("Reconcile", "stalled for 40 s");
        assert_eq!(a, event_action("Reconcile", "stalled for 40 s"));
        assert_ne!(a, event_action("Reconcile", "script exited with code 3"));
        assert!(a.starts_with("Reconcile-") && a.len() <= 128, "{a}");
    }
}

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
    /// Who reports the Events (the [`Recorder`]'s reporter), for Events
    /// published without its cache ([`publish_once`]).
    pub reporter: Reporter,
    /// Cancelled when the controller must stop.
    pub cancel: CancellationToken,
    /// The Machine watch the controllers of this term share ([`Scope::machines`]);
    /// `None`: each controller watches Machines itself.
    pub machines: Option<Arc<SharedWatch<anneal_api::Machine>>>,
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

/// Publishes an Event about `obj` off the reconcile path like
/// [`publish_event`], but without the [`Recorder`]'s cache: kube's Recorder
/// keeps every Event it published for six minutes (to fold a repeat into
/// its series) and scans them all on each publish, which for an Event
/// written once per object (a claim's `Bound`: 10,000 binds, 10,000 Events)
/// is memory and time for nothing. A repeat becomes a new Event.
pub fn publish_once(
    client: &Client,
    reporter: &Reporter,
    obj: &impl Resource<DynamicType = ()>,
    type_: kube::runtime::events::EventType,
    action: &str,
    reason: &str,
    note: String,
) {
    let event = one_off_event(reporter, obj.object_ref(&()), type_, action, reason, note);
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(
        client.clone(),
        event.metadata.namespace.as_deref().unwrap_or("default"),
    );
    tokio::spawn(async move {
        if let Err(e) = api.create(&kube::api::PostParams::default(), &event).await {
            debug!(error = %e, "publishing event failed");
        }
    });
}

/// The events.k8s.io Event [`publish_once`] creates: what kube's Recorder
/// writes for a first occurrence.
fn one_off_event(
    reporter: &Reporter,
    regarding: k8s_openapi::api::core::v1::ObjectReference,
    type_: kube::runtime::events::EventType,
    action: &str,
    reason: &str,
    note: String,
) -> k8s_openapi::api::events::v1::Event {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
    let now = k8s_openapi::jiff::Timestamp::now();
    let action = event_action(action, &note);
    let note = event_note(note);
    k8s_openapi::api::events::v1::Event {
        action: Some(action),
        reason: Some(reason.to_string()),
        event_time: Some(MicroTime(now)),
        metadata: ObjectMeta {
            namespace: regarding.namespace.clone(),
            name: Some(format!(
                "{}.{:x}",
                regarding.name.as_deref().unwrap_or(&reporter.controller),
                now.as_nanosecond()
            )),
            ..ObjectMeta::default()
        },
        note: Some(note),
        regarding: Some(regarding),
        reporting_controller: Some(reporter.controller.clone()),
        reporting_instance: Some(
            reporter
                .instance
                .clone()
                .unwrap_or_else(|| reporter.controller.clone()),
        ),
        type_: Some(
            match type_ {
                kube::runtime::events::EventType::Normal => "Normal",
                kube::runtime::events::EventType::Warning => "Warning",
            }
            .to_string(),
        ),
        ..k8s_openapi::api::events::v1::Event::default()
    }
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
            reporter: reporter(None),
            client,
            namespace: None,
            metrics: Metrics::new(),
            cancel,
            machines: None,
        }
    }

    /// The Machines of the scope: the term's shared watch when the runtime
    /// set one up and it has not started yet, else a watch of the caller's
    /// own. Call it while building the controller (before its future is
    /// first polled), as the runtime starts the shared watch once every
    /// controller is built.
    pub fn machines(&self) -> Feed<anneal_api::Machine> {
        match self.machines.as_ref().and_then(|w| w.subscribe()) {
            Some(feed) => feed,
            None => Feed::own(self.api()),
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

    /// Applies one watch event (of objects or of `Arc`s of them).
    pub fn apply<K, T>(&self, event: &watcher::Event<T>)
    where
        I: Index<K>,
        T: std::borrow::Borrow<K>,
    {
        let mut rebuilding = self.rebuilding.lock().unwrap_or_else(|p| p.into_inner());
        match event {
            watcher::Event::Init => *rebuilding = Some(I::default()),
            watcher::Event::InitApply(obj) => {
                if let Some(next) = rebuilding.as_mut() {
                    next.upsert(obj.borrow());
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
                .upsert(obj.borrow()),
            watcher::Event::Delete(obj) => self
                .live
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .remove(obj.borrow()),
        }
    }
}

/// A cache of `K` and every watch event of it, each delivered after the
/// cache applied it: the events hold `Arc`s of one copy of each object, so
/// several controllers fed by one [`SharedWatch`] keep one cache between
/// them.
pub struct Feed<K>
where
    K: Resource + 'static,
    K::DynamicType: Eq + Hash,
{
    /// The cache.
    pub store: Store<K>,
    /// Every watch event (errors are logged and skipped; the watch backs off
    /// and resumes).
    pub events: futures::stream::BoxStream<'static, watcher::Event<Arc<K>>>,
}

impl<K> Debug for Feed<K>
where
    K: Resource + 'static,
    K::DynamicType: Eq + Hash,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feed").finish_non_exhaustive()
    }
}

/// `ev` with its objects behind `Arc`s.
fn arc_event<K>(ev: watcher::Event<K>) -> watcher::Event<Arc<K>> {
    match ev {
        watcher::Event::Apply(o) => watcher::Event::Apply(Arc::new(o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(Arc::new(o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(o) => watcher::Event::InitApply(Arc::new(o)),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// The object an event touched (added, changed, listed or deleted), as
/// `touched_objects` yields it for a watch of one's own.
pub fn touched<K>(ev: watcher::Event<Arc<K>>) -> Option<Arc<K>> {
    match ev {
        watcher::Event::Apply(o) | watcher::Event::InitApply(o) | watcher::Event::Delete(o) => {
            Some(o)
        }
        watcher::Event::Init | watcher::Event::InitDone => None,
    }
}

/// The slimmed watch every cache of the manager uses.
fn slim_watch<K>(api: Api<K>) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(slim)
}

impl<K> Feed<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    /// A feed from a watch of its own.
    pub fn own(api: Api<K>) -> Self {
        let (store, writer) = reflector::store();
        let events = slim_watch(api)
            .reflect(writer)
            .filter_map(|ev| {
                futures::future::ready(match ev {
                    Ok(ev) => Some(arc_event(ev)),
                    Err(e) => {
                        debug!(error = %e, "watch failed; backing off");
                        None
                    }
                })
            })
            .boxed();
        Self { store, events }
    }

    /// The objects the events touch, for `Controller::for_shared_stream`
    /// and `watches_shared_stream`.
    pub fn touched(self) -> (Store<K>, impl Stream<Item = Arc<K>> + Send + 'static) {
        let stream = self
            .events
            .filter_map(|ev| futures::future::ready(touched(ev)));
        (self.store, stream)
    }

    /// [`Feed::touched`] plus an index `I` kept by the same events.
    pub fn indexed<I>(
        self,
    ) -> (
        Store<K>,
        Arc<Indexed<I>>,
        impl Stream<Item = Arc<K>> + Send + 'static,
    )
    where
        I: Index<K> + Sync,
    {
        let index: Arc<Indexed<I>> = Arc::default();
        let feed = index.clone();
        let stream = self.events.filter_map(move |ev| {
            feed.apply(&ev);
            futures::future::ready(touched(ev))
        });
        (self.store, index, stream)
    }
}

/// One watch of `K` shared by the controllers of a term: one API-server
/// watch and one cache instead of one each (10,000 Machines cost about 30
/// MiB per cache). The runtime builds it, each controller subscribes while
/// it is being built ([`Scope::machines`]), then [`SharedWatch::run`]
/// starts the watch: every subscriber gets every event, the first list
/// included, after the cache applied it.
pub struct SharedWatch<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    api: Api<K>,
    store: Store<K>,
    state: std::sync::Mutex<Hub<K>>,
}

struct Hub<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    /// Taken by [`SharedWatch::run`]: a later subscriber would miss events.
    writer: Option<reflector::store::Writer<K>>,
    subscribers: Vec<tokio::sync::mpsc::UnboundedSender<watcher::Event<Arc<K>>>>,
}

impl<K> Debug for SharedWatch<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWatch").finish_non_exhaustive()
    }
}

impl<K> SharedWatch<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    /// A watch of `api`, not started.
    pub fn new(api: Api<K>) -> Self {
        let (store, writer) = reflector::store();
        Self {
            api,
            store,
            state: std::sync::Mutex::new(Hub {
                writer: Some(writer),
                subscribers: Vec::new(),
            }),
        }
    }

    /// A feed of this watch; `None` once it runs.
    pub fn subscribe(&self) -> Option<Feed<K>> {
        let mut hub = self.state.lock().unwrap_or_else(|p| p.into_inner());
        hub.writer.as_ref()?;
        // Unbounded: the events are Arcs of the cached copies, and a slow
        // subscriber must not hold the others' events (nor the cache) back.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        hub.subscribers.push(tx);
        Some(Feed {
            store: self.store.clone(),
            events: tokio_stream_of(rx),
        })
    }

    /// `ev` with the cache's own copy of an applied object (the cache keeps
    /// a clone of what it applies): a subscriber still to take the event
    /// (a controller whose reconcile slots are all busy) then holds no
    /// second copy. During a list the cache shows nothing before its end.
    fn cached(&self, ev: watcher::Event<K>) -> watcher::Event<Arc<K>> {
        match ev {
            watcher::Event::Apply(o) => {
                let key = reflector::ObjectRef::from_obj(&o);
                watcher::Event::Apply(self.store.get(&key).unwrap_or_else(|| Arc::new(o)))
            }
            other => arc_event(other),
        }
    }

    /// Runs the watch until `cancel`; the subscribers' streams end with it.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        let taken = {
            let mut hub = self.state.lock().unwrap_or_else(|p| p.into_inner());
            hub.writer.take()
        };
        let Some(mut writer) = taken else {
            warn!("a shared watch ran twice; the second run does nothing");
            return;
        };
        let stream = slim_watch(self.api.clone());
        let mut stream = std::pin::pin!(stream);
        loop {
            let ev = tokio::select! {
                () = cancel.cancelled() => break,
                ev = stream.next() => ev,
            };
            match ev {
                Some(Ok(ev)) => {
                    writer.apply_watcher_event(&ev);
                    let ev = self.cached(ev);
                    let mut hub = self.state.lock().unwrap_or_else(|p| p.into_inner());
                    hub.subscribers.retain(|tx| tx.send(ev.clone()).is_ok());
                }
                Some(Err(e)) => debug!(error = %e, "shared watch failed; backing off"),
                None => break,
            }
        }
        // Dropping the senders ends the subscribers' streams.
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .subscribers
            .clear();
    }
}

/// The receiver as a stream.
fn tokio_stream_of<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<T>,
) -> futures::stream::BoxStream<'static, T> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
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

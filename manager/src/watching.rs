//! What every controller of the manager sets up the same way: an `Api`
//! scoped to the watched namespace (or all), and a reflected watch of a
//! secondary kind whose cache the reconciler reads.

use std::fmt::Debug;
use std::hash::Hash;

use futures::Stream;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;

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
        .reflect(writer)
        .touched_objects();
    (store, stream)
}

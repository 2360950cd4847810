//! `import FILE|URL --name NAME`: a local file is uploaded to the manager's
//! staged-upload endpoint (`PUT /v1/staged/<namespace>/<name>`, HTTPS, a
//! bearer token) with its sha256 computed as it streams, then ImageImport
//! NAME is created (`staged://NAME`, that checksum); a URL becomes the
//! ImageImport's source directly. Either way the import is followed to
//! Succeeded and its Image to Ready.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anneal_api::{Image, ImageImport, ImageState, ImportState};
use bytes::Bytes;
use futures::{SinkExt, StreamExt, TryStreamExt};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use sha2::Digest as _;
use tokio::io::AsyncReadExt;

use crate::progress::{self, Board};
use crate::{Error, FIELD_MANAGER};

/// ConfigMap publishing the manager's CA certificate (key `ca.crt`), in the
/// manager's namespace (the CA's private key stays in a Secret only the
/// manager reads).
pub const CA_CONFIGMAP: &str = "anneal-agent-api-ca";
/// Key of the CA certificate (PEM) in [`CA_CONFIGMAP`].
pub const CA_CERT_KEY: &str = "ca.crt";

/// Size of one upload frame.
const CHUNK: usize = 1 << 20;

/// How long an upload waits for the endpoint's `100 Continue` before it
/// sends the body anyway (an endpoint behind a proxy that drops it).
const CONTINUE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// What `import` was asked.
#[derive(Debug, Clone)]
pub struct Request {
    /// A local file, or an `http(s)://` / `staged://` URL.
    pub source: String,
    /// The ImageImport (and by default the Image and content prefix).
    pub name: String,
    /// `spec.imageName` (default: the import's name).
    pub image_name: Option<String>,
    /// `spec.contentPrefix` (default: the import's name).
    pub content_prefix: Option<String>,
    /// `spec.source.format` (`raw`, `qcow2`, `partclone`; default: detected).
    pub format: Option<String>,
    /// `spec.source.checksum` for a URL (`sha256:<hex>`).
    pub checksum: Option<String>,
    /// `spec.osFamily`.
    pub os_family: Option<String>,
    /// The staged-upload endpoint, `https://HOST:PORT`.
    pub upload_url: Option<String>,
    /// A PEM file with the CA of the endpoint.
    pub upload_ca: Option<PathBuf>,
    /// Namespace of ConfigMap `anneal-agent-api-ca` (when no `upload_ca`).
    pub pki_namespace: String,
    /// The bearer token for the endpoint.
    pub token: Option<String>,
}

/// Whether `source` names a URL rather than a local file.
fn is_url(source: &str) -> bool {
    ["http://", "https://", "staged://"]
        .iter()
        .any(|p| source.starts_with(p))
}

/// Runs `import`.
pub async fn run(
    client: &Client,
    namespace: &str,
    req: Request,
    kube_token: Option<String>,
    tty: bool,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let imports: Api<ImageImport> = Api::namespaced(client.clone(), namespace);
    let image_name = req.image_name.clone().unwrap_or_else(|| req.name.clone());
    ensure_free::<ImageImport>(client, namespace, &req.name, "imageimport", "imageimports").await?;
    ensure_free::<Image>(client, namespace, &image_name, "image", "images").await?;

    let (url, checksum) = if is_url(&req.source) {
        (req.source.clone(), req.checksum.clone())
    } else {
        let path = PathBuf::from(&req.source);
        let endpoint = endpoint(client, &req, kube_token).await?;
        let sha = upload(&endpoint, namespace, &req.name, &path, tty, out).await?;
        (
            format!("staged://{}", req.name),
            Some(format!("sha256:{sha}")),
        )
    };

    let mut source = serde_json::json!({ "url": url });
    if let Some(c) = &checksum {
        source["checksum"] = c.clone().into();
    }
    if let Some(f) = &req.format {
        source["format"] = f.clone().into();
    }
    let mut spec = serde_json::json!({
        "source": source,
        "imageName": image_name,
        "contentPrefix": req.content_prefix.clone().unwrap_or_else(|| req.name.clone()),
    });
    if let Some(os) = &req.os_family {
        spec["osFamily"] = os.clone().into();
    }
    let obj: ImageImport = serde_json::from_value(serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "ImageImport",
        "metadata": {"name": req.name, "namespace": namespace},
        "spec": spec,
    }))?;
    let pp = PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PostParams::default()
    };
    imports.create(&pp, &obj).await.map_err(|e| match e {
        kube::Error::Api(ref s) if s.code == 409 => Error::AlreadyExists {
            kind: "imageimport",
            namespace: namespace.to_string(),
            name: req.name.clone(),
            hint: format!("pick another --name (kubectl get imageimports -n {namespace})"),
        },
        e => Error::api("creating", "imageimport", namespace, &req.name)(e),
    })?;
    writeln!(
        out,
        "imageimport {namespace}/{} created (source {url}{})",
        req.name,
        checksum
            .as_deref()
            .map(|c| format!(", checksum {c}"))
            .unwrap_or_default()
    )?;
    out.flush()?;

    let done = follow_import(client, namespace, &req.name, tty, out).await?;
    let image = done
        .status
        .as_ref()
        .and_then(|s| s.image_ref.as_ref())
        .map_or(image_name, |r| r.name.clone());
    follow_image(client, namespace, &image, out).await
}

/// Refuses early when `name` is taken (the import would fail later).
async fn ensure_free<K>(
    client: &Client,
    namespace: &str,
    name: &str,
    kind: &'static str,
    plural: &str,
) -> Result<(), Error>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    if api
        .get_opt(name)
        .await
        .map_err(Error::api("reading", kind, namespace, name))?
        .is_some()
    {
        return Err(Error::AlreadyExists {
            kind,
            namespace: namespace.to_string(),
            name: name.to_string(),
            hint: format!(
                "an import never overwrites: pick another --name or --image-name (kubectl get {plural} -n {namespace})"
            ),
        });
    }
    Ok(())
}

/// The manager's CA certificate (PEM) as it publishes it: ConfigMap
/// [`CA_CONFIGMAP`], key [`CA_CERT_KEY`], in `namespace`.
pub async fn manager_ca(client: &Client, namespace: &str) -> Result<Vec<u8>, Error> {
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    maps.get_opt(CA_CONFIGMAP)
        .await
        .map_err(|source| Error::CaConfigMap {
            namespace: namespace.to_string(),
            detail: crate::error::chain(&source),
        })?
        .and_then(|c| c.data)
        .and_then(|mut d| d.remove(CA_CERT_KEY))
        .map(String::into_bytes)
        .ok_or_else(|| Error::CaConfigMap {
            namespace: namespace.to_string(),
            detail: format!(
                "it does not exist or has no key {CA_CERT_KEY}; the manager writes it when it starts"
            ),
        })
}

/// Where and how to upload.
struct Endpoint {
    url: String,
    host: String,
    port: u16,
    tls: tokio_rustls::TlsConnector,
    token: String,
}

async fn endpoint(
    client: &Client,
    req: &Request,
    kube_token: Option<String>,
) -> Result<Endpoint, Error> {
    let url = req.upload_url.clone().ok_or(Error::NoUploadUrl)?;
    let uri: hyper::Uri = url
        .parse()
        .map_err(|_| Error::BadUploadUrl { url: url.clone() })?;
    if uri.scheme_str() != Some("https") {
        return Err(Error::BadUploadUrl { url });
    }
    let host = uri
        .host()
        .ok_or_else(|| Error::BadUploadUrl { url: url.clone() })?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = uri.port_u16().unwrap_or(443);
    let token = req
        .token
        .clone()
        .or(kube_token)
        .filter(|t| !t.trim().is_empty())
        .ok_or(Error::NoToken)?;
    let pem = match &req.upload_ca {
        Some(path) => std::fs::read(path).map_err(|source| Error::ReadFile {
            path: path.display().to_string(),
            source,
        })?,
        None => manager_ca(client, &req.pki_namespace).await?,
    };
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject as _;
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|_| Error::BadCa)?;
        roots.add(cert).map_err(|_| Error::BadCa)?;
    }
    if roots.is_empty() {
        return Err(Error::BadCa);
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|_| Error::BadCa)?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Endpoint {
        url,
        host,
        port,
        tls: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
        token,
    })
}

/// What the endpoint answers to a good upload.
#[derive(Debug, serde::Deserialize)]
struct Answer {
    sha256: String,
    bytes: u64,
}

/// The connection carrying one upload's body.
type Sender = hyper::client::conn::http1::SendRequest<
    StreamBody<futures::channel::mpsc::Receiver<Result<Frame<Bytes>, std::io::Error>>>,
>;

/// Connects to the upload endpoint over TLS and HTTP/1.1; the request
/// sender and the task driving the connection.
async fn connect(
    ep: &Endpoint,
    target: &str,
) -> Result<(Sender, tokio::task::JoinHandle<hyper::Result<()>>), Error> {
    let unreachable = |source| Error::UploadUnreachable {
        url: target.to_owned(),
        source,
    };
    let tcp = tokio::net::TcpStream::connect((ep.host.as_str(), ep.port))
        .await
        .map_err(unreachable)?;
    let server_name = rustls::pki_types::ServerName::try_from(ep.host.clone()).map_err(|_| {
        Error::BadUploadUrl {
            url: ep.url.clone(),
        }
    })?;
    let tls = ep
        .tls
        .connect(server_name, tcp)
        .await
        .map_err(|source| Error::UploadTls {
            url: target.to_owned(),
            source,
        })?;
    let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .map_err(|e| Error::UploadHttp {
            url: target.to_owned(),
            detail: e.to_string(),
        })?;
    Ok((sender, tokio::spawn(conn)))
}

/// The error for an upload the endpoint refused, with the endpoint's
/// message and a hint per status.
fn refused(
    target: String,
    status: hyper::StatusCode,
    body: &[u8],
    namespace: &str,
    name: &str,
) -> Error {
    let message = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let hint = match status.as_u16() {
        401 => "the token was not accepted: pass --token $(kubectl create token SERVICEACCOUNT -n NAMESPACE)".to_string(),
        403 => format!(
            "the token's subject may not create imageimports.anneal.dev in namespace {namespace}: bind it a Role that allows it"
        ),
        409 => format!(
            "an upload named {name} already exists: import another --name, or import the staged file itself: kubectl anneal import staged://{name} --name OTHER -n {namespace}"
        ),
        413 if message.contains("content store quota") => format!(
            "namespace {namespace} has no room for it in the content store: delete Images and their PartitionContents (or unused staged uploads) there, or ask the administrator to raise the manager's --store-quota-bytes-per-namespace"
        ),
        413 => "the file is larger than the manager's --max-source-bytes: raise it or import a smaller (e.g. qcow2) image".to_string(),
        503 => "the endpoint is busy (16 uploads at once) or cannot reach the API server: retry later".to_string(),
        _ => "see the manager's log".to_string(),
    };
    Error::UploadRefused {
        url: target,
        status: status.as_u16(),
        message,
        hint,
    }
}

/// The upload's PUT, asking for `100 Continue` before its body.
fn put_request<B>(
    ep: &Endpoint,
    namespace: &str,
    name: &str,
    total: u64,
    body: B,
) -> Result<hyper::Request<B>, hyper::http::Error> {
    hyper::Request::builder()
        .method(hyper::Method::PUT)
        .uri(format!("/v1/staged/{namespace}/{name}"))
        .header(hyper::header::HOST, format!("{}:{}", ep.host, ep.port))
        .header(hyper::header::AUTHORIZATION, format!("Bearer {}", ep.token))
        .header(hyper::header::CONTENT_LENGTH, total)
        .header(hyper::header::CONTENT_TYPE, "application/octet-stream")
        .header(hyper::header::EXPECT, "100-continue")
        .body(body)
}

/// Uploads `path` as `staged://name`; returns its sha256 (hex), checked
/// against the endpoint's.
async fn upload(
    ep: &Endpoint,
    namespace: &str,
    name: &str,
    path: &Path,
    tty: bool,
    out: &mut dyn Write,
) -> Result<String, Error> {
    let read_err = |source| Error::ReadFile {
        path: path.display().to_string(),
        source,
    };
    let mut file = tokio::fs::File::open(path).await.map_err(read_err)?;
    let total = file.metadata().await.map_err(read_err)?.len();
    let target = format!(
        "{}/v1/staged/{namespace}/{name}",
        ep.url.trim_end_matches('/')
    );
    let (mut sender, conn) = connect(ep, &target).await?;

    let (mut tx, rx) = futures::channel::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
    let body = StreamBody::new(rx);
    // `Expect: 100-continue`: the endpoint checks the token, the RBAC, the
    // size and the name before it reads the body, and answers a refusal at
    // once and closes; a body already on the way would break the
    // connection (EPIPE, a reset) and lose that answer. So the body starts
    // on the endpoint's 100 Continue, or after CONTINUE_WAIT from one that
    // does not send it.
    let go = Arc::new(tokio::sync::Notify::new());
    let mut request =
        put_request(ep, namespace, name, total, body).map_err(|e| Error::UploadHttp {
            url: target.clone(),
            detail: e.to_string(),
        })?;
    {
        let go = go.clone();
        hyper::ext::on_informational(&mut request, move |res| {
            if res.status() == hyper::StatusCode::CONTINUE {
                go.notify_one();
            }
        });
    }

    let label = format!("upload {namespace}/{name}");
    let start = Instant::now();
    let mut hasher = sha2::Sha256::new();
    let mut board = Board::default();
    let mut next_line = 0u64;
    let mut show = |done: u64, out: &mut dyn Write, last: bool| -> std::io::Result<()> {
        let pct = progress::percent(done, total);
        let line = format!(
            "{label}: {} of {} ({pct}%) {} {}",
            progress::bytes(done),
            progress::bytes(total),
            progress::rate(done, start.elapsed()),
            progress::eta(done, total, start.elapsed()),
        );
        if tty {
            board
                .draw(out, &[format!("{} {line}", progress::bar(pct))], last)
                .map(drop)
        } else if pct >= next_line || last {
            // One line per 10 % step (and the last), so a log stays short.
            next_line = (pct / 10 + 1) * 10;
            writeln!(out, "{line}")?;
            out.flush()
        } else {
            Ok(())
        }
    };

    let response = {
        let send = sender.send_request(request);
        tokio::pin!(send);
        let feed = async {
            let _ = tokio::time::timeout(CONTINUE_WAIT, go.notified()).await;
            let mut done = 0u64;
            show(0, out, false)?;
            let mut buf = vec![0u8; CHUNK];
            loop {
                let n = file.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
                done += n as u64;
                if tx
                    .send(Ok(Frame::data(Bytes::copy_from_slice(&buf[..n]))))
                    .await
                    .is_err()
                {
                    // The endpoint answered before the end: its answer says why.
                    return Ok::<_, std::io::Error>(false);
                }
                show(done, out, done == total)?;
            }
            if done != total {
                show(done, out, true)?;
            }
            tx.close_channel();
            Ok(true)
        };
        tokio::pin!(feed);
        let mut fed: Option<bool> = None;
        loop {
            tokio::select! {
                r = &mut send => break r,
                r = &mut feed, if fed.is_none() => fed = Some(r.map_err(read_err)?),
            }
        }
    };
    let response = response.map_err(|e| Error::UploadHttp {
        url: target.clone(),
        detail: crate::error::chain(&e),
    })?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| Error::UploadHttp {
            url: target.clone(),
            detail: e.to_string(),
        })?
        .to_bytes();
    drop(sender);
    conn.abort();
    if !status.is_success() {
        return Err(refused(target, status, &body, namespace, name));
    }
    let answer: Answer = serde_json::from_slice(&body).map_err(|_| Error::UploadHttp {
        url: target.clone(),
        detail: format!("unexpected answer {}", String::from_utf8_lossy(&body)),
    })?;
    let sha = hex::encode(hasher.finalize());
    if answer.sha256 != sha || answer.bytes != total {
        return Err(Error::UploadMismatch {
            url: target,
            local: format!("{sha} ({total} bytes)"),
            remote: format!("{} ({} bytes)", answer.sha256, answer.bytes),
        });
    }
    writeln!(
        out,
        "uploaded {} as staged://{name} in {} ({}), sha256:{sha}",
        progress::bytes(total),
        progress::duration(start.elapsed()),
        progress::rate(total, start.elapsed()),
    )?;
    out.flush()?;
    Ok(sha)
}

fn import_state(i: &ImageImport) -> String {
    i.status
        .as_ref()
        .and_then(|s| s.state)
        .and_then(|s| serde_json::to_value(s).ok())
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| "Pending".into())
}

/// Follows ImageImport `name` until Succeeded (returned) or Failed (an error).
async fn follow_import(
    client: &Client,
    namespace: &str,
    name: &str,
    tty: bool,
    out: &mut dyn Write,
) -> Result<ImageImport, Error> {
    let api: Api<ImageImport> = Api::namespaced(client.clone(), namespace);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher(api, cfg).applied_objects().boxed();
    let mut board = Board::default();
    let mut last = String::new();
    let mut shown: Option<(u64, String)> = None;
    let start = Instant::now();
    // On a terminal the elapsed time ticks and a redraw the throttle
    // refused is made on the next tick.
    let mut tick = tokio::time::interval(progress::REDRAW * 5);
    loop {
        let next = tokio::select! {
            ev = events.try_next() => ev,
            _ = tick.tick() => {
                if let (true, Some((pct, line))) = (tty, &shown) {
                    let elapsed = progress::duration(start.elapsed());
                    board.draw(out, &[format!("{} {line} {elapsed}", progress::bar(*pct))], true)?;
                }
                continue;
            }
        };
        let Some(i) = next.map_err(|source| Error::Watch {
            kind: "imageimport",
            namespace: namespace.to_string(),
            name: name.to_string(),
            source: Box::new(source),
        })?
        else {
            break;
        };
        let state = import_state(&i);
        let p = i.status.as_ref().and_then(|s| s.progress.clone());
        let pct = p
            .as_ref()
            .map_or(0, |p| u64::try_from(p.percent).unwrap_or(0));
        let detail = p
            .as_ref()
            .map(|p| {
                let done = u64::try_from(p.bytes_done).unwrap_or(0);
                let total = u64::try_from(p.bytes_total).unwrap_or(0);
                format!(
                    " {} {pct}% ({} of {})",
                    p.phase.as_deref().unwrap_or("-"),
                    progress::bytes(done),
                    progress::bytes(total)
                )
            })
            .unwrap_or_default();
        let line = format!("imageimport {namespace}/{name}: {state}{detail}");
        let finished = matches!(
            i.status.as_ref().and_then(|s| s.state),
            Some(ImportState::Succeeded | ImportState::Failed)
        );
        if tty {
            let elapsed = progress::duration(start.elapsed());
            board.draw(
                out,
                &[format!("{} {line} {elapsed}", progress::bar(pct))],
                finished,
            )?;
            shown = Some((pct, line.clone()));
        } else if line != last {
            writeln!(out, "{line}")?;
            out.flush()?;
        }
        last = line;
        match i.status.as_ref().and_then(|s| s.state) {
            Some(ImportState::Succeeded) => {
                let msg = condition(
                    &i.status
                        .as_ref()
                        .map(|s| s.conditions.clone())
                        .unwrap_or_default(),
                    "Succeeded",
                );
                writeln!(
                    out,
                    "imageimport {namespace}/{name} Succeeded in {}{}",
                    progress::duration(start.elapsed()),
                    msg.map(|(_, m)| format!(": {m}")).unwrap_or_default()
                )?;
                return Ok(i);
            }
            Some(ImportState::Failed) => {
                let (reason, message) = condition(
                    &i.status
                        .as_ref()
                        .map(|s| s.conditions.clone())
                        .unwrap_or_default(),
                    "Succeeded",
                )
                .unwrap_or_else(|| ("-".into(), "-".into()));
                return Err(Error::ImportFailed {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    reason,
                    message,
                });
            }
            _ => {}
        }
    }
    Err(Error::WatchEnded {
        kind: "imageimport",
        namespace: namespace.to_string(),
        name: name.to_string(),
    })
}

/// The (reason, message) of condition `type_`.
fn condition(
    conds: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    type_: &str,
) -> Option<(String, String)> {
    conds
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.reason.clone(), c.message.clone()))
}

/// Follows Image `name` until Ready (printed) or Failed (an error).
async fn follow_image(
    client: &Client,
    namespace: &str,
    name: &str,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let api: Api<Image> = Api::namespaced(client.clone(), namespace);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher(api, cfg).applied_objects().boxed();
    while let Some(img) = events.try_next().await.map_err(|source| Error::Watch {
        kind: "image",
        namespace: namespace.to_string(),
        name: name.to_string(),
        source: Box::new(source),
    })? {
        let conds = img
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default();
        match img.status.as_ref().and_then(|s| s.state) {
            Some(ImageState::Ready) => {
                writeln!(
                    out,
                    "image {namespace}/{name} Ready ({} slots)",
                    img.spec.layout.slots.len()
                )?;
                out.flush()?;
                return Ok(());
            }
            Some(ImageState::Failed) => {
                let (reason, message) =
                    condition(&conds, "Ready").unwrap_or_else(|| ("-".into(), "-".into()));
                return Err(Error::ImageFailed {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    reason,
                    message,
                });
            }
            _ => {}
        }
    }
    Err(Error::WatchEnded {
        kind: "image",
        namespace: namespace.to_string(),
        name: name.to_string(),
    })
}

//! The HTTP front: path routing, the REST verbs over the store, watches, fault injection and
//! call recording around every API call.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode, header};
use serde_json::{Value, json};

use crate::Sim;
use crate::faults::{CallKey, FaultAction, Verb};
use crate::metadata::{self, Shape};
use crate::patch::JsonPatchError;
use crate::resources::{self, PODS, TYPES, TypeId};
use crate::selector::{FieldSelector, LabelSelector};
use crate::status::{self, ApiError};
use crate::store::{self, Deleted, EventKind, ListQuery, Propagation};
use crate::validate::{self, FieldValidation};

/// Largest request body accepted (as the real API server: 3 MiB).
const MAX_BODY: usize = 3 * 1024 * 1024;

pub(crate) fn router(sim: Arc<Sim>) -> Router {
    Router::new().fallback(handle).with_state(sim)
}

/// A parsed resource path.
#[derive(Debug, Clone)]
struct Target {
    t: TypeId,
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
    watch_path: bool,
}

fn json_response(code: u16, body: &Value) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut r = Response::new(Body::from(bytes));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

pub(crate) fn error_response(e: &ApiError) -> Response {
    json_response(e.code, &e.body())
}

fn query_map(q: Option<&str>) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        m.insert(decode(k), decode(v));
    }
    m
}

/// Percent-decodes a query component (`+` is a space).
pub(crate) fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or(())
                {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_target(path: &str) -> Option<Result<Target, ApiError>> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] if !rest.is_empty() => ("", *v, rest),
        ["apis", g, v, rest @ ..] if !rest.is_empty() => (*g, *v, rest),
        _ => return None,
    };
    let (watch_path, rest) = match rest {
        ["watch", r @ ..] => (true, r),
        r => (false, r),
    };
    let known = |plural: &str| resources::find(group, version, plural);
    let target = match rest {
        ["namespaces", ns, plural, tail @ ..] if known(plural).is_some() => {
            let t = known(plural)?;
            if !TYPES[t].namespaced {
                return Some(Err(ApiError::unknown_path()));
            }
            match tail {
                [] => Target {
                    t,
                    namespace: Some((*ns).into()),
                    name: None,
                    sub: None,
                    watch_path,
                },
                [name] => Target {
                    t,
                    namespace: Some((*ns).into()),
                    name: Some((*name).into()),
                    sub: None,
                    watch_path,
                },
                [name, sub] => Target {
                    t,
                    namespace: Some((*ns).into()),
                    name: Some((*name).into()),
                    sub: Some((*sub).into()),
                    watch_path,
                },
                _ => return Some(Err(ApiError::unknown_path())),
            }
        }
        [plural, tail @ ..] => {
            let Some(t) = known(plural) else {
                return Some(Err(ApiError::unknown_path()));
            };
            match tail {
                [] => Target {
                    t,
                    namespace: None,
                    name: None,
                    sub: None,
                    watch_path,
                },
                [name] if !TYPES[t].namespaced => Target {
                    t,
                    namespace: None,
                    name: Some((*name).into()),
                    sub: None,
                    watch_path,
                },
                [name, sub] if !TYPES[t].namespaced => Target {
                    t,
                    namespace: None,
                    name: Some((*name).into()),
                    sub: Some((*sub).into()),
                    watch_path,
                },
                _ => return Some(Err(ApiError::unknown_path())),
            }
        }
        _ => return Some(Err(ApiError::unknown_path())),
    };
    if let Some(sub) = &target.sub
        && sub != "status"
        && !(sub == "binding" && target.t == PODS)
    {
        return Some(Err(ApiError::unknown_path()));
    }
    Some(Ok(target))
}

async fn handle(State(sim): State<Arc<Sim>>, req: Request) -> Response {
    let path = req.uri().path().to_owned();
    if path.starts_with("/sim/") || path == "/sim" {
        return crate::control::handle(sim, req).await;
    }
    if let Some(r) = crate::discovery::handle(&sim, req.method(), &path, req.uri().query()) {
        return r;
    }
    if let Some((ns, name, sub)) = crate::console::stream_path(&path) {
        return crate::console::handle(sim, req, ns, name, sub).await;
    }
    if let Some((ns, name)) = crate::exec::exec_path(&path) {
        return crate::exec::handle(sim, req, ns, name).await;
    }
    let arrived = Instant::now();
    let identity = sim.tokens.identify(req.headers());
    let user = identity.as_ref().ok().cloned().flatten();
    let user = user.as_deref();
    let target = match parse_target(&path) {
        Some(Ok(t)) => t,
        Some(Err(e)) => return error_response(&e),
        None => return error_response(&ApiError::unknown_path()),
    };
    let query = query_map(req.uri().query());
    let verb = match (req.method().clone(), target.name.is_some()) {
        (Method::GET, _)
            if target.watch_path || query.get("watch").is_some_and(|w| w == "true" || w == "1") =>
        {
            Verb::Watch
        }
        (Method::GET, true) => Verb::Get,
        (Method::GET, false) => Verb::List,
        (Method::POST, false) => Verb::Create,
        (Method::POST, true) if target.sub.as_deref() == Some("binding") => Verb::Create,
        (Method::PUT, true) => Verb::Update,
        (Method::PATCH, true) => Verb::Patch,
        (Method::DELETE, true) => Verb::Delete,
        (Method::DELETE, false) => Verb::Deletecollection,
        _ => return error_response(&ApiError::method_not_allowed()),
    };
    let rt = &TYPES[target.t];
    let resource = match &target.sub {
        Some(s) => format!("{}/{s}", rt.plural),
        None => rt.plural.to_owned(),
    };
    let key = CallKey {
        verb,
        resource: &resource,
        group: Some(rt.group),
        namespace: target.namespace.as_deref(),
        name: target.name.as_deref(),
    };
    if let Err(e) = identity {
        sim.faults.record_as(arrived, &key, None, e.code);
        return error_response(&e);
    }
    // The cluster's own controllers (`crate::CONTROLLER_USER`) act as the control plane's
    // do: authorized as `system:masters`, beside the faults and latency injected for the
    // clients under test, and outside the call record that tells those clients' calls.
    let controller = user == Some(crate::CONTROLLER_USER);
    if !controller && let Err(e) = sim.rbac.authorize(user, &key) {
        sim.faults.record_as(arrived, &key, user, e.code);
        return error_response(&e);
    }
    let decision = if controller {
        crate::faults::Decision::default()
    } else {
        sim.faults.decide(&key)
    };
    if !decision.delay.is_zero() {
        tokio::select! {
            () = tokio::time::sleep(decision.delay) => {}
            () = sim.shutdown.cancelled() => {}
        }
    }
    match decision.outcome {
        Some(FaultAction::Fail { status, message }) => {
            let reason = match status {
                400 => "BadRequest",
                401 => "Unauthorized",
                403 => "Forbidden",
                404 => "NotFound",
                409 => "Conflict",
                410 => "Expired",
                422 => "Invalid",
                429 => "TooManyRequests",
                503 => "ServiceUnavailable",
                504 => "Timeout",
                _ => "InternalError",
            };
            let msg = message.unwrap_or_else(|| {
                format!(
                    "injected fault: {} {resource} answered {status}",
                    verb.as_str()
                )
            });
            let mut e = ApiError::new(status, reason, msg);
            if let Some(n) = &target.name {
                e = e.with_details(rt.group, rt.plural, n);
            }
            sim.faults.record_as(arrived, &key, user, status);
            let mut r = error_response(&e);
            if status == 429 || status == 503 {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            return r;
        }
        Some(FaultAction::Hang) => {
            sim.faults.record_as(arrived, &key, user, 0);
            sim.shutdown.cancelled().await;
            return error_response(&ApiError::new(
                503,
                "ServiceUnavailable",
                "kube-sim is shutting down",
            ));
        }
        Some(FaultAction::Delay { .. } | FaultAction::LoseReply) | None => {}
    }
    let lose_reply = decision.outcome == Some(FaultAction::LoseReply);
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let shape = Shape::negotiate(
        req.headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok()),
        verb == Verb::List,
    );
    let body = match axum::body::to_bytes(req.into_body(), MAX_BODY).await {
        Ok(b) => b,
        Err(_) => {
            let e = ApiError::new(
                413,
                "RequestEntityTooLarge",
                format!("Request entity too large: limit is {MAX_BODY}"),
            );
            sim.faults.record_as(arrived, &key, user, 413);
            return error_response(&e);
        }
    };
    // A create names its object in the body: the record keeps the requested name.
    let requested = (verb == Verb::Create)
        .then(|| serde_json::from_slice::<Value>(&body).ok())
        .flatten()
        .map(|v| v["metadata"]["name"].as_str().unwrap_or("").to_owned());
    let key = CallKey {
        name: requested.as_deref().or(key.name),
        ..key
    };
    let call = Call {
        sim: &sim,
        target: &target,
        query: &query,
        content_type: &content_type,
        body: &body,
        shape,
    };
    let result = match verb {
        Verb::Get => call.get(),
        Verb::List => call.list(),
        Verb::Watch => call.watch(),
        Verb::Create if target.sub.is_some() => call.bind(),
        Verb::Create => call.create(),
        Verb::Update => call.update(),
        Verb::Patch => call.patch(),
        Verb::Delete => call.delete(),
        Verb::Deletecollection => call.delete_collection(),
    };
    let response = match result {
        Ok(r) => r,
        Err(e) => error_response(&e),
    };
    if !controller {
        sim.faults
            .record_as(arrived, &key, user, response.status().as_u16());
    }
    if lose_reply {
        return lost_reply(response);
    }
    response
}

/// `response` with its body replaced by one that fails at once: the status line and headers
/// go out, then the connection breaks ([`FaultAction::LoseReply`]).
fn lost_reply(response: Response) -> Response {
    let (mut parts, _) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    let broken = futures::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::other("kube-sim lost the reply"))
    });
    Response::from_parts(parts, Body::from_stream(broken))
}

struct Call<'a> {
    sim: &'a Arc<Sim>,
    target: &'a Target,
    query: &'a BTreeMap<String, String>,
    content_type: &'a str,
    body: &'a Bytes,
    /// Full objects, or their metadata only (the `Accept` header of a get, list or watch).
    shape: Shape,
}

fn with_warnings(mut r: Response, warnings: &[String]) -> Response {
    for w in warnings {
        let text = format!("299 - {}", serde_json::to_string(w).unwrap_or_default());
        if let Ok(v) = HeaderValue::from_str(&text) {
            r.headers_mut().append("Warning", v);
        }
    }
    r
}

impl Call<'_> {
    fn rt(&self) -> &'static resources::ResourceType {
        &TYPES[self.target.t]
    }

    fn ns(&self) -> &str {
        self.target.namespace.as_deref().unwrap_or("")
    }

    fn name(&self) -> &str {
        self.target.name.as_deref().unwrap_or("")
    }

    fn field_validation(&self) -> Result<FieldValidation, ApiError> {
        FieldValidation::parse(self.query.get("fieldValidation").map(String::as_str))
    }

    fn dry_run(&self) -> bool {
        self.query.get("dryRun").is_some_and(|d| d == "All")
    }

    /// Decodes a JSON (or YAML) body into an object of this type.
    fn decode_body(&self) -> Result<Value, ApiError> {
        let rt = self.rt();
        let ct = self.content_type.split(';').next().unwrap_or("").trim();
        let parsed: Result<Value, String> = match ct {
            "" | "application/json" | "*/*" => {
                serde_json::from_slice(self.body).map_err(|e| e.to_string())
            }
            "application/yaml" | "application/apply-patch+yaml" => {
                serde_norway::from_slice(self.body).map_err(|e| e.to_string())
            }
            other => return Err(ApiError::unsupported_media_type(other)),
        };
        let v = parsed.map_err(|e| {
            ApiError::bad_request(format!(
                "the object provided is unrecognized (must be of type {}): couldn't get version/kind; json parse error: {e}",
                rt.kind
            ))
        })?;
        check_kind(rt, &v)?;
        Ok(v)
    }

    fn get(&self) -> Result<Response, ApiError> {
        let rt = self.rt();
        let obj = self
            .sim
            .store()
            .get(self.target.t, self.ns(), self.name())
            .ok_or_else(|| ApiError::not_found(rt.group, rt.plural, self.name()))?;
        if self.shape == Shape::Metadata {
            let mut r = json_response(200, &metadata::partial(&obj));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(metadata::content_type(false)),
            );
            return Ok(r);
        }
        Ok(json_response(200, &obj))
    }

    fn list_query(&self) -> Result<ListQuery, ApiError> {
        let labels =
            LabelSelector::parse(self.query.get("labelSelector").map_or("", String::as_str))
                .map_err(|e| ApiError::bad_request(format!("unable to parse requirement: {e}")))?;
        let fields = FieldSelector::parse(
            self.query.get("fieldSelector").map_or("", String::as_str),
            self.target.t == resources::PODS,
        )
        .map_err(ApiError::bad_request)?;
        let limit = match self.query.get("limit") {
            Some(l) if !l.is_empty() => l
                .parse::<i64>()
                .map_err(|_| ApiError::bad_request(format!("invalid limit {l:?}")))?
                .max(0) as usize,
            _ => 0,
        };
        Ok(ListQuery {
            namespace: self.target.namespace.clone(),
            labels,
            fields,
            limit,
            continue_token: self
                .query
                .get("continue")
                .filter(|c| !c.is_empty())
                .cloned(),
        })
    }

    fn list(&self) -> Result<Response, ApiError> {
        let rt = self.rt();
        let q = self.list_query()?;
        let page = self.sim.store().list(self.target.t, &q)?;
        let mut meta = serde_json::Map::new();
        meta.insert("resourceVersion".into(), Value::from(page.rv.to_string()));
        if let Some(c) = &page.continue_token {
            meta.insert("continue".into(), Value::from(c.clone()));
        }
        if let Some(r) = page.remaining {
            meta.insert("remainingItemCount".into(), Value::from(r));
        }
        let partial = self.shape == Shape::Metadata;
        let (kind, api_version) = if partial {
            (
                metadata::PARTIAL_LIST.to_owned(),
                metadata::API_VERSION.to_owned(),
            )
        } else {
            (format!("{}List", rt.kind), rt.api_version())
        };
        // Serialize item by item: no deep copy of large lists.
        let mut out = Vec::with_capacity(256 + page.items.len() * 512);
        out.extend_from_slice(b"{\"kind\":");
        out.extend_from_slice(serde_json::to_string(&kind).unwrap_or_default().as_bytes());
        out.extend_from_slice(b",\"apiVersion\":");
        out.extend_from_slice(
            serde_json::to_string(&api_version)
                .unwrap_or_default()
                .as_bytes(),
        );
        out.extend_from_slice(b",\"metadata\":");
        out.extend_from_slice(&serde_json::to_vec(&meta).unwrap_or_default());
        out.extend_from_slice(b",\"items\":[");
        for (i, item) in page.items.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            if partial {
                metadata::write_partial(&mut out, item);
            } else {
                let _ = serde_json::to_writer(&mut out, &**item);
            }
        }
        out.extend_from_slice(b"]}");
        let mut r = Response::new(Body::from(out));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(if partial {
                metadata::content_type(true)
            } else {
                "application/json"
            }),
        );
        Ok(r)
    }

    fn watch(&self) -> Result<Response, ApiError> {
        let rt = self.rt();
        let t = self.target.t;
        let mut q = self.list_query()?;
        q.limit = 0;
        q.continue_token = None;
        if let Some(name) = &self.target.name {
            q.fields
                .terms
                .push(("metadata.name".into(), name.clone(), true));
        }
        let timeout = self
            .query
            .get("timeoutSeconds")
            .and_then(|s| s.parse::<u64>().ok())
            .map_or(Duration::from_secs(1800), Duration::from_secs);
        let bookmarks = self
            .query
            .get("allowWatchBookmarks")
            .is_some_and(|b| b == "true");
        let initial_events = self
            .query
            .get("sendInitialEvents")
            .is_some_and(|b| b == "true");
        let rv_param = self
            .query
            .get("resourceVersion")
            .cloned()
            .unwrap_or_default();
        let (backlog, mut rx, start_rv) = {
            let store = self.sim.store();
            let rx = store.subscribe();
            let cur = store.resource_version();
            let backlog: Vec<(EventKind, Arc<Value>)> =
                if rv_param.is_empty() || rv_param == "0" || initial_events {
                    store
                        .select(t, &q)
                        .into_iter()
                        .map(|o| (EventKind::Added, o))
                        .collect()
                } else {
                    let rv: u64 = rv_param.parse().map_err(|_| {
                        ApiError::bad_request(format!("invalid resource version: {rv_param}"))
                    })?;
                    match store.history_since(t, rv) {
                        Ok(evs) => evs.iter().filter_map(|e| filter_event(e, &q)).collect(),
                        Err(gone) => {
                            // As the watch cache answers: a 200 whose only event is the error.
                            let e =
                                ApiError::gone(format!("too old resource version: {rv} ({gone})"));
                            let line = json!({"type": "ERROR", "object": e.body()});
                            let mut body = serde_json::to_vec(&line).unwrap_or_default();
                            body.push(b'\n');
                            let mut r = Response::new(Body::from(body));
                            r.headers_mut().insert(
                                header::CONTENT_TYPE,
                                HeaderValue::from_static("application/json"),
                            );
                            return Ok(r);
                        }
                    }
                };
            (backlog, rx, cur)
        };
        let (tx, out_rx) = tokio::sync::mpsc::channel::<Bytes>(256);
        let shutdown = self.sim.shutdown.clone();
        let kind = rt.kind;
        let api_version = rt.api_version();
        let bookmark_every = self.sim.config.timings.bookmark;
        let partial = self.shape == Shape::Metadata;
        tokio::spawn(async move {
            let line = |ty: &str, obj: &Value| {
                let event = if partial && ty != "BOOKMARK" {
                    json!({"type": ty, "object": metadata::partial(obj)})
                } else {
                    json!({"type": ty, "object": obj})
                };
                let mut v = serde_json::to_vec(&event).unwrap_or_default();
                v.push(b'\n');
                Bytes::from(v)
            };
            let bookmark = |rv: u64, end: bool| {
                let mut meta = json!({"resourceVersion": rv.to_string()});
                if end {
                    meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
                }
                if partial {
                    json!({"kind": metadata::PARTIAL, "apiVersion": metadata::API_VERSION, "metadata": meta})
                } else {
                    json!({"kind": kind, "apiVersion": api_version, "metadata": meta})
                }
            };
            let mut last_rv = start_rv;
            for (k, obj) in backlog {
                if let Some(rv) =
                    store::meta_str(&obj, "resourceVersion").and_then(|r| r.parse().ok())
                {
                    last_rv = last_rv.max(rv);
                }
                if tx.send(line(k.as_str(), &obj)).await.is_err() {
                    return;
                }
            }
            if initial_events
                && bookmarks
                && tx
                    .send(line("BOOKMARK", &bookmark(last_rv, true)))
                    .await
                    .is_err()
            {
                return;
            }
            let deadline = tokio::time::sleep(timeout);
            tokio::pin!(deadline);
            let mut tick = tokio::time::interval(bookmark_every);
            tick.tick().await;
            loop {
                tokio::select! {
                    () = &mut deadline => return,
                    () = shutdown.cancelled() => return,
                    () = tx.closed() => return,
                    _ = tick.tick(), if bookmarks => {
                        if tx.send(line("BOOKMARK", &bookmark(last_rv, false))).await.is_err() {
                            return;
                        }
                    }
                    ev = rx.recv() => {
                        let ev = match ev {
                            Ok(ev) => ev,
                            // Too slow to keep up: end the watch, the client re-watches.
                            Err(_) => return,
                        };
                        if ev.rv <= start_rv {
                            continue;
                        }
                        last_rv = ev.rv;
                        if ev.type_id != t {
                            continue;
                        }
                        if let Some((k, obj)) = filter_event(&ev, &q)
                            && tx.send(line(k.as_str(), &obj)).await.is_err()
                        {
                            return;
                        }
                    }
                }
            }
        });
        let stream = futures::stream::unfold(out_rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
        });
        let mut r = Response::new(Body::from_stream(stream));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r.headers_mut().insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        Ok(r)
    }

    /// `POST pods/{name}/binding`, the scheduler's decision: the pod's `spec.nodeName` is
    /// set, once (a bound pod is `409`), and its `PodScheduled` condition is `True`, as the
    /// real API server's binding storage does.
    fn bind(&self) -> Result<Response, ApiError> {
        let binding: Value = serde_json::from_slice(self.body)
            .map_err(|e| ApiError::bad_request(format!("invalid Binding: {e}")))?;
        let node = binding["target"]["name"]
            .as_str()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                ApiError::new(
                    422,
                    "Invalid",
                    format!(
                        "Binding.core \"{}\" is invalid: target.name: Required value",
                        self.name()
                    ),
                )
            })?
            .to_owned();
        if binding["target"]["kind"]
            .as_str()
            .is_some_and(|k| k != "Node")
        {
            return Err(ApiError::new(
                422,
                "Invalid",
                format!(
                    "Binding.core \"{}\" is invalid: target.kind: Unsupported value",
                    self.name()
                ),
            ));
        }
        let name = self.name().to_owned();
        self.sim
            .store()
            .update_with(PODS, self.ns(), self.name(), |cur| {
                if let Some(on) = cur["spec"]["nodeName"].as_str().filter(|n| !n.is_empty()) {
                    return Err(ApiError::conflict(
                        "",
                        "pods/binding",
                        &name,
                        &format!("pod {name} is already assigned to node \"{on}\""),
                    ));
                }
                if store::is_deleting(cur) {
                    return Err(ApiError::conflict(
                        "",
                        "pods/binding",
                        &name,
                        &format!("pod {name} is being deleted, cannot be assigned to a host"),
                    ));
                }
                let mut next = cur.clone();
                next["spec"]["nodeName"] = Value::from(node.as_str());
                next["metadata"]["resourceVersion"] = Value::from("");
                let scheduled = json!({
                    "type": "PodScheduled",
                    "status": "True",
                    "lastProbeTime": null,
                    "lastTransitionTime": store::now_rfc3339(),
                });
                if !next["status"].is_object() {
                    next["status"] = json!({});
                }
                match next["status"]["conditions"].as_array_mut() {
                    Some(list) => {
                        list.retain(|c| c["type"] != "PodScheduled");
                        list.push(scheduled);
                    }
                    None => next["status"]["conditions"] = json!([scheduled]),
                }
                Ok(next)
            })?;
        Ok(json_response(
            201,
            &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
        ))
    }

    fn create(&self) -> Result<Response, ApiError> {
        let rt = self.rt();
        let obj = self.decode_body()?;
        if let Some(ns) = store::meta_str(&obj, "namespace")
            && rt.namespaced
            && !ns.is_empty()
            && ns != self.ns()
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        if rt.namespaced && self.target.namespace.is_none() {
            return Err(ApiError::method_not_allowed());
        }
        let (obj, warnings) = admit_new(
            self.sim,
            self.target.t,
            self.ns(),
            obj,
            self.field_validation()?,
        )?;
        if self.dry_run() {
            let obj = self
                .sim
                .store()
                .dry_run_create(self.target.t, self.ns(), obj)?;
            return Ok(with_warnings(json_response(201, &obj), &warnings));
        }
        let stored = self.sim.store().create(self.target.t, self.ns(), obj)?;
        Ok(with_warnings(json_response(201, &stored), &warnings))
    }

    fn update(&self) -> Result<Response, ApiError> {
        let rt = self.rt();
        let mut body = self.decode_body()?;
        let mode = self.field_validation()?;
        let status_only = self.target.sub.is_some();
        let mut warnings = Vec::new();
        let stored = self.sim.store().update_or_dry_run(
            self.target.t,
            self.ns(),
            self.name(),
            self.dry_run(),
            |cur| {
                if status_only {
                    let mut next = cur.clone();
                    next["status"] = body.get("status").cloned().unwrap_or(Value::Null);
                    if let Some(rv) = store::meta_str(&body, "resourceVersion") {
                        next["metadata"]["resourceVersion"] = Value::from(rv);
                    } else {
                        next["metadata"]["resourceVersion"] = Value::from("");
                    }
                    return Ok(next);
                }
                if rt.status_subresource {
                    body["status"] = cur.get("status").cloned().unwrap_or(Value::Null);
                    if body["status"].is_null()
                        && let Some(o) = body.as_object_mut()
                    {
                        o.remove("status");
                    }
                }
                let checked = admit_existing(rt, self.name(), body.clone(), mode)?;
                warnings = checked.1;
                Ok(checked.0)
            },
        )?;
        Ok(with_warnings(json_response(200, &stored), &warnings))
    }

    fn patch(&self) -> Result<Response, ApiError> {
        let rt = self.rt();
        let ct = self
            .content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_owned();
        let mode = self.field_validation()?;
        let status_only = self.target.sub.is_some();
        let patch_body: Value = match ct.as_str() {
            "application/apply-patch+yaml" | "application/apply-patch+json" => {
                serde_norway::from_slice(self.body)
                    .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?
            }
            "application/merge-patch+json"
            | "application/strategic-merge-patch+json"
            | "application/json-patch+json" => serde_json::from_slice(self.body)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?,
            other => return Err(ApiError::unsupported_media_type(other)),
        };
        let apply = ct.starts_with("application/apply-patch");
        if apply {
            if self.query.get("fieldManager").is_none_or(String::is_empty) {
                return Err(ApiError::bad_request(
                    "PATCH, fieldManager is required for apply requests",
                ));
            }
            check_kind(rt, &patch_body)?;
            let exists = self
                .sim
                .store()
                .get(self.target.t, self.ns(), self.name())
                .is_some();
            if !exists && !status_only {
                let mut obj = patch_body.clone();
                obj["metadata"]["name"] = Value::from(self.name());
                let (obj, warnings) = admit_new(self.sim, self.target.t, self.ns(), obj, mode)?;
                if self.dry_run() {
                    let obj = self
                        .sim
                        .store()
                        .dry_run_create(self.target.t, self.ns(), obj)?;
                    return Ok(with_warnings(json_response(201, &obj), &warnings));
                }
                let stored = self.sim.store().create(self.target.t, self.ns(), obj)?;
                return Ok(with_warnings(json_response(201, &stored), &warnings));
            }
        }
        let mut warnings = Vec::new();
        let dry = self.dry_run();
        let mut store = self.sim.store();
        let compute = |cur: &Value| -> Result<(Value, Vec<String>), ApiError> {
            let mut next = cur.clone();
            match ct.as_str() {
                "application/json-patch+json" => crate::patch::json_patch(&mut next, &patch_body)
                    .map_err(|e| match e {
                    JsonPatchError::Malformed(why) => ApiError::bad_request(why),
                    JsonPatchError::Failed(why) => ApiError::new(422, "Invalid", why),
                })?,
                "application/merge-patch+json" => json_patch::merge(&mut next, &patch_body),
                _ => crate::patch::strategic(&mut next, &patch_body),
            }
            if status_only {
                let mut only = cur.clone();
                only["status"] = next.get("status").cloned().unwrap_or(Value::Null);
                only["metadata"]["resourceVersion"] = Value::from("");
                return Ok((only, Vec::new()));
            }
            if rt.status_subresource {
                match cur.get("status") {
                    Some(s) => next["status"] = s.clone(),
                    None => {
                        if let Some(o) = next.as_object_mut() {
                            o.remove("status");
                        }
                    }
                }
            }
            // A patch applies to the current version unless it names one itself.
            if patch_body["metadata"]["resourceVersion"].is_null() {
                next["metadata"]["resourceVersion"] = Value::from("");
            }
            admit_existing(rt, self.name(), next, mode)
        };
        // A dry run goes through every check of the real update (immutable fields, conflicts,
        // finalizers, quota) and stores nothing.
        let stored =
            store.update_or_dry_run(self.target.t, self.ns(), self.name(), dry, |cur| {
                let (next, w) = compute(cur)?;
                warnings = w;
                Ok(next)
            })?;
        Ok(with_warnings(json_response(200, &stored), &warnings))
    }

    fn delete_options(&self) -> Result<DeleteOptions, ApiError> {
        let opts: Value = if self.body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(self.body)
                .map_err(|e| ApiError::bad_request(format!("invalid DeleteOptions: {e}")))?
        };
        let policy = self
            .query
            .get("propagationPolicy")
            .cloned()
            .or_else(|| opts["propagationPolicy"].as_str().map(str::to_owned))
            .or_else(|| match opts["orphanDependents"].as_bool() {
                Some(true) => Some("Orphan".into()),
                _ => None,
            });
        let propagation = match policy.as_deref() {
            None | Some("Background") => Propagation::Background,
            Some("Foreground") => Propagation::Foreground,
            Some("Orphan") => Propagation::Orphan,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "propagationPolicy: Unsupported value: {other:?}: supported values: \"Foreground\", \"Background\", \"Orphan\""
                )));
            }
        };
        let uid = opts["preconditions"]["uid"].as_str().map(str::to_owned);
        let rv = opts["preconditions"]["resourceVersion"]
            .as_str()
            .map(str::to_owned);
        let grace = match self.query.get("gracePeriodSeconds") {
            Some(g) => Some(g.parse::<i64>().map_err(|_| {
                ApiError::bad_request(format!("gracePeriodSeconds: invalid value {g:?}"))
            })?),
            None => opts["gracePeriodSeconds"].as_i64(),
        };
        Ok(DeleteOptions {
            propagation,
            uid,
            rv,
            grace,
        })
    }

    fn delete(&self) -> Result<Response, ApiError> {
        let rt = self.rt();
        let DeleteOptions {
            propagation,
            uid,
            rv,
            grace,
        } = self.delete_options()?;
        if self.dry_run() {
            let obj = self
                .sim
                .store()
                .get(self.target.t, self.ns(), self.name())
                .ok_or_else(|| ApiError::not_found(rt.group, rt.plural, self.name()))?;
            return Ok(json_response(200, &obj));
        }
        let out = self.sim.store().delete_with_grace(
            self.target.t,
            self.ns(),
            self.name(),
            propagation,
            (uid.as_deref(), rv.as_deref()),
            grace,
        )?;
        Ok(match out {
            Deleted::Gone(obj) => {
                if rt.group.is_empty() {
                    json_response(
                        200,
                        &status::deleted(
                            rt.group,
                            rt.plural,
                            self.name(),
                            store::meta_str(&obj, "uid").unwrap_or_default(),
                        ),
                    )
                } else {
                    json_response(200, &obj)
                }
            }
            Deleted::Pending(obj) => json_response(200, &obj),
        })
    }

    fn delete_collection(&self) -> Result<Response, ApiError> {
        let rt = self.rt();
        let DeleteOptions {
            propagation, grace, ..
        } = self.delete_options()?;
        let mut q = self.list_query()?;
        q.limit = 0;
        q.continue_token = None;
        let mut store = self.sim.store();
        let items = store.select(self.target.t, &q);
        let mut out = Vec::new();
        for item in items {
            let ns = store::meta_str(&item, "namespace")
                .unwrap_or_default()
                .to_owned();
            let name = store::meta_str(&item, "name")
                .unwrap_or_default()
                .to_owned();
            match store.delete_with_grace(
                self.target.t,
                &ns,
                &name,
                propagation,
                (None, None),
                grace,
            ) {
                Ok(Deleted::Gone(o) | Deleted::Pending(o)) => out.push((*o).clone()),
                Err(_) => {}
            }
        }
        Ok(json_response(
            200,
            &json!({"kind": format!("{}List", rt.kind), "apiVersion": rt.api_version(), "metadata": {"resourceVersion": store.resource_version().to_string()}, "items": out}),
        ))
    }
}

/// What a delete asks besides its target.
struct DeleteOptions {
    propagation: Propagation,
    /// `preconditions.uid`.
    uid: Option<String>,
    /// `preconditions.resourceVersion`.
    rv: Option<String>,
    /// `gracePeriodSeconds` (query or body).
    grace: Option<i64>,
}

fn filter_event(e: &store::Event, q: &ListQuery) -> Option<(EventKind, Arc<Value>)> {
    let in_ns = |o: &Value| {
        q.namespace
            .as_deref()
            .is_none_or(|ns| store::meta_str(o, "namespace") == Some(ns))
    };
    if !in_ns(&e.object) {
        return None;
    }
    let now = q.labels.matches(&e.object) && q.fields.matches(&e.object);
    match e.kind {
        EventKind::Modified => {
            let before = e
                .prev
                .as_ref()
                .is_some_and(|p| q.labels.matches(p) && q.fields.matches(p));
            match (before, now) {
                (true, true) => Some((EventKind::Modified, e.object.clone())),
                (false, true) => Some((EventKind::Added, e.object.clone())),
                (true, false) => Some((EventKind::Deleted, e.object.clone())),
                (false, false) => None,
            }
        }
        k => now.then(|| (k, e.object.clone())),
    }
}

fn check_kind(rt: &resources::ResourceType, v: &Value) -> Result<(), ApiError> {
    if !v.is_object() {
        return Err(ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): couldn't get version/kind; json parse error: expected an object",
            rt.kind
        )));
    }
    let kind = v.get("kind").and_then(Value::as_str).unwrap_or("");
    let api_version = v.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if kind.is_empty() {
        return Err(ApiError::bad_request(format!(
            "Object 'Kind' is missing in '{}'",
            truncate(&v.to_string(), 200)
        )));
    }
    if kind != rt.kind {
        return Err(ApiError::bad_request(format!(
            "{} in version \"{}\" cannot be handled as a {}: the kind in the body is {kind:?}, this endpoint serves {:?}",
            rt.kind, rt.version, rt.kind, rt.kind
        )));
    }
    if !api_version.is_empty() && api_version != rt.api_version() {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({api_version}) does not match the expected API version ({})",
            rt.api_version()
        )));
    }
    Ok(())
}

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        s.to_owned()
    } else {
        let mut end = n;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &s[..end])
    }
}

const GENERATE_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";

/// The part of a `generateName` that a generated name keeps: as apiserver's
/// `SimpleNameGenerator`, at most 58 characters, so that with its 5 random ones the name is
/// at most 63 (a launcher pod of a long VMI name gets a name that is a valid label).
fn generated_name_base(prefix: &str) -> &str {
    const MAX_BASE: usize = 63 - 5;
    match prefix.char_indices().nth(MAX_BASE) {
        Some((cut, _)) => &prefix[..cut],
        None => prefix,
    }
}

/// Resolves the name (generateName), validates, and returns the object to store.
fn admit_new(
    sim: &Sim,
    t: TypeId,
    ns: &str,
    mut obj: Value,
    mode: FieldValidation,
) -> Result<(Value, Vec<String>), ApiError> {
    let rt = &TYPES[t];
    let mut name = store::meta_str(&obj, "name").unwrap_or_default().to_owned();
    if name.is_empty() {
        let Some(prefix) = store::meta_str(&obj, "generateName").map(str::to_owned) else {
            return Err(ApiError::invalid(
                rt.group,
                &rt.qualified_kind(),
                rt.plural,
                "",
                vec![(
                    "FieldValueRequired".into(),
                    "metadata.name: Required value: name or generateName is required".into(),
                    "metadata.name".into(),
                )],
            ));
        };
        let store = sim.store();
        for _ in 0..16 {
            let bytes = *uuid::Uuid::new_v4().as_bytes();
            let suffix: String = bytes[..5]
                .iter()
                .map(|b| GENERATE_ALPHABET[usize::from(*b) % GENERATE_ALPHABET.len()] as char)
                .collect();
            let candidate = format!("{}{suffix}", generated_name_base(&prefix));
            if store.get(t, ns, &candidate).is_none() {
                name = candidate;
                break;
            }
        }
        obj["metadata"]["name"] = Value::from(name.clone());
    }
    if obj.get("metadata").is_none_or(|m| !m.is_object()) {
        obj["metadata"] = json!({"name": name});
    }
    let meta_causes = validate::metadata_causes(rt, &obj["metadata"], &name);
    let checked = validate::check_object(rt, obj, &name, mode)?;
    if !meta_causes.is_empty() {
        return Err(ApiError::invalid(
            rt.group,
            &rt.qualified_kind(),
            rt.plural,
            &name,
            meta_causes,
        ));
    }
    Ok((checked.object, checked.warnings))
}

fn admit_existing(
    rt: &resources::ResourceType,
    name: &str,
    obj: Value,
    mode: FieldValidation,
) -> Result<(Value, Vec<String>), ApiError> {
    check_kind(rt, &obj)?;
    let meta_causes = validate::metadata_causes(rt, &obj["metadata"], name);
    let checked = validate::check_object(rt, obj, name, mode)?;
    if !meta_causes.is_empty() {
        return Err(ApiError::invalid(
            rt.group,
            &rt.qualified_kind(),
            rt.plural,
            name,
            meta_causes,
        ));
    }
    Ok((checked.object, checked.warnings))
}

/// Creates an object given in full (in-process API), validated like a POST with
/// `fieldValidation=Strict`.
pub(crate) fn create_direct(sim: &Sim, obj: Value) -> Result<Value, ApiError> {
    create_direct_at(sim, obj, None)
}

/// [`create_direct`] with an explicit `creationTimestamp` (`None`: now).
pub(crate) fn create_direct_at(
    sim: &Sim,
    obj: Value,
    created: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<Value, ApiError> {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default();
    let kind = obj["kind"].as_str().unwrap_or_default();
    let t = TYPES
        .iter()
        .position(|t| t.kind == kind && t.api_version() == api_version)
        .ok_or_else(|| ApiError::bad_request(format!("no resource serves {api_version} {kind}")))?;
    let ns = if TYPES[t].namespaced {
        store::meta_str(&obj, "namespace")
            .unwrap_or("default")
            .to_owned()
    } else {
        String::new()
    };
    let (obj, _) = admit_new(sim, t, &ns, obj, FieldValidation::Strict)?;
    let stored = match created {
        Some(at) => sim.store().create_backdated(t, &ns, obj, at)?,
        None => sim.store().create(t, &ns, obj)?,
    };
    Ok((*stored).clone())
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error_response(&self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_name_keeps_at_most_58_characters_of_its_prefix() {
        assert_eq!(
            generated_name_base("virt-launcher-lab-1-"),
            "virt-launcher-lab-1-"
        );
        let long = format!("virt-launcher-tt-{}-control-plane-", "c".repeat(32));
        assert_eq!(generated_name_base(&long).len(), 58);
        assert!(long.starts_with(generated_name_base(&long)));
    }

    #[test]
    fn paths_parse_into_targets() {
        let t = parse_target("/apis/kubevirt.io/v1/namespaces/ns/virtualmachines/vm1")
            .unwrap()
            .unwrap();
        assert_eq!(
            (t.t, t.namespace.as_deref(), t.name.as_deref()),
            (resources::VMS, Some("ns"), Some("vm1"))
        );
        let t = parse_target("/api/v1/namespaces/ns").unwrap().unwrap();
        assert_eq!(
            (t.t, t.name.as_deref()),
            (resources::NAMESPACES, Some("ns"))
        );
        let t = parse_target("/api/v1/pods").unwrap().unwrap();
        assert_eq!((t.t, t.namespace), (resources::PODS, None));
        let t = parse_target("/api/v1/watch/namespaces/ns/pods")
            .unwrap()
            .unwrap();
        assert!(t.watch_path);
        assert!(
            parse_target("/api/v1/namespaces/ns/widgets")
                .unwrap()
                .is_err()
        );
        assert!(
            parse_target("/apis/kubevirt.io/v1/namespaces/ns/virtualmachines/a/b/c")
                .unwrap()
                .is_err()
        );
        assert!(parse_target("/version").is_none());
        assert_eq!(decode("a%3Db%2Cc+d"), "a=b,c d");
    }
}

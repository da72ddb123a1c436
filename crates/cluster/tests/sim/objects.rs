//! Creating, reading, listing and deleting objects; owner references; quota; golden facts —
//! on kube-sim and on the real control plane (KubeVirt's finalizers, the garbage collector and
//! the quota controller really at work there).

use std::collections::BTreeSet;

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::wait::{await_condition, conditions};
use serde_json::json;
use ttlab_cluster::{
    CapacityCluster as _, ClusterError, ClusterSettings, Deleted, GoldenRef, Kind, Lookup,
    Propagation, ProvisionCluster as _, ReaperCluster as _,
};
use ttlab_kube_sim::Verb;
use ttlab_model::labels::{self, ObjectLabels};

use crate::common::{self, Harness, retry_quota, within};

on_both_backends!(a_vm_is_created_found_by_label_and_deleted_once);
async fn a_vm_is_created_found_by_label_and_deleted_once(h: &Harness) {
    let l = common::labels("dev");
    let created = h.cluster.create_vm(common::vm("lab-a", &l)).await.unwrap();
    assert_eq!(created.kind, Kind::VirtualMachine);
    assert_eq!(created.name, "lab-a");
    assert!(!created.uid.is_empty());

    let got = h
        .cluster
        .get(Kind::VirtualMachine, "lab-a")
        .await
        .unwrap()
        .expect("VM exists");
    assert_eq!(got.uid, created.uid);
    assert_eq!(ObjectLabels::from_map(&got.labels), Some(l.clone()));
    assert!(got.created_at.is_some());
    assert!(!got.deleting);

    let mine = h
        .cluster
        .list_all(
            Kind::VirtualMachine,
            &labels::session_selector(&l.env, l.session),
        )
        .await
        .unwrap();
    assert_eq!(
        mine.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(),
        ["lab-a"]
    );
    let prod = h
        .cluster
        .list_all(
            Kind::VirtualMachine,
            &labels::env_selector(&"prod".parse().unwrap()),
        )
        .await
        .unwrap();
    assert!(
        prod.is_empty(),
        "another environment's selector sees nothing: {prod:?}"
    );

    // Creating it again for the same session (a create whose reply was lost) adopts it,
    // never updates it; another session's create under the name is a conflict that says so.
    let again = h.cluster.create_vm(common::vm("lab-a", &l)).await.unwrap();
    assert_eq!(again, created, "adopted as it is");
    let other = common::labels("dev");
    let theirs = h
        .cluster
        .create_vm(common::vm("lab-a", &other))
        .await
        .unwrap_err();
    match &theirs {
        ClusterError::Conflict { message } => assert!(
            message.contains("is not this session's") && message.contains(&l.session.to_string()),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    let prod = h
        .cluster
        .create_vm(common::vm("lab-a", &common::labels("prod")))
        .await
        .unwrap_err();
    assert!(matches!(prod, ClusterError::Conflict { .. }), "{prod:?}");

    // KubeVirt's finalizer holds a deleted VM until its VMI is gone: the deletion is
    // accepted, and the VM is left in place for now.
    held_by_kubevirt(h, "lab-a").await;
    let first = h
        .cluster
        .delete(Kind::VirtualMachine, "lab-a", Propagation::Background)
        .await
        .unwrap();
    assert_eq!(first, Deleted::Deleted);
    // Deleting it again while it is still terminating is accepted again; once it is gone,
    // a delete finds nothing, which is success too.
    let vm_api: Api<DynamicObject> = Api::namespaced_with(
        h.cluster.client().clone(),
        &h.ns,
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
            "virtualmachines",
        ),
    );
    within(
        h.settle_secs(),
        await_condition(vm_api, "lab-a", conditions::is_deleted(&created.uid)),
    )
    .await
    .unwrap();
    assert_eq!(
        h.cluster.get(Kind::VirtualMachine, "lab-a").await.unwrap(),
        None
    );
    let second = h
        .cluster
        .delete(Kind::VirtualMachine, "lab-a", Propagation::Background)
        .await
        .unwrap();
    assert_eq!(second, Deleted::AlreadyGone);
}

/// Waits until KubeVirt has put its finalizer on the VM `name`.
async fn held_by_kubevirt(h: &Harness, name: &str) {
    let vms: Api<DynamicObject> = Api::namespaced_with(
        h.cluster.client().clone(),
        &h.ns,
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
            "virtualmachines",
        ),
    );
    within(
        h.settle_secs(),
        await_condition(vms, name, |vm: Option<&DynamicObject>| {
            vm.and_then(|vm| vm.metadata.finalizers.as_ref())
                .is_some_and(|f| {
                    f.iter()
                        .any(|f| f == "kubevirt.io/virtualMachineControllerFinalize")
                })
        }),
    )
    .await
    .unwrap();
}

on_both_backends!(a_delete_says_whether_the_object_went_at_once);
async fn a_delete_says_whether_the_object_went_at_once(h: &Harness) {
    // Nothing holds a Secret: the API server removes it at once, and its answer says so (a
    // Status for a core kind), so a teardown need not look for it again.
    let l = common::labels("dev");
    h.cluster
        .create_secret(common::secret("gone-at-once", &l))
        .await
        .unwrap();
    assert_eq!(
        h.cluster
            .delete(Kind::Secret, "gone-at-once", Propagation::Background)
            .await
            .unwrap(),
        Deleted::Removed
    );
    assert_eq!(
        h.cluster.find(Kind::Secret, "gone-at-once").await.unwrap(),
        None
    );

    // A custom resource that nothing holds is answered with the object as it was, unmarked:
    // removed at once too. KubeVirt is paused, so no finalizer is put on the VM.
    h.pause_kubevirt();
    h.cluster.create_vm(common::vm("unheld", &l)).await.unwrap();
    assert_eq!(
        h.cluster
            .delete(Kind::VirtualMachine, "unheld", Propagation::Background)
            .await
            .unwrap(),
        Deleted::Removed
    );
    assert_eq!(
        h.cluster.get(Kind::VirtualMachine, "unheld").await.unwrap(),
        None
    );
}

on_both_backends!(deleting_what_never_existed_is_success);
async fn deleting_what_never_existed_is_success(h: &Harness) {
    for kind in Kind::ALL {
        let outcome = h
            .cluster
            .delete(kind, "never-was", Propagation::Foreground)
            .await
            .unwrap();
        assert_eq!(outcome, Deleted::AlreadyGone, "{kind}");
        assert_eq!(
            h.cluster.get(kind, "never-was").await.unwrap(),
            None,
            "{kind}"
        );
    }
}

on_both_backends!(
    every_page_of_2500_objects_is_read_exactly_once,
    ClusterSettings {
        page_size: 100,
        ..ClusterSettings::default()
    }
);
async fn every_page_of_2500_objects_is_read_exactly_once(h: &Harness) {
    let dev = common::labels("dev");
    let prod = common::labels("prod");
    // 2,500 of ours through the real API (16 at a time), and 30 of another environment.
    let names: Vec<(String, ObjectLabels)> = (0..2500)
        .map(|i| (format!("s-{i:04}"), dev.clone()))
        .chain((0..30).map(|i| (format!("p-{i:02}"), prod.clone())))
        .collect();
    let started = std::time::Instant::now();
    within(
        120,
        stream::iter(names)
            .map(|(name, l)| {
                let cluster = &h.cluster;
                async move { cluster.create_secret(common::secret(&name, &l)).await }
            })
            .buffer_unordered(16)
            .try_collect::<Vec<_>>(),
    )
    .await
    .unwrap();

    let created_in = started.elapsed();
    let selector = labels::env_selector(&dev.env);
    let started = std::time::Instant::now();
    let mut token = None;
    let mut pages = 0;
    let mut seen = BTreeSet::new();
    loop {
        let page = h
            .cluster
            .list_page(Kind::Secret, &selector, token)
            .await
            .unwrap();
        pages += 1;
        assert!(page.items.len() <= 100, "page of {}", page.items.len());
        for item in page.items {
            assert!(seen.insert(item.name.clone()), "{} seen twice", item.name);
            assert_eq!(item.labels[labels::ENV], "dev");
        }
        match page.continue_token {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    assert_eq!(seen.len(), 2500);
    assert_eq!(pages, 25);
    eprintln!(
        "2,530 Secrets created in {created_in:?} (16 in flight); 2,500 listed in {pages} pages in {:?}",
        started.elapsed()
    );

    let all = h.cluster.list_all(Kind::Secret, &selector).await.unwrap();
    assert_eq!(all.len(), 2500);
    let everything = h
        .cluster
        .list_all(Kind::Secret, &labels::managed_selector())
        .await
        .unwrap();
    assert_eq!(everything.len(), 2530);
}

on_both_backends!(live_vms_are_counted_across_environments_but_not_foreign_ones);
async fn live_vms_are_counted_across_environments_but_not_foreign_ones(h: &Harness) {
    // Without KubeVirt no finalizer holds a deleted VM: it is gone at once.
    h.pause_kubevirt();
    for (name, env) in [("d-1", "dev"), ("d-2", "dev"), ("p-1", "prod")] {
        h.cluster
            .create_vm(common::vm(name, &common::labels(env)))
            .await
            .unwrap();
    }
    // A VM someone else made, without ttlab's labels.
    let mut foreign = common::vm("foreign", &common::labels("dev"));
    foreign["metadata"]["labels"] = json!({"app": "other"});
    h.cluster.create_vm(foreign).await.unwrap();

    assert_eq!(h.cluster.count_live_vms().await.unwrap(), 3);
    h.cluster
        .delete(Kind::VirtualMachine, "d-1", Propagation::Background)
        .await
        .unwrap();
    assert_eq!(h.cluster.count_live_vms().await.unwrap(), 2);
}

on_both_backends!(deleting_the_vm_takes_its_secret_along);
async fn deleting_the_vm_takes_its_secret_along(h: &Harness) {
    let mark = h.mark();
    let l = common::labels("dev");
    let vm = h
        .cluster
        .create_vm(common::vm("lab-owner", &l))
        .await
        .unwrap();
    let mut s = common::secret("lab-owner-cloudinit", &l);
    s.metadata.owner_references = Some(vec![vm.owner_reference()]);
    let secret = h.cluster.create_secret(s).await.unwrap();
    let got = h
        .cluster
        .get(Kind::Secret, &secret.name)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.owner_uids, vec![vm.uid.clone()]);

    h.cluster
        .delete(Kind::VirtualMachine, &vm.name, Propagation::Background)
        .await
        .unwrap();
    // Watch (with kube-rs' own helper) until the garbage collector removed the Secret.
    let api: Api<Secret> = Api::namespaced(h.cluster.client().clone(), &h.ns);
    within(
        h.settle_secs(),
        await_condition(api, &secret.name, conditions::is_deleted(&secret.uid)),
    )
    .await
    .unwrap();
    assert_eq!(
        h.cluster.get(Kind::Secret, &secret.name).await.unwrap(),
        None
    );
    // The owner link was set at creation: the Secret was never updated or patched.
    let writes: Vec<String> = h
        .calls_since(mark)
        .into_iter()
        .filter(|c| c.resource == "secrets" && !c.is_read())
        .map(|c| c.verb)
        .collect();
    assert_eq!(writes, ["create"]);
}

on_both_backends!(a_full_quota_is_reported_as_quota_exceeded);
async fn a_full_quota_is_reported_as_quota_exceeded(h: &Harness) {
    h.pause_kubevirt();
    h.create_quota(
        "ttlab-vms",
        json!({"count/virtualmachines.kubevirt.io": "2"}),
    )
    .await;
    for name in ["q-1", "q-2"] {
        retry_quota(|| {
            h.cluster
                .create_vm(common::vm(name, &common::labels("dev")))
        })
        .await
        .unwrap();
    }
    let err = h
        .cluster
        .create_vm(common::vm("q-3", &common::labels("dev")))
        .await
        .unwrap_err();
    match &err {
        ClusterError::QuotaExceeded { message } => {
            assert!(message.contains("ttlab-vms"), "{message}")
        }
        other => panic!("expected QuotaExceeded, got {other:?}"),
    }
    assert!(!err.is_retryable());
    assert_eq!(
        h.cluster.get(Kind::VirtualMachine, "q-3").await.unwrap(),
        None
    );
}

on_both_backends!(a_repeated_create_is_adopted_even_when_its_object_fills_the_quota);
async fn a_repeated_create_is_adopted_even_when_its_object_fills_the_quota(h: &Harness) {
    h.pause_kubevirt();
    h.create_quota(
        "ttlab-vms",
        json!({"count/virtualmachines.kubevirt.io": "1"}),
    )
    .await;
    let l = common::labels("dev");
    let created = retry_quota(|| h.cluster.create_vm(common::vm("full-1", &l)))
        .await
        .unwrap();
    // The quota is full with this very VM: quota admission, which runs before storage looks
    // at the name, refuses the repeated create (403, not 409). It is still this session's
    // VM, so the create adopts it.
    let again = h.cluster.create_vm(common::vm("full-1", &l)).await.unwrap();
    assert_eq!(again, created, "adopted as it is");
    // Another session's create under the name is still refused.
    let err = h
        .cluster
        .create_vm(common::vm("full-1", &common::labels("dev")))
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::QuotaExceeded { .. }), "{err:?}");
}

on_both_backends!(golden_disk_facts_are_observed_raw);
async fn golden_disk_facts_are_observed_raw(h: &Harness) {
    // Created as an administrator would, with the statuses CDI and the volume binder would
    // write.
    h.create_object(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "ubuntu-ab12",
                     "annotations": {"cdi.kubevirt.io/storage.pod.phase": "Succeeded"}},
        "spec": {"accessModes": ["ReadOnlyMany"], "volumeMode": "Filesystem",
                 "resources": {"requests": {"storage": "5Gi"}}}
    }))
    .await;
    h.set_status(
        "persistentvolumeclaims",
        "ubuntu-ab12",
        json!({"phase": "Bound", "capacity": {"storage": "5Gi"}}),
    )
    .await;
    h.create_object(json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
        "metadata": {"name": "ubuntu-ab12"},
        "spec": {"source": {"registry": {"url": "docker://quay.io/containerdisks/ubuntu:22.04"}},
                 "storage": {"resources": {"requests": {"storage": "5Gi"}}}}
    }))
    .await;
    h.set_status(
        "datavolumes",
        "ubuntu-ab12",
        json!({"phase": "ImportInProgress", "progress": "45.20%"}),
    )
    .await;
    h.create_object(json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataSource",
        "metadata": {"name": "ubuntu"},
        "spec": {"source": {"pvc": {"name": "ubuntu-ab12", "namespace": h.ns}}}
    }))
    .await;

    let facts = h
        .cluster
        .observe_golden(&GoldenRef::DataSource("ubuntu".into()))
        .await
        .unwrap();
    let ds = facts
        .data_source
        .as_ref()
        .and_then(Lookup::found)
        .expect("DataSource found");
    assert_eq!(ds.pvc_name.as_deref(), Some("ubuntu-ab12"));
    let pvc = facts
        .pvc
        .as_ref()
        .and_then(Lookup::found)
        .expect("PVC found");
    assert_eq!(pvc.access_modes, ["ReadOnlyMany"]);
    assert_eq!(pvc.phase.as_deref(), Some("Bound"));
    assert_eq!(pvc.capacity.as_deref(), Some("5Gi"));
    assert!(!pvc.deleting);
    assert_eq!(
        pvc.annotations["cdi.kubevirt.io/storage.pod.phase"],
        "Succeeded"
    );
    let dv = facts
        .data_volume
        .as_ref()
        .and_then(Lookup::found)
        .expect("DataVolume found");
    assert_eq!(dv.phase.as_deref(), Some("ImportInProgress"));
    assert_eq!(dv.progress.as_deref(), Some("45.20%"));

    // Missing and forbidden are answers, not errors.
    let missing = h
        .cluster
        .observe_golden(&GoldenRef::Pvc("nope".into()))
        .await
        .unwrap();
    assert_eq!(missing.pvc, Some(Lookup::NotFound));
    assert_eq!(missing.data_volume, Some(Lookup::NotFound));
    let missing_ds = h
        .cluster
        .observe_golden(&GoldenRef::DataSource("nope".into()))
        .await
        .unwrap();
    assert_eq!(missing_ds.data_source, Some(Lookup::NotFound));
    assert_eq!(missing_ds.pvc, None);

    let denied = h.denied(Verb::Get, "persistentvolumeclaims").await;
    let forbidden = denied
        .observe_golden(&GoldenRef::Pvc("ubuntu-ab12".into()))
        .await
        .unwrap();
    assert_eq!(forbidden.pvc, Some(Lookup::Forbidden));
    h.undeny();

    // A PVC being deleted (held by a finalizer: pvc-protection while a pod uses it, here one
    // that nothing removes) says so.
    h.create_object(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "old-golden", "finalizers": ["example.com/hold"]},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .await;
    let api: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(h.cluster.client().clone(), &h.ns);
    api.delete("old-golden", &Default::default()).await.unwrap();
    let Lookup::Found(old) = h.cluster.observe_pvc(None, "old-golden").await.unwrap() else {
        panic!("a Terminating PVC is still found");
    };
    assert!(old.deleting);
    assert_eq!(old.access_modes, ["ReadWriteOnce"]);
}

on_both_backends!(the_agent_config_map_is_created_once_and_another_content_is_a_conflict);
async fn the_agent_config_map_is_created_once_and_another_content_is_a_conflict(h: &Harness) {
    use k8s_openapi::api::core::v1::ConfigMap;
    use std::collections::BTreeMap;
    use ttlab_cluster::Ensured;
    let config_map = |digest: &str| ConfigMap {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("ttlab-agent-0123456789abcdef".into()),
            labels: Some(labels::agent_labels(&"dev".parse().unwrap())),
            annotations: Some(BTreeMap::from([(
                labels::AGENT_SHA256.to_owned(),
                digest.to_owned(),
            )])),
            ..Default::default()
        },
        binary_data: Some(BTreeMap::from([(
            "ttlab-agent.gz".to_owned(),
            k8s_openapi::ByteString(vec![0x1f, 0x8b, 0, 1, 2, 3]),
        )])),
        immutable: Some(true),
        ..Default::default()
    };
    assert_eq!(
        h.cluster.ensure_config_map(config_map("aa")).await.unwrap(),
        Ensured::Created
    );
    assert_eq!(
        h.cluster.ensure_config_map(config_map("aa")).await.unwrap(),
        Ensured::Present,
        "made sure of again: found, not created twice"
    );
    let err = h
        .cluster
        .ensure_config_map(config_map("bb"))
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::Conflict { .. }), "{err}");
    assert!(
        err.to_string().contains("ttlab-agent-0123456789abcdef"),
        "{err}"
    );
    let listed = h
        .cluster
        .list_all(
            Kind::ConfigMap,
            &labels::agent_selector(&"dev".parse().unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        h.cluster
            .list_all(
                Kind::ConfigMap,
                &labels::agent_selector(&"prod".parse().unwrap())
            )
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        h.cluster
            .delete(
                Kind::ConfigMap,
                "ttlab-agent-0123456789abcdef",
                Propagation::Background
            )
            .await
            .unwrap(),
        Deleted::Removed
    );
}

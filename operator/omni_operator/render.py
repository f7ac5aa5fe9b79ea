"""Rendering: the Kubernetes objects of one attempt of a job (pure functions, plain dicts).

One Pod per placed node runs ``torchrun`` with a static rendezvous on node rank 0, so node ranks
are exactly the ones placement chose. The rendezvous address is the attempt's own headless
Service (``<job>-a<attempt>-rdzv.<namespace>.svc``), which selects the attempt's pod labelled
node rank 0: when a hot spare takes node rank 0 over, its new label moves the address with it
(pods' hostnames stay under the job's Service, ``<pod hostname>.<job>.<namespace>.svc``). Pods
are pinned with required node affinity on ``metadata.name`` rather than ``nodeName``: the
scheduler still accounts resources and gang schedulers (Volcano, Kueue's scheduling gates)
still admit the pods as a group (under Kueue's Topology-Aware Scheduling, Kueue chooses the
nodes and the pods are not pinned: see :mod:`omni_operator.kueue`). Pod names carry the restart
attempt, so a restart never waits for an old pod stuck Terminating on a lost node.

With ``scheduling.placement: scheduler`` no node is chosen here: the pods
(``<job>-a<attempt>-p<index>``) carry the layout as scheduling constraints
(:func:`scheduler_affinity`) and start as standbys of the in-pod supervisor; once the scheduler
bound them all, the operator gives each its node rank as it gives a spare one (the rank label,
which moves the rendezvous address, and the rank's environment in the pod's order:
:func:`rank_patch`).

The contract with the trainer is the ``OMNI_*`` environment (see :func:`rank_env`) and the
manifest mounted at :data:`CONFIG_PATH`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from omni_operator import kueue, volcano
from omni_operator.placement import Domain, PlacedNode, Placement, node_requests
from omni_operator.pod_access import SCRATCH_DIR, render_access
from omni_operator.spec import GROUP, VERSION, OmniTrainingJob
from omni_trainer.checkpoint.owner import JOB_NAME_ENV, JOB_NAMESPACE_ENV, JOB_UID_ENV
from omni_trainer.failure_report import HEALTH_PATH, REPORT_PORT
from omni_trainer.pod_protocol import ATTEMPT_KEY, STATE_DIR, order, rdzv_id

Obj = dict[str, Any]
RDZV_PORT = 29500
METRICS_PORT = 9464  # the trainer's Prometheus port (omni_trainer.components.metrics.DEFAULT_PORT)
CONFIG_DIR = "/etc/omni"
CONFIG_FILE = "job.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
ORDER_DIR = "/etc/omni-order"
ATTEMPT_PATH = f"{ORDER_DIR}/{ATTEMPT_KEY}"
"""Where in-place pods read the restart attempt to run: their own :data:`ANNOTATION_ORDER`,
projected by a downwardAPI volume. A kubelet refreshes it as soon as the pod is updated; a
ConfigMap key (pods rendered before it, :func:`render_config_map`) only at its next periodic
sync, up to a minute later."""
LABEL_JOB = f"{GROUP}/job"
LABEL_RANK = f"{GROUP}/node-rank"
LABEL_ATTEMPT = f"{GROUP}/attempt"
LABEL_SPARE = f"{GROUP}/spare"
"""On a hot spare's pod: ``standby`` (waiting), ``assigned`` (it took the rank of its
``node-rank`` label over and belongs to the gang)."""
SPARE_RANK = -1
"""A standby's node rank until its supervisor is given one (it starts nothing before)."""
LABEL_PLACEMENT = f"{GROUP}/placement"
"""``scheduler`` on the pods whose node the scheduler chose: their rank is given once bound."""
SCHEDULER = "scheduler"
HOSTNAME_LABEL = "kubernetes.io/hostname"
ANNOTATION_NODE = f"{GROUP}/placed-node"
ANNOTATION_ORDER = f"{GROUP}/order"
"""On an in-place pod: the operator's order to its supervisor (:func:`attempt_order`)."""
TRAINER_UID = 10001
"""Trainer pods' user and group (non-RDMA): numeric, above host users' range, as the image."""
STOP_MARGIN_SECONDS = 10
"""Pod grace beyond the trainer's stop grace: torchrun's shutdown and the container's exit."""


def pod_name(job_name: str, *, attempt: int, rank: int) -> str:
    """``<job>-a<attempt>-n<rank>``; also the pod's hostname under the job's Service."""
    return f"{job_name}-a{attempt}-n{rank}"


def scheduled_pod_name(job_name: str, *, attempt: int, index: int) -> str:
    """``<job>-a<attempt>-p<index>``: a pod whose node, hence rank, the scheduler chooses."""
    return f"{job_name}-a{attempt}-p{index}"


def by_scheduler(job: OmniTrainingJob) -> bool:
    """The scheduler chooses the job's nodes (``scheduling.placement: scheduler``)."""
    return job.spec.scheduling.placement == SCHEDULER


def spare_pod_name(job_name: str, index: int) -> str:
    """``<job>-s<index>``: a hot spare's pod (also its hostname under the job's Service)."""
    return f"{job_name}-s{index}"


def config_map_name(job_name: str) -> str:
    return f"{job_name}-config"


def _namespace(job: OmniTrainingJob) -> str:
    return job.metadata.namespace or "default"


def _meta(job: OmniTrainingJob, name: str, labels: dict[str, str] | None = None) -> Obj:
    meta: Obj = {
        "name": name,
        "namespace": _namespace(job),
        "labels": {
            "app.kubernetes.io/name": "megascale-omni",
            "app.kubernetes.io/managed-by": "omni-operator",
            LABEL_JOB: job.metadata.name,
            **(labels or {}),
        },
    }
    uid = (job.metadata.model_extra or {}).get("uid")
    if uid:  # `omni render` has no uid: the operator adds the owner when it creates them
        meta["ownerReferences"] = [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "OmniTrainingJob",
                "name": job.metadata.name,
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def render_config_map(job: OmniTrainingJob, *, attempt: int = 0, pods: int | None = None) -> Obj:
    """The trainer's manifest (``spec.trainer`` and ``spec.preflight``, which the trainers run;
    other cluster settings are not their business),
    with the data reorder groups of the topology's network-local node groups, and the restart
    attempt the pods' supervisors run: in the pods that attempt ``pods`` (default: ``attempt``)
    created (in-place restarts change only that key). Pods read their order from their own
    annotation (:data:`ATTEMPT_PATH`); the key stays for pods an earlier operator version
    rendered, which mount it."""
    trainer = job.spec.trainer.model_dump(mode="json", by_alias=True, exclude_unset=True)
    group = job.spec.trainer_reorder_group()
    if group is not None:
        data = trainer.setdefault("data", {})
        data["reorder"] = {**data.get("reorder", {}), "groupSize": group}
    spec: dict = {"trainer": trainer}
    preflight = job.spec.preflight.model_dump(mode="json", by_alias=True, exclude_unset=True)
    if preflight:  # the trainers run the network preflight with the manifest's settings
        spec["preflight"] = preflight
    manifest = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OmniTrainingJob",
        "metadata": {"name": job.metadata.name},
        "spec": spec,
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, config_map_name(job.metadata.name)),
        "data": {
            CONFIG_FILE: yaml.safe_dump(manifest, sort_keys=False),
            ATTEMPT_KEY: attempt_order(attempt, pods=pods),
        },
    }


def render_service(job: OmniTrainingJob) -> Obj:
    """Headless, publishing not-ready pods: rank 0 must resolve before any pod is Ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, job.metadata.name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job.metadata.name},
            "ports": [{"name": "rendezvous", "port": RDZV_PORT, "protocol": "TCP"}],
        },
    }


def rendezvous_service_name(job_name: str, *, attempt: int) -> str:
    """``<job>-a<attempt>-rdzv``: the rendezvous Service of the pods created by ``attempt``."""
    return f"{job_name}-a{attempt}-rdzv"


def render_rendezvous_service(job: OmniTrainingJob, *, attempt: int) -> Obj:
    """Headless, selecting the pod of node rank 0 among the pods ``attempt`` created (a spare
    relabelled to rank 0 included), publishing it before it is Ready: the other ranks resolve
    it while it starts. Labelled with the attempt: a later attempt's start prunes it."""
    name = job.metadata.name
    labels = {LABEL_ATTEMPT: str(attempt)}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, rendezvous_service_name(name, attempt=attempt), labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: name, LABEL_ATTEMPT: str(attempt), LABEL_RANK: "0"},
            "ports": [{"name": "rendezvous", "port": RDZV_PORT, "protocol": "TCP"}],
        },
    }


def render_pod_group(job: OmniTrainingJob, *, attempt: int) -> Obj:
    """Volcano gang: all node pods are admitted together or not at all
    (:func:`omni_operator.volcano.pod_group_spec`)."""
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": _meta(job, _gang_name(job, attempt), {LABEL_ATTEMPT: str(attempt)}),
        "spec": volcano.pod_group_spec(job.spec),
    }


def _gang_name(job: OmniTrainingJob, attempt: int) -> str:
    return f"{job.metadata.name}-a{attempt}"


def rank_env(job: OmniTrainingJob, node: PlacedNode, *, attempt: int) -> dict[str, str]:
    """What a trainer pod knows about its place in the job (all strings, stable order)."""
    spec = job.spec
    return {
        # the job a checkpoint belongs to (recorded in its markers; another job is refused)
        JOB_NAMESPACE_ENV: _namespace(job),
        JOB_NAME_ENV: job.metadata.name,
        JOB_UID_ENV: str((job.metadata.model_extra or {}).get("uid") or ""),
        "OMNI_NNODES": str(spec.nodes),
        "OMNI_NODE_RANK": str(node.rank),
        "OMNI_NPROC_PER_NODE": str(spec.procs_per_node),
        "OMNI_PIPELINE_STAGES": ",".join(map(str, node.stages)),
        "OMNI_REORDER_GROUP": str(node.reorder_group),
        "OMNI_REORDER_GROUP_SIZE": str(spec.group_size),
        "OMNI_RESTART_ATTEMPT": str(attempt),
        "OMNI_RESUME": "auto",
        "OMNI_METRICS_PORT": str(METRICS_PORT),
        "OMNI_STOP_GRACE_SECONDS": str(spec.restart_policy.stop_grace_seconds),
        # SIGTERM reaches the workers through torchrun, which SIGKILLs them after this long
        # (an environment variable: older torchrun versions lack --shutdown-timeout).
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(
            spec.restart_policy.stop_grace_seconds + STOP_MARGIN_SECONDS // 2
        ),
        "MASTER_ADDR": _master_addr(job, attempt),
        "MASTER_PORT": str(RDZV_PORT),
    }


def nccl_env(job: OmniTrainingJob) -> dict[str, str]:
    """NCCL/IB settings derived from the spec, then the user's ``nccl.env`` on top."""
    spec = job.spec
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # a dead peer errors instead of hanging
    if spec.resources.rdma is not None:
        env["NCCL_IB_DISABLE"] = "0"
        if spec.nccl.ib_hca:
            env["NCCL_IB_HCA"] = spec.nccl.ib_hca
    else:
        env["NCCL_IB_DISABLE"] = "1"
    if spec.nccl.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = spec.nccl.socket_ifname
    env.update(spec.nccl.env)
    return env


def _master_addr(job: OmniTrainingJob, attempt: int) -> str:
    """The rendezvous host of the pods ``attempt`` created: its Service, not rank 0's pod
    (a spare may take that rank over)."""
    return f"{rendezvous_service_name(job.metadata.name, attempt=attempt)}.{_namespace(job)}.svc"


def attempt_order(
    attempt: int,
    *,
    pods: int | None = None,
    spares: Mapping[str, Mapping[str, str]] | None = None,
    fresh: bool = False,
) -> str:
    return order(attempt, pods=attempt if pods is None else pods, spares=spares, fresh=fresh)


SPARE_ENV = ("OMNI_NODE_RANK", "OMNI_PIPELINE_STAGES", "OMNI_REORDER_GROUP")
"""What differs between node ranks in :func:`rank_env` (a spare is given it with its rank)."""


def spare_env(job: OmniTrainingJob, node: PlacedNode) -> dict[str, str]:
    """The environment of node rank ``node.rank`` that a spare pod takes over."""
    env = rank_env(job, node, attempt=0)
    return {k: env[k] for k in SPARE_ENV}


def _order_volume() -> Obj:
    """The pod's order annotation as the file its supervisor watches."""
    path = f"metadata.annotations['{ANNOTATION_ORDER}']"
    item = {"path": ATTEMPT_KEY, "fieldRef": {"fieldPath": path}}
    return {"name": "order", "downwardAPI": {"items": [item]}}


def order_patch(pod: Obj, order_doc: str) -> Obj:
    """A merge patch giving ``pod`` the order ``order_doc``: the update makes its kubelet sync
    the pod, which rewrites the order file at once."""
    meta = pod["metadata"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace") or "default",
                         "annotations": {ANNOTATION_ORDER: order_doc}}}  # fmt: skip


def in_place(job: OmniTrainingJob) -> bool:
    return job.spec.restart_policy.mode == "in-place"


def container_command(
    job: OmniTrainingJob, node: PlacedNode, *, attempt: int, standby: bool = False
) -> list[str]:
    """torchrun, under the in-pod supervisor when restarts are in place (it restarts torchrun
    for each attempt the operator names; see ``omni_trainer.supervisor``); ``standby``: a hot
    spare's, which waits for a node rank."""
    run = torchrun_command(job, node, attempt=attempt)
    if not in_place(job):
        return run
    return ["omni", "supervise", f"--attempt-file={ATTEMPT_PATH}", f"--state-dir={STATE_DIR}",
            f"--report-port={REPORT_PORT}", "--warm", *(["--standby"] if standby else []),
            "--", *run]  # fmt: skip


def readiness_probe() -> Obj:
    """An in-place pod's: its supervisor's health, unready from a failed attempt until the
    operator's next one starts (``omni_trainer.failure_report``). Probed every second, so the
    operator hears of a failure within about a second, as of an exiting container."""
    return {
        "httpGet": {"path": HEALTH_PATH, "port": "supervisor"},
        "periodSeconds": 1,
        "timeoutSeconds": 1,
        "successThreshold": 1,
        "failureThreshold": 1,
    }


def torchrun_command(job: OmniTrainingJob, node: PlacedNode, *, attempt: int) -> list[str]:
    """Static rendezvous: the node rank is placement's, not first-come. No torchrun restarts:
    the operator orders restarts (so every rank resumes from the same checkpoint)."""
    spec = job.spec
    return [
        "torchrun",
        f"--nnodes={spec.nodes}",
        f"--node-rank={node.rank}",
        f"--nproc-per-node={spec.procs_per_node}",
        f"--master-addr={_master_addr(job, attempt)}",
        f"--master-port={RDZV_PORT}",
        f"--rdzv-id={rdzv_id(attempt)}",  # in place, the supervisor sets each attempt's
        "--max-restarts=0",
        "-m",
        # In place, each worker forks from its supervisor's pre-imported trainer if it can.
        "omni_trainer.warm" if in_place(job) else "omni_trainer.cli",
        "train",
        CONFIG_PATH,
    ]


def render_pod(
    job: OmniTrainingJob,
    node: PlacedNode,
    *,
    attempt: int,
    gang: bool = True,
    spare: str | None = None,
    quarantined: Sequence[str] = (),
    domains: Sequence[Domain] = (),
) -> Obj:
    """The pod of one node rank (``gang`` adds the Volcano/Kueue group wiring if configured),
    or the standby pod named ``spare`` on ``node`` (rank :data:`SPARE_RANK`), of the gang whose
    pods attempt ``attempt`` created. Pinned to ``node`` unless Kueue's Topology-Aware
    Scheduling chooses the nodes (see :mod:`omni_operator.kueue`) or the scheduler does
    (:func:`by_scheduler`: ``node.rank`` is then the pod's index, its node only a model for the
    requests; ``quarantined`` nodes are avoided, and a spare stays in the gang's ``domains``)."""
    sched = job.spec.scheduling
    scheduled = by_scheduler(job)
    gang = gang and spare is None  # a spare is admitted on its own, never holding the gang back
    name, meta = _pod_metadata(job, node, attempt=attempt, gang=gang, spare=spare)
    kueue_places = bool(gang and sched.kueue_queue and sched.topology_aware)
    standby = spare is not None or scheduled
    container = _trainer_container(job, node, attempt=attempt, standby=standby)
    pod_spec = _pod_spec(job, name, container, pin=None if kueue_places or scheduled else node.name)
    _add_options(job, container, pod_spec)
    if scheduled:
        group = node.reorder_group if spare is None else None
        pod_spec["affinity"] = scheduler_affinity(
            job, attempt=attempt, group=group, quarantined=quarantined, domains=domains
        )
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    scheduler = sched.scheduler_name or ("volcano" if sched.volcano_gang else None)
    if scheduler:
        pod_spec["schedulerName"] = scheduler
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def _pod_metadata(
    job: OmniTrainingJob, node: PlacedNode, *, attempt: int, gang: bool, spare: str | None
) -> tuple[str, Obj]:
    """The pod's name and metadata: its rank (or, placed by the scheduler, its index; a spare's
    standby label), the node it was placed on, the gang wiring and the in-place order."""
    spec, sched = job.spec, job.spec.scheduling
    scheduled = by_scheduler(job)
    if spare is not None:
        name, labels = spare, {LABEL_SPARE: "standby", LABEL_ATTEMPT: str(attempt)}
    elif scheduled:
        name = scheduled_pod_name(job.metadata.name, attempt=attempt, index=node.rank)
        labels = {LABEL_ATTEMPT: str(attempt)}  # its rank label comes once it is bound
        if spec.group_size < spec.nodes:
            labels[volcano.REORDER_GROUP_LABEL] = str(node.reorder_group)
    else:
        name = pod_name(job.metadata.name, attempt=attempt, rank=node.rank)
        labels = {LABEL_RANK: str(node.rank), LABEL_ATTEMPT: str(attempt)}
    annotations = {} if scheduled else {ANNOTATION_NODE: node.name}
    if scheduled:
        labels[LABEL_PLACEMENT] = SCHEDULER
    if gang and sched.kueue_queue:
        labels[kueue.QUEUE_LABEL] = sched.kueue_queue
        labels[kueue.GROUP_LABEL] = _gang_name(job, attempt)
        annotations[kueue.GROUP_TOTAL] = str(spec.nodes)
    if gang and sched.kueue_queue and sched.topology_aware:
        labels[kueue.POD_INDEX_LABEL] = str(node.rank)
        annotations.update(kueue.topology_annotations(spec))
    if gang and sched.volcano_gang:
        annotations["scheduling.k8s.io/group-name"] = _gang_name(job, attempt)
        if sched.topology_aware:
            labels[volcano.REORDER_GROUP_LABEL] = str(node.reorder_group)
    if in_place(job) and spare is None:
        annotations[ANNOTATION_ORDER] = attempt_order(attempt)
    meta = _meta(job, name, labels)
    meta["annotations"] = annotations
    return name, meta


def _trainer_container(
    job: OmniTrainingJob, node: PlacedNode, *, attempt: int, standby: bool
) -> Obj:
    """The trainer container before the job's options (:func:`_add_options`): command,
    environment, ports, resources and the volumes every trainer pod mounts."""
    spec, res = job.spec, job.spec.resources
    limits: Obj = {}
    if spec.gpus_per_node:
        limits[res.gpu_resource_name] = str(spec.gpus_per_node)
    if res.rdma is not None:
        limits[res.rdma.resource_name] = str(res.rdma.count)
    if res.memory is not None:
        limits["memory"] = str(res.memory)
    requests = node_requests(spec, node.allocatable)

    env = [{"name": k, "value": v} for k, v in rank_env(job, node, attempt=attempt).items()]
    env += [{"name": k, "value": v} for k, v in nccl_env(job).items()]
    env += [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "OMNI_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    env += [{"name": k, "value": v} for k, v in SCRATCH_ENV.items()]
    return {
        "name": "trainer",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": container_command(job, node, attempt=attempt, standby=standby),
        "env": env,
        "ports": [
            {"name": "rendezvous", "containerPort": RDZV_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": {k: v for k, v in (("limits", limits), ("requests", requests)) if v},
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "scratch", "mountPath": SCRATCH_DIR},
        ],
        "securityContext": _container_security(job),
        # The trainer writes its fatal error to /dev/termination-log; without it (killed, a
        # crash before Python), the log's tail: the operator shows either in the job's status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _pod_spec(job: OmniTrainingJob, name: str, container: Obj, *, pin: str | None) -> Obj:
    """The pod's spec around ``container``, with its volumes every trainer pod has; ``pin``:
    the node it is bound to by affinity (None: Kueue or the scheduler chooses)."""
    shm = {"medium": "Memory", "sizeLimit": str(job.spec.resources.shm_size)}
    return {
        "automountServiceAccountToken": False,  # the trainer never calls the API server
        "hostname": name,
        "subdomain": job.metadata.name,
        # In place, the kubelet restarts a dead container in its pod (its supervisor then waits
        # for the operator's next attempt); else the operator recreates the pods.
        "restartPolicy": "OnFailure" if in_place(job) else "Never",
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(job),
        **({} if pin is None else {"affinity": _pin(pin)}),
        "tolerations": _tolerations(job),
        "securityContext": _pod_security(job),
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": shm},
            {
                "name": "config",
                "configMap": {"name": config_map_name(job.metadata.name)},
            },
            {"name": "scratch", "emptyDir": {}},
        ],
    }


def _add_options(job: OmniTrainingJob, container: Obj, pod_spec: Obj) -> None:
    """What the job's options add to the pod: the fast checkpoint tier, the in-pod supervisor
    (its port, readiness, state and order volumes) when restarts are in place, and the
    credentials, storage and pull secrets the spec names."""
    fast = fast_tier_volume(job)
    if fast is not None:
        container["volumeMounts"].append(fast[0])
        pod_spec["volumes"].append(fast[1])
    if in_place(job):
        container["ports"].append(
            {"name": "supervisor", "containerPort": REPORT_PORT, "protocol": "TCP"}
        )
        container["readinessProbe"] = readiness_probe()
        container["volumeMounts"].append({"name": "supervisor", "mountPath": STATE_DIR})
        pod_spec["volumes"].append({"name": "supervisor", "emptyDir": {"sizeLimit": "1Mi"}})
        container["volumeMounts"].append({"name": "order", "mountPath": ORDER_DIR,
                                          "readOnly": True})  # fmt: skip
        pod_spec["volumes"].append(_order_volume())
    spec = job.spec
    access, pod_access = render_access(spec.env_from, spec.volumes, spec.image_pull_secrets)
    container["volumeMounts"] += access.pop("volumeMounts", [])
    container.update(access)
    pod_spec["volumes"] += pod_access.pop("volumes", [])
    pod_spec.update(pod_access)


def scheduler_affinity(
    job: OmniTrainingJob,
    *,
    attempt: int,
    group: int | None,
    quarantined: Sequence[str] = (),
    domains: Sequence[Domain] = (),
) -> Obj:
    """The layout as constraints for the scheduler (``scheduling.placement: scheduler``).

    One pod per node: required anti-affinity on the hostname among the pods of the gang
    ``attempt`` created (standby spares included). A rank pod of reorder group ``group`` (None:
    a spare) requires the other pods of its group in its network domain: one required term per
    ``topology.networkDomainLabels`` level (terms are ANDed, so the domain is the same tuple of
    values placement uses); with several groups the whole job prefers one domain. A spare is
    required in one of the gang's ``domains`` (it takes over a rank of its own domain).
    ``quarantined`` nodes are excluded by name.

    Returns:
        The pod's ``affinity``.
    """
    spec, name = job.spec, job.metadata.name
    gang = {LABEL_JOB: name, LABEL_ATTEMPT: str(attempt)}
    required = "requiredDuringSchedulingIgnoredDuringExecution"
    one_per_node = {"labelSelector": {"matchLabels": gang}, "topologyKey": HOSTNAME_LABEL}
    out: Obj = {"podAntiAffinity": {required: [one_per_node]}}
    levels = list(spec.topology.network_domain_labels)
    if levels and group is not None:
        several = spec.group_size < spec.nodes
        same = {**gang, volcano.REORDER_GROUP_LABEL: str(group)} if several else gang
        terms = [{"labelSelector": {"matchLabels": same}, "topologyKey": k} for k in levels]
        out["podAffinity"] = {required: terms}
        if several:
            out["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] = [
                {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": gang},
                                                    "topologyKey": levels[-1]}}
            ]  # fmt: skip
    avoid = [{"key": "metadata.name", "operator": "NotIn", "values": sorted(quarantined)}]
    node_terms: list[Obj] = []
    if levels and group is None and domains:
        for d in sorted(set(domains)):
            exprs = [{"key": k, "operator": "In", "values": [v]}
                     for k, v in zip(levels, d, strict=True)]  # fmt: skip
            node_terms.append({"matchExpressions": exprs, **({"matchFields": avoid}
                                                             if quarantined else {})})  # fmt: skip
    elif quarantined:
        node_terms.append({"matchFields": avoid})
    if node_terms:
        out["nodeAffinity"] = {required: {"nodeSelectorTerms": node_terms}}
    return out


def rank_patch(pod: Obj, node: PlacedNode, order_doc: str) -> Obj:
    """The merge patch that gives a pod the scheduler bound its node rank: the rank label (the
    rendezvous Service of rank 0 follows it), the node it landed on, and the order naming the
    rank's environment, which its standby supervisor waits for."""
    meta = pod["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": meta["name"],
            "namespace": meta.get("namespace") or "default",
            "labels": {LABEL_RANK: str(node.rank)},
            "annotations": {ANNOTATION_NODE: node.name, ANNOTATION_ORDER: order_doc},
        },
    }


def _pin(node_name: str) -> Obj:
    """Required node affinity on ``metadata.name``: the scheduler still accounts resources."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name]}]}
    return {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [term]}}
    }  # fmt: skip


def fast_tier_volume(job: OmniTrainingJob) -> tuple[Obj, Obj] | None:
    """The mount and volume of ``checkpoint.fast`` (None without one): a hostPath, one
    directory per job on the node (``<path>/<namespace>/<job>``), mounted at ``path``. Not an
    emptyDir: that dies with its pod, and a node loss recreates every pod of the gang, so the
    surviving nodes' shares and peer copies would die with them; a hostPath outlives the pod
    and a restarted container alike, and goes only with its node's disk."""
    ckpt = job.spec.trainer.checkpoint
    if ckpt is None or ckpt.fast is None:
        return None
    host = f"{ckpt.fast.path.rstrip('/')}/{_namespace(job)}/{job.metadata.name}"
    mount = {"name": "fast-checkpoints", "mountPath": ckpt.fast.path}
    volume = {"name": "fast-checkpoints", "hostPath": {"path": host, "type": "DirectoryOrCreate"}}
    return mount, volume


def termination_grace_seconds(job: OmniTrainingJob) -> int:
    """From SIGTERM to SIGKILL: the trainer's stop grace plus torchrun's and the container's
    exit (every deletion but a forced one, on a lost node, gives the trainer this long)."""
    return job.spec.restart_policy.stop_grace_seconds + STOP_MARGIN_SECONDS


def _tolerations(job: OmniTrainingJob) -> list[Obj]:
    """The user's tolerations, plus node-lost tolerations shortened from Kubernetes' default
    300 s to ``nodeLostGraceSeconds`` so the kubelet-side eviction agrees with the operator."""
    out = [t.model_dump(mode="json", exclude_none=True) for t in job.spec.scheduling.tolerations]
    grace = job.spec.restart_policy.node_lost_grace_seconds
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        out.append(
            {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": grace}
        )
    return out


def _pod_security(job: OmniTrainingJob) -> Obj:
    """Non-root unless RDMA is used: registering IB memory needs IPC_LOCK, which a non-root
    process does not get from the bounding set."""
    if job.spec.resources.rdma is not None:
        return {"seccompProfile": {"type": "RuntimeDefault"}}
    return {
        "runAsNonRoot": True,
        "runAsUser": TRAINER_UID,
        "runAsGroup": TRAINER_UID,
        "fsGroup": TRAINER_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


SCRATCH_ENV = {
    "TMPDIR": SCRATCH_DIR,
    "XDG_CACHE_HOME": f"{SCRATCH_DIR}/cache",
    "TRITON_CACHE_DIR": f"{SCRATCH_DIR}/triton",
    "MPLCONFIGDIR": f"{SCRATCH_DIR}/matplotlib",
}
"""Where the trainer and its libraries write, on the scratch emptyDir: Python's tempfile (S3
checkpoint staging, torch.compile), Hugging Face and torch hub caches, Triton kernels."""


def _container_security(job: OmniTrainingJob) -> Obj:
    """No privilege escalation, no capabilities but IPC_LOCK for RDMA, a read-only root
    filesystem (the trainer writes to its volumes and :data:`SCRATCH_DIR`)."""
    caps: Obj = {"drop": ["ALL"]}
    if job.spec.resources.rdma is not None:
        caps["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": caps}


def render_all(
    job: OmniTrainingJob,
    placement: Placement,
    *,
    attempt: int = 0,
    quarantined: Sequence[str] = (),
) -> list[Obj]:
    """Every object of one attempt, in creation order: ConfigMap, Services, [PodGroup], Pods
    (when the scheduler chooses the nodes, ``placement`` only models the requests and
    ``quarantined`` nodes are excluded)."""
    objs = [
        render_config_map(job, attempt=attempt),
        render_service(job),
        render_rendezvous_service(job, attempt=attempt),
    ]
    if job.spec.scheduling.volcano_gang:
        objs.append(render_pod_group(job, attempt=attempt))
    objs += [
        render_pod(job, node, attempt=attempt, quarantined=quarantined) for node in placement.nodes
    ]
    return objs

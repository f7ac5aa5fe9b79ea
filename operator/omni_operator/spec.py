"""The ``OmniTrainingJob`` resource: ``spec.trainer`` (the trainer's model) plus cluster settings.

One pydantic model tree is the source of truth: the CRD schema is generated from it
(``omni_operator.crd``) and the operator validates every job with it. Field-level errors come
from pydantic; cross-field checks (layout vs. nodes, groups vs. topology) run in
:meth:`OmniTrainingJobSpec._check_layout` and report the exact field path, so a rejected job's
status names what to change.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from omni_operator.host_paths import allowed_prefixes, fast_path_problem
from omni_operator.pod_access import DNS_SUBDOMAIN, EnvFromSource, VolumeConfig, volume_problems
from omni_trainer.config import ManifestError, Metadata, TrainerConfig, format_errors
from omni_trainer.config_base import Spec
from omni_trainer.data.lengths import length_problems
from omni_trainer.distributed.layout import layout_problems as layout_problems_at
from omni_trainer.distributed.netcheck_rules import PreflightConfig
from omni_trainer.models.encoders.config import DEFER_HF

GROUP = "omni.megascale.io"
VERSION = "v1alpha1"
PLURAL = "omnitrainingjobs"
DEFAULT_IMAGE = "ghcr.io/megascale-omni/trainer:0.1.0"

# Kubernetes quantity (resource.Quantity): digits, optional fraction, optional suffix.
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][0-9]+)?$")
# A qualified name as used by labels and extended resources: [prefix/]name.
_QUALIFIED = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# Env the operator sets on every trainer container; users must not override it.
RESERVED_ENV = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK"}
)
RESERVED_ENV_PREFIXES = ("OMNI_", "TORCHELASTIC_")
LOADER_ENV = frozenset(
    {
        "BASH_ENV",
        "ENV",
        "GCONV_PATH",
        "NODE_OPTIONS",
        "PERL5OPT",
        "PYTHONBREAKPOINT",
        "PYTHONEXECUTABLE",
        "PYTHONHOME",
        "PYTHONINSPECT",
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONUSERBASE",
        "PYTHONWARNINGS",
    }
)
LOADER_ENV_PREFIXES = ("LD_", "DYLD_")
"""Variables that make the dynamic loader or an interpreter load other code (LD_PRELOAD,
PYTHONPATH, PYTHONSTARTUP...): never settable through ``nccl.env``, which is for NCCL knobs."""


def _check_quantity(v: int | str) -> int | str:
    if isinstance(v, int):
        if v < 0:
            raise ValueError(f"{v} is negative; a quantity is >= 0")
        return v
    if not _QUANTITY.match(v):
        raise ValueError(f"{v!r} is not a Kubernetes quantity (examples: 8, 500m, 64Gi, 1.5T)")
    return v


Quantity = Annotated[int | str, AfterValidator(_check_quantity)]
QualifiedName = Annotated[str, Field(pattern=_QUALIFIED, max_length=316)]


class RdmaConfig(Spec):
    """RDMA/InfiniBand devices per node (a device plugin's extended resource)."""

    resource_name: QualifiedName = Field(
        "rdma/ib", description="extended resource of the RDMA device plugin, e.g. rdma/ib"
    )
    count: int = Field(1, ge=1, description="devices per pod (one pod per node)")


class ResourcesConfig(Spec):
    """What every trainer pod asks for; GPUs come from ``gpusPerNode``."""

    gpu_resource_name: QualifiedName = Field(
        "nvidia.com/gpu", description="extended resource that counts GPUs"
    )
    rdma: RdmaConfig | None = Field(None, description="RDMA/IB devices; unset: TCP sockets")
    cpu: Quantity | None = Field(None, description="CPU request per pod (e.g. 96)")
    memory: Quantity | None = Field(None, description="memory request and limit per pod")
    shm_size: Quantity = Field(
        "64Gi", description="size of /dev/shm (memory-backed; NCCL and data loaders use it)"
    )


class TopologyConfig(Spec):
    """How the cluster's network is labelled, and how large a reorder group is."""

    network_domain_labels: list[QualifiedName] = Field(
        default_factory=list,
        description="node label keys naming network domains, coarse to fine (e.g. "
        "topology.kubernetes.io/zone, then a spine label); nodes of one reorder group share "
        "all of them",
    )
    reorder_group_size: int | None = Field(
        None,
        ge=1,
        description="nodes per grouped-reordering group, each kept inside one network "
        "domain; default: all nodes",
    )

    @field_validator("network_domain_labels")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        dup = sorted({k for k in v if v.count(k) > 1})
        if dup:
            raise ValueError(f"label keys must be unique; duplicated: {dup}")
        return v


class Toleration(Spec):
    """A Kubernetes toleration (the subset a training job needs)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class SchedulingConfig(Spec):
    """Scheduler, priority, gang admission, and who chooses the nodes."""

    placement: Literal["operator", "scheduler"] = Field(
        "operator",
        description="who chooses the nodes. operator: the operator places the job on free "
        "capacity and pins each pod to its node (required node affinity on metadata.name). "
        "scheduler: the pods name no node; the layout's constraints are pod anti-affinity (one "
        "pod per node), pod affinity (each reorder group inside one network domain: the "
        "same value of every topology.networkDomainLabels key) and node affinity (NotIn the "
        "quarantined nodes), so kube-scheduler, Kueue or Volcano choose the nodes; node ranks "
        "are then given from where the pods landed (sorted by network domain, then node "
        "name) through the in-pod supervisor's order. Needs restartPolicy.mode in-place",
    )
    scheduler_name: str | None = Field(None, description="default: the cluster's scheduler")
    priority_class_name: str | None = None
    kueue_queue: str | None = Field(
        None, description="Kueue LocalQueue; the pods are admitted as one pod group"
    )
    volcano_gang: bool = Field(
        False, description="create a Volcano PodGroup (minMember = nodes) and use Volcano"
    )
    volcano_queue: str | None = Field(
        None, description="Volcano Queue of the PodGroup (volcanoGang); default: Volcano's default"
    )
    topology_aware: bool = Field(
        False,
        description="give the gang scheduler the layout's network constraints, derived from "
        "topology.networkDomainLabels and reorderGroupSize: with kueueQueue, Kueue's "
        "Topology-Aware Scheduling annotations (the ClusterQueue's ResourceFlavor needs a "
        "Topology whose levels include the finest label; Kueue then chooses the nodes); with "
        "volcanoGang, the PodGroup's networkTopology over HyperNode tiers (tier 1 = the finest "
        "label)",
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)


class NcclConfig(Spec):
    """NCCL settings; ``env`` is applied last, so it overrides what the operator derives."""

    env: dict[Annotated[str, Field(pattern=_ENV_NAME)], str] = Field(
        default_factory=dict, description="extra NCCL_* (or other) environment variables"
    )
    ib_hca: str | None = Field(None, description="NCCL_IB_HCA, e.g. mlx5_0,mlx5_1")
    socket_ifname: str | None = Field(None, description="NCCL_SOCKET_IFNAME, e.g. eth0")


class BackoffConfig(Spec):
    """Delay before restart n: ``min(base * 2**(n-1), max)`` seconds."""

    base: float = Field(10.0, ge=0)
    max: float = Field(600.0, ge=0)

    @field_validator("max")
    @classmethod
    def _max_at_least_base(cls, v: float, info: Any) -> float:
        base = info.data.get("base")
        if base is not None and v < base:
            raise ValueError(f"max ({v}) must be >= base ({base})")
        return v


class StragglersConfig(Spec):
    """Straggler detection from the trainer's per-node busy time (the step minus the waits for
    peers, a median over recent steps, ``omni_trainer_node_busy_seconds``)."""

    enabled: bool = Field(True, description="compare the nodes' busy times at every progress poll")
    margin: float = Field(
        0.2,
        gt=0,
        le=10,
        description="a node is slow when its busy time exceeds the median of the other nodes' by "
        "more than this fraction (0.2: 20 % slower)",
    )
    persist_steps: int = Field(
        50,
        ge=1,
        description="training steps a node must stay slow, at every poll, before it is reported "
        "(a one-off slow step or poll is not a straggler)",
    )
    action: Literal["report", "replace"] = Field(
        "report",
        description="report: condition Straggler, a Warning Event and the operator metric "
        "omni_operator_straggler_nodes. replace: also quarantine the node and restart the job "
        "without it once the trainer reports a checkpoint newer than the detection (no step "
        "lost); without a free node to place the job on, the node is kept and the condition "
        "says so (reason NotReplaced)",
    )


class RestartPolicyConfig(Spec):
    """Whole-job restarts from the latest complete checkpoint."""

    mode: Literal["in-place", "recreate"] = Field(
        "in-place",
        description="in-place: a crashed or hung trainer restarts inside the existing pods (an "
        "in-pod supervisor restarts every pod's trainer together when the operator says so; a "
        "dead container is restarted by the kubelet); pods are recreated only when they are "
        "gone (node lost, evicted, deleted). recreate: every failure deletes and recreates "
        "the pods",
    )

    budget: int = Field(
        10, ge=0, description="restarts allowed without progress; a newer checkpoint refills it"
    )
    backoff_seconds: BackoffConfig = BackoffConfig()
    non_retryable_exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = Field(
        default_factory=list, description="container exit codes that fail the job at once"
    )
    hang_timeout_seconds: int = Field(
        1800, ge=60, description="no step progress for this long counts as a hang"
    )
    node_lost_grace_seconds: int = Field(
        60, ge=5, description="a node NotReady/unreachable this long counts as lost"
    )
    stop_grace_seconds: int = Field(
        120,
        ge=5,
        description="how long a trainer has after SIGTERM (pod deleted: preemption, drain, "
        "suspend, a planned restart) to finish its step and write an emergency checkpoint",
    )
    start_timeout_seconds: int = Field(
        900,
        ge=10,
        description="the longest an attempt may take from creating its pods to the trainer's "
        "first step (scheduling, image pulls, imports, rendezvous); then it is restarted",
    )
    stragglers: StragglersConfig = StragglersConfig()
    quarantine_after_failures: int = Field(
        2,
        ge=1,
        description="a node blamed for this many failures within quarantineSeconds (node lost "
        "or NotReady, device/NCCL/InfiniBand errors; never a crash of the trainer's own code) "
        "is avoided by later placements of the job",
    )
    quarantine_seconds: int = Field(
        3600,
        ge=60,
        description="how long a quarantine lasts at least, and the window its failures are "
        "counted in",
    )
    quarantine_ready_seconds: int = Field(
        300,
        ge=0,
        description="after quarantineSeconds, the node is lifted once it has been Ready this long",
    )
    placement_timeout_seconds: int = Field(
        1800,
        ge=60,
        description="how long an attempt waits for nodes it can be placed on (condition Placed "
        "False) before the job fails with the reason",
    )


class OmniTrainingJobSpec(Spec):
    """``spec`` of an OmniTrainingJob: the trainer config plus where and how it runs."""

    trainer: TrainerConfig
    image: str = Field(DEFAULT_IMAGE, min_length=1, description="trainer container image")
    nodes: int = Field(1, ge=1, description="pods, one per node")
    spare_nodes: int = Field(
        0,
        ge=0,
        le=64,
        description="hot spares: standby pods kept running (scheduled, image pulled, trainer "
        "imported) on other nodes of the job's network domains; a lost node's rank moves to "
        "one of them without a scheduling round trip (the other pods restart in place), and "
        "the operator schedules a new spare in the background (node rank 0 too: the "
        "rendezvous address follows its label). Needs restartPolicy.mode in-place",
    )
    gpus_per_node: int = Field(
        8, ge=0, description="GPUs (= trainer processes) per node; 0: one CPU process per pod"
    )
    resources: ResourcesConfig = ResourcesConfig()
    topology: TopologyConfig = TopologyConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    nccl: NcclConfig = NcclConfig()
    restart_policy: RestartPolicyConfig = RestartPolicyConfig()
    preflight: PreflightConfig = PreflightConfig()
    suspend: bool = Field(False, description="delete the pods and keep the job (resumable)")
    env_from: list[EnvFromSource] = Field(
        default_factory=list,
        description="Secrets (or ConfigMaps) whose keys become the trainer's environment, e.g. "
        "S3 credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)",
    )
    volumes: list[VolumeConfig] = Field(
        default_factory=list,
        description="PersistentVolumeClaims mounted in every trainer pod (datasets, models, "
        "checkpoints on shared storage)",
    )
    image_pull_secrets: list[Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=253)]] = Field(
        default_factory=list, description="Secrets to pull the trainer image with"
    )

    @property
    def procs_per_node(self) -> int:
        """Trainer processes per pod: one per GPU, or one on a CPU-only pod."""
        return max(self.gpus_per_node, 1)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def group_size(self) -> int:
        """Nodes per reorder group (the whole job when unset)."""
        return self.topology.reorder_group_size or self.nodes

    def trainer_reorder_group(self) -> int | None:
        """Data-parallel ranks per reorder group that match ``topology.reorderGroupSize``.

        Stages fill whole nodes and megatron numbers data-parallel ranks along them, so G
        consecutive nodes of a stage hold G x procs_per_node / tensor consecutive data-parallel
        ranks; a group of a stage or more is the whole data-parallel group. None when the
        topology does not set a group or stages share nodes.
        """
        par = self.trainer.parallelism
        if self.topology.reorder_group_size is None or self.nodes % par.pipeline:
            return None
        per_stage = self.nodes // par.pipeline
        dp = self.world_size // (par.tensor * par.pipeline * par.context)
        if self.group_size >= per_stage:
            return dp
        return self.group_size * self.procs_per_node // (par.tensor * par.context)

    @model_validator(mode="after")
    def _check_layout(self, info: ValidationInfo) -> OmniTrainingJobSpec:
        local_world = (info.context or {}).get(LOCAL_WORLD)
        problems = (
            layout_problems(self) if local_world is None else local_problems(self, local_world)
        )
        if problems:
            raise _errors(type(self).__name__, problems)
        return self


Loc = tuple[str | int, ...]
_TP: Loc = ("trainer", "parallelism", "tensor")
_PP: Loc = ("trainer", "parallelism", "pipeline")


def layout_problems(spec: OmniTrainingJobSpec) -> list[tuple[Loc, str]]:
    """Cross-field problems of a spec, each with the path (relative to ``spec``) to change."""
    par = spec.trainer.parallelism
    tp, pp, cp = par.tensor, par.pipeline, par.context
    g, n = spec.procs_per_node, spec.nodes
    model = tp * pp * cp
    out: list[tuple[Loc, str]] = []
    if tp > g or g % tp:
        out.append(
            (
                _TP,
                f"tensor ({tp}) must divide the processes per node ({g} = gpusPerNode) so "
                "that each tensor-parallel and encoder sequence-parallel group stays inside "
                "one node",
            )
        )
    if spec.world_size % model:
        out.append(
            (
                ("nodes",),
                f"nodes x gpusPerNode ({n} x {g} = {spec.world_size}) must be a multiple of "
                f"trainer.parallelism tensor x pipeline x context ({tp} x {pp} x {cp} = "
                f"{model})",
            )
        )
    elif n % pp and pp % n:
        out.append(
            (
                _PP,
                f"pipeline ({pp}) and nodes ({n}) must divide one another so that every "
                "pipeline stage occupies whole nodes (or every node whole stages)",
            )
        )
    G = spec.group_size
    if n % G:
        out.append(
            (
                ("topology", "reorderGroupSize"),
                f"reorderGroupSize ({G}) must divide nodes ({n})",
            )
        )
    elif n % pp == 0 and (n // pp) % G and G % (n // pp):
        per_stage = n // pp
        out.append(
            (
                ("topology", "reorderGroupSize"),
                f"reorderGroupSize ({G}) must divide or be a multiple of the nodes per "
                f"pipeline stage ({n} / pipeline {pp} = {per_stage}), so a group never "
                "straddles a stage boundary",
            )
        )
    derived, asked = spec.trainer_reorder_group(), spec.trainer.data.reorder.group_size
    if derived is not None and asked not in (1, derived):
        out.append(
            (
                ("trainer", "data", "reorder", "groupSize"),
                f"groupSize ({asked}) disagrees with topology.reorderGroupSize "
                f"({spec.topology.reorder_group_size} nodes = {derived} data-parallel ranks); "
                "leave groupSize unset (the operator derives it) or make them agree",
            )
        )
    if not out:  # the trainer's own checks assume a consistent world size
        out.extend(_trainer_problems(spec, spec.world_size, "nodes x gpusPerNode"))
    fast = spec.trainer.checkpoint.fast if spec.trainer.checkpoint else None
    if fast is not None and (msg := fast_path_problem(fast.path, allowed_prefixes())):
        out.append((("trainer", "checkpoint", "fast", "path"), msg))  # a hostPath on the node
    return out + _cluster_settings_problems(spec)


def local_problems(spec: OmniTrainingJobSpec, world_size: int) -> list[tuple[Loc, str]]:
    """A local run (``omni train --nproc N``) ignores placement: the trainer's layout at N
    processes, plus the settings checks that hold wherever the job runs."""
    return _trainer_problems(spec, world_size, "--nproc") + _cluster_settings_problems(spec)


def _cluster_settings_problems(spec: OmniTrainingJobSpec) -> list[tuple[Loc, str]]:
    """Scheduling and environment settings that contradict each other."""
    out = _scheduling_problems(spec) + _in_place_problems(spec)
    out += [(("volumes", i, field), msg) for i, field, msg in volume_problems(spec.volumes)]
    return out + _nccl_env_problems(spec.nccl.env)


def _scheduling_problems(spec: OmniTrainingJobSpec) -> list[tuple[Loc, str]]:
    """Gang admission by Kueue or Volcano, their queues and topology-aware scheduling."""
    out: list[tuple[Loc, str]] = []
    sched = spec.scheduling
    if sched.kueue_queue and sched.volcano_gang:
        out.append(
            (
                ("scheduling", "kueueQueue"),
                "kueueQueue and volcanoGang both ask for gang admission; choose one",
            )
        )
    if sched.volcano_gang and sched.scheduler_name not in (None, "volcano"):
        out.append(
            (
                ("scheduling", "schedulerName"),
                f"volcanoGang needs the Volcano scheduler; schedulerName is "
                f"{sched.scheduler_name!r} (leave it unset or set 'volcano')",
            )
        )
    if sched.volcano_queue and not sched.volcano_gang:
        out.append(
            (
                ("scheduling", "volcanoQueue"),
                "volcanoQueue is the queue of the Volcano PodGroup; set volcanoGang true or "
                "remove volcanoQueue",
            )
        )
    if sched.topology_aware and not (sched.kueue_queue or sched.volcano_gang):
        out.append(
            (
                ("scheduling", "topologyAware"),
                "topologyAware hands the layout's network constraints to Kueue or Volcano; set "
                "kueueQueue or volcanoGang, or remove topologyAware (the operator's own "
                "placement keeps them without it)",
            )
        )
    elif sched.topology_aware and not spec.topology.network_domain_labels:
        out.append(
            (
                ("topology", "networkDomainLabels"),
                "scheduling.topologyAware derives the topology levels from these labels; list "
                "the node labels of the cluster's network domains, coarse to fine (the levels "
                "of Kueue's Topology or the labels of Volcano's HyperNode tiers), or remove "
                "topologyAware",
            )
        )
    return out


def _in_place_problems(spec: OmniTrainingJobSpec) -> list[tuple[Loc, str]]:
    """Settings that work through the in-pod supervisor of ``restartPolicy.mode: in-place``."""
    if spec.restart_policy.mode == "in-place":
        return []
    out: list[tuple[Loc, str]] = []
    if spec.scheduling.placement == "scheduler":
        out.append(
            (
                ("scheduling", "placement"),
                "placement scheduler gives each pod its node rank after the scheduler bound "
                "it, through the in-pod supervisor of restartPolicy.mode in-place; set mode "
                "in-place or placement operator",
            )
        )
    if spec.spare_nodes:
        out.append(
            (
                ("spareNodes",),
                f"spareNodes {spec.spare_nodes} needs restartPolicy.mode in-place (the other "
                "pods restart in place with the spare); set mode in-place or spareNodes 0",
            )
        )
    return out


def _nccl_env_problems(env: dict[str, str]) -> list[tuple[Loc, str]]:
    """``nccl.env`` names that load other code or that the operator sets itself."""
    out: list[tuple[Loc, str]] = []
    for name in env:
        if name in LOADER_ENV or name.startswith(LOADER_ENV_PREFIXES):
            out.append(
                (
                    ("nccl", "env", name),
                    f"{name} makes the loader or an interpreter load other code; nccl.env takes "
                    "NCCL settings only: build it into spec.image instead",
                )
            )
        elif name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES):
            out.append(
                (
                    ("nccl", "env", name),
                    f"{name} is set by the operator (rank and rendezvous wiring); remove it",
                )
            )
    return out


def _trainer_problems(
    spec: OmniTrainingJobSpec, world_size: int, source: str
) -> list[tuple[Loc, str]]:
    """The trainer's layout checks (heads, layers, batch sizes) at ``world_size`` processes,
    which ``source`` sets."""
    world = f" (world size {world_size} = {source})"
    problems = [(p, msg + world) for p, msg in layout_problems_at(spec.trainer, world_size)]
    problems += length_problems(spec.trainer.data)[0]
    return [(("trainer", *path.split(".")), msg) for path, msg in problems]


def spec_warnings(spec: OmniTrainingJobSpec) -> list[tuple[Loc, str]]:
    """What a valid spec lets through but the user should know, each with the path (relative to
    ``spec``) to set: printed by ``omni validate``, ``render`` and ``train``; the operator keeps
    them in the job's conditions."""
    out: list[tuple[Loc, str]] = []
    if (
        spec.nodes > 1
        and spec.gpus_per_node > 0
        and spec.resources.rdma is None
        and "NCCL_IB_DISABLE" not in spec.nccl.env
    ):
        out.append(
            (
                ("resources", "rdma"),
                f"unset on a {spec.nodes}-node GPU job: pods get NCCL_IB_DISABLE=1 and NCCL "
                "talks between nodes over TCP sockets (a fraction of InfiniBand's bandwidth); "
                "set resources.rdma (the RDMA device plugin's resource, e.g. resourceName "
                "rdma/ib, count 1) for InfiniBand/RoCE, or nccl.env.NCCL_IB_DISABLE '1' to "
                "choose TCP",
            )
        )
    return out


def format_warnings(problems: list[tuple[Loc, str]]) -> list[str]:
    """``spec.<path>: <message>`` lines (paths as the manifest spells its fields)."""
    return [".".join(["spec", *map(str, loc)]) + f": {msg}" for loc, msg in problems]


class OmniTrainingJob(Spec):
    """A whole OmniTrainingJob object as the operator validates it."""

    model_config = Spec.model_config | {"extra": "ignore"}  # status, kopf bookkeeping
    api_version: Literal["omni.megascale.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["OmniTrainingJob"]
    metadata: Metadata
    spec: OmniTrainingJobSpec

    @field_validator("metadata")
    @classmethod
    def _name_fits_children(cls, v: Metadata) -> Metadata:
        # Pods are <name>-node-<rank> (hostnames <= 63) and the Service is <name>
        # (an RFC 1035 label: it starts with a letter).
        if len(v.name) > 50:
            msg = (
                f"{v.name!r} is {len(v.name)} characters; at most 50 leave room for the pod "
                "suffix -a<attempt>-n<rank>"
            )
            raise _errors("Metadata", [(("name",), msg)])
        if not v.name[0].isalpha():
            raise _errors("Metadata", [(("name",), f"{v.name!r} must start with a letter")])
        return v


def _errors(title: str, problems: list[tuple[Loc, str]]) -> ValidationError:
    """A ValidationError with one entry per problem at its own path (relative to the model
    being validated; pydantic prefixes the parents' path)."""
    return ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(
                type=PydanticCustomError("semantic", "{msg}", {"msg": msg}), loc=loc, input=None
            )
            for loc, msg in problems
        ],
    )


LOCAL_WORLD = "local_world_size"


def parse_job(
    doc: Any, *, local_world_size: int | None = None, defer_hf: bool = True
) -> OmniTrainingJob:
    """Validate a whole OmniTrainingJob; :class:`ManifestError` lists every bad field path.

    The one validation of ``omni validate``, ``omni render``, ``omni train`` and the operator.
    ``local_world_size``: a local run on that many processes (``omni train --nproc``), whose
    layout is checked at that size instead of ``nodes x gpusPerNode``. ``defer_hf``: leave
    ``model.llm.hf`` unread (the operator's case: the model lives on the pods' storage).
    """
    if not isinstance(doc, dict):
        raise ManifestError("the manifest must be a mapping with apiVersion, kind, spec")
    try:
        context = {LOCAL_WORLD: local_world_size, DEFER_HF: defer_hf}
        return OmniTrainingJob.model_validate(doc, context=context)
    except ValidationError as err:
        raise ManifestError(format_errors(err, OmniTrainingJob)) from None

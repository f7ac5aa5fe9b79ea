"""The operator's ``omni`` subcommands (registered through the ``omni.commands`` entry point)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import yaml

if TYPE_CHECKING:
    from omni_operator.sandbox.cluster import Sandbox, SandboxConfig


def register(app: typer.Typer) -> None:
    """Add the operator's commands to ``omni``, and its validation of whole jobs to the
    trainer's commands (``omni validate``, ``omni train``)."""
    from omni_trainer.config import JOB_CHECKS

    if check_job not in JOB_CHECKS:
        JOB_CHECKS.append(check_job)
    app.command(name="render")(render)
    app.command(name="operator")(operator)
    app.add_typer(sandbox, name="sandbox")


def check_job(doc: Any, local_world_size: int | None, defer_hf: bool) -> list[str]:
    """The operator's validation of a whole job (:func:`omni_operator.spec.parse_job`) and its
    warnings (:func:`omni_operator.spec.spec_warnings`)."""
    from omni_operator.spec import format_warnings, parse_job, spec_warnings

    job = parse_job(doc, local_world_size=local_world_size, defer_hf=defer_hf)
    return format_warnings(spec_warnings(job.spec))


sandbox = typer.Typer(
    help="A cluster on this machine: emulated API server and GPU nodes whose pods really run, "
    "the operator, and fault injection. Real kubectl works against it.",
    no_args_is_help=True,
)
SandboxDir = Annotated[
    Path, typer.Option("--dir", help="sandbox state: kubeconfig, pod volumes and logs")
]
SandboxImages = Annotated[
    list[str] | None,
    typer.Option(
        help="an image the nodes can pull (repeatable); default: the images of examples/ "
        "and the chart. Pods naming others fail with ErrImagePull, then ImagePullBackOff"
    ),
]
PullSeconds = Annotated[
    float,
    typer.Option(
        min=0,
        help="how long a node takes to pull an image it does not hold yet (each node "
        "keeps what it pulled: a pod recreated on a fresh node pays it, one restarted in "
        "place does not); 0: instant",
    ),
]
SyncSeconds = Annotated[
    float,
    typer.Option(
        min=0.1,
        help="the kubelets' syncFrequency: a running pod's ConfigMap volumes follow a "
        "ConfigMap update this late at worst, unless the pod itself is updated (a real "
        "kubelet's default: 60)",
    ),
]
CrashBackoffSeconds = Annotated[
    float,
    typer.Option(
        min=0.1,
        help="the kubelets' first back-off of a crashing container (CrashLoopBackOff; "
        "doubling to 30x, reset after a container ran 60x): a real kubelet's is 10",
    ),
]
RunOperator = Annotated[
    bool,
    typer.Option(
        help="run the operator in the sandbox's process; --no-operator: none runs until "
        "one is started beside it, the chart's (`omni sandbox install-chart`: its "
        "Deployment's pod) or your own (`omni operator --standalone --server URL`, which "
        "can be SIGKILLed and started again as a Deployment replaces its pod)"
    ),
]


@sandbox.command("up")
def sandbox_up(
    nodes: Annotated[int, typer.Option(min=1, help="emulated nodes")] = 4,
    gpus_per_node: Annotated[int, typer.Option(min=0, help="nvidia.com/gpu per node")] = 8,
    spines: Annotated[int, typer.Option(min=1, help="network domains (spine labels)")] = 2,
    port: Annotated[int, typer.Option(min=0, help="API server port (0: any free)")] = 0,
    workdir: SandboxDir = Path(".omni-sandbox"),
    resync: Annotated[float, typer.Option(min=0.1, help="operator resync seconds")] = 2.0,
    image: SandboxImages = None,
    pull_seconds: PullSeconds = 0.0,
    sync_seconds: SyncSeconds = 60.0,
    crash_backoff_seconds: CrashBackoffSeconds = 1.0,
    operator: RunOperator = True,
) -> None:
    """Run the sandbox until Ctrl-C: pods run as local processes in this directory."""
    import asyncio
    import logging

    from omni_operator.sandbox.cluster import DEFAULT_IMAGES, SandboxConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("kopf").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    config = SandboxConfig(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        spines=spines,
        port=port,
        workdir=workdir,
        resync_seconds=resync,
        images=tuple(image or DEFAULT_IMAGES),
        pull_seconds=pull_seconds,
        sync_seconds=sync_seconds,
        crash_backoff_seconds=crash_backoff_seconds,
        operator=operator,
    )
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        asyncio.run(_run_sandbox(config))


async def _run_sandbox(config: SandboxConfig) -> None:
    """Start the sandbox, print how to use it, and run it until its parts end or, without the
    operator (whose kopf stops on SIGINT/SIGTERM), until one of those signals."""
    import asyncio
    import signal

    from omni_operator.sandbox.cluster import Sandbox

    async with Sandbox.start(config) as sb:
        typer.echo(_sandbox_banner(sb), err=True)
        if config.operator:
            await sb.wait()  # kopf stops the operator on SIGINT/SIGTERM
            return
        stop = asyncio.Event()  # no kopf to catch the signals: stop on them here
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        waiting = asyncio.ensure_future(stop.wait())
        parts = asyncio.ensure_future(sb.wait())
        await asyncio.wait({waiting, parts}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if parts.done():
            parts.result()
        parts.cancel()


def _sandbox_banner(sb: Sandbox) -> str:
    """What ``omni sandbox up`` prints once the sandbox runs: its address, nodes and registry,
    and the commands to use it."""
    config, workdir = sb.config, sb.config.workdir
    install = (
        ""
        if config.operator
        else f"  omni sandbox install-chart --dir {workdir}   # the operator, by Helm\n"
        f"    (or your own: omni operator --standalone --server {sb.url})\n"
    )
    return (
        f"sandbox up: API server {sb.url}, nodes "
        f"{', '.join(n.name for n in sb.kubelet.nodes)}\n"
        f"  registry: {', '.join(config.images)} (a node pulls one in "
        f"{config.pull_seconds:g} s)\n"
        f"  export KUBECONFIG={sb.kubeconfig_path}\n"
        f"{install}"
        "  kubectl apply -f examples/tiny-cpu.yaml\n"
        "  kubectl get otj -w     # pod logs: kubectl logs POD, or "
        f"{workdir}/logs/\n"
        f"  omni sandbox fault node-lost NODE --dir {workdir}\n"
        "Ctrl-C stops the sandbox and every pod."
    )


@sandbox.command("install-chart")
def sandbox_install_chart(
    release: Annotated[str, typer.Option(help="the Helm release name")] = "omni",
    namespace: Annotated[
        str, typer.Option("--namespace", "-n", help="the release's namespace (created)")
    ] = "omni-system",
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="a chart value, as `helm install --set` takes it (repeatable)"),
    ] = None,
    values: Annotated[Path | None, typer.Option("--values", "-f", help="a values file")] = None,
    chart: Annotated[
        Path | None, typer.Option(help="the chart (default: charts/megascale-omni)")
    ] = None,
    workdir: SandboxDir = Path(".omni-sandbox"),
) -> None:
    """`helm install` the chart into a running sandbox (Helm's Go SDK, the sandbox's
    kubeconfig): its operator runs as the Deployment's pod; start the sandbox with
    --no-operator so that it is the only one."""
    from omni_operator.sandbox.chart import CHART_DIR, install_chart, merge, set_values
    from omni_operator.sandbox.control import read_state

    try:
        state = read_state(workdir)
    except RuntimeError as err:
        _fail(str(err), code=1)
    given = (_read_yaml(values) or {}) if values else {}
    try:
        release_info = install_chart(
            Path(state["kubeconfig"]),
            chart=chart or CHART_DIR,
            release=release,
            namespace=namespace,
            values=merge(given, set_values(set_ or [])),
        )
    except Exception as err:  # Helm's errors (HelmError and kin): said, exit 1
        _fail(f"helm install {release}: {err}", code=1)
    typer.echo(
        f"release {release} {release_info.get('status')} in namespace {namespace} "
        f"(revision {release_info.get('revision')})\n"
        f"  kubectl -n {namespace} rollout status deploy   # the operator's pod Ready"
    )
    typer.echo(release_info.get("notes") or "")


@sandbox.command("fault")
def sandbox_fault(
    fault: Annotated[
        str,
        typer.Argument(
            help="node-lost | node-ready | degrade-network | kill-pod | crash-pod | hang-pod "
            "| throttle-pod | unthrottle-pod"
        ),
    ],
    target: Annotated[str, typer.Argument(help="the node or pod name")],
    namespace: Annotated[str, typer.Option("--namespace", "-n", help="the pod's namespace")] = (
        "default"
    ),
    workdir: SandboxDir = Path(".omni-sandbox"),
) -> None:
    """Inject a fault into a running sandbox (through an annotation its kubelet acts on)."""
    from omni_operator.sandbox.control import FAULTS, inject_fault, read_state

    if fault not in FAULTS:
        _fail(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}", code=2)
    try:
        state = read_state(workdir)
        done = inject_fault(state["server"], fault, target, namespace=namespace)
    except (RuntimeError, OSError) as err:
        _fail(str(err), code=1)
    typer.echo(done)


def operator(
    standalone: Annotated[
        bool, typer.Option(help="no peering (one operator; tests, the sandbox)")
    ] = False,
    peering: Annotated[
        str | None, typer.Option(help="kopf peering object: replicas sharing it never both act")
    ] = None,
    priority: Annotated[int, typer.Option(help="peering priority (the highest one acts)")] = 0,
    namespace: Annotated[
        list[str] | None, typer.Option(help="namespace to watch (repeatable); default: all")
    ] = None,
    server: Annotated[
        str | None, typer.Option(help="API server URL without credentials (sandbox emulator)")
    ] = None,
    liveness: Annotated[
        str | None, typer.Option(help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    ] = None,
    verbose: Annotated[bool, typer.Option(help="debug logging")] = False,
) -> None:
    """Run the OmniTrainingJob operator (kopf) until interrupted.

    The same as `kopf run -m omni_operator.handlers` with these options; credentials come from
    the service account in a pod, else from the kubeconfig.
    """
    import asyncio
    import logging
    import os

    import kopf

    if server:
        os.environ["OMNI_API_SERVER"] = server
    import omni_operator.handlers  # noqa: F401  (registers the handlers with kopf)

    kopf.configure(verbose=verbose)
    if not verbose:
        logging.getLogger().setLevel(logging.INFO)
    asyncio.run(
        kopf.operator(
            standalone=standalone,
            peering_name=peering,
            priority=priority,
            clusterwide=not namespace,
            namespaces=namespace or (),
            liveness_endpoint=liveness,
        )
    )


def render(
    manifest: Annotated[Path, typer.Argument(help="OmniTrainingJob YAML")],
    nodes: Annotated[
        Path, typer.Option(help="Nodes as YAML: `kubectl get nodes -o yaml` or Node documents")
    ],
    attempt: Annotated[int, typer.Option(min=0, help="restart attempt to render")] = 0,
    quarantine: Annotated[list[str] | None, typer.Option(help="node to avoid (repeatable)")] = None,
    namespace: Annotated[
        str | None, typer.Option(help="namespace when the manifest has none")
    ] = None,
) -> None:
    """Print the objects the operator would create on these nodes, placement explained.

    Like `helm template`: YAML documents on stdout, the placement as comments at the top.
    """
    from omni_operator.placement import PlacementError, place
    from omni_operator.render import render_all
    from omni_operator.spec import format_warnings, parse_job, spec_warnings
    from omni_trainer.config import ManifestError

    try:
        doc = _read_yaml(manifest)
        if namespace and isinstance(doc, dict):
            doc.setdefault("metadata", {}).setdefault("namespace", namespace)
        job = parse_job(doc)
    except ManifestError as err:
        _fail(f"{manifest}: invalid OmniTrainingJob\n{err}", code=2)
    for line in format_warnings(spec_warnings(job.spec)):
        typer.echo(f"warning: {line}", err=True)
    try:
        node_objs = load_nodes(nodes)
    except ValueError as err:
        _fail(f"{nodes}: {err}", code=2)
    try:
        placement = place(node_objs, job.spec, quarantined=quarantine or ())
    except PlacementError as err:
        _fail(f"{manifest}: cannot be placed on {nodes}\n{err}", code=1)
    header = [
        f"OmniTrainingJob {job.metadata.name}: {job.spec.nodes} nodes x "
        f"{job.spec.procs_per_node} processes, attempt {attempt}",
        *placement.explain().splitlines(),
    ]
    if job.spec.scheduling.placement == "scheduler":
        header.append("placement scheduler: the pods name no node (the layout above fits); "
                      "ranks follow the nodes the scheduler binds them to")  # fmt: skip
    typer.echo("\n".join(f"# {line}" for line in header))
    for obj in render_all(job, placement, attempt=attempt, quarantined=quarantine or ()):
        typer.echo("---")
        typer.echo(dump_yaml(obj), nl=False)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's manifest) as literal blocks, readable in a terminal."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100)


def load_nodes(path: Path) -> list[dict[str, Any]]:
    """Node objects from a NodeList/List document or a stream of Node documents."""
    out: list[dict[str, Any]] = []
    try:
        docs = list(yaml.safe_load_all(_read_text(path)))
    except yaml.YAMLError as err:
        raise ValueError(f"not valid YAML: {err}") from None
    for doc in docs:
        if not doc:
            continue
        items = doc.get("items") if isinstance(doc, dict) and "items" in doc else [doc]
        for item in items:
            if not isinstance(item, dict) or item.get("kind", "Node") != "Node":
                raise ValueError(f"expected Node objects, found {str(item)[:80]!r}")
            if not (item.get("metadata") or {}).get("name"):
                raise ValueError("a Node without metadata.name")
            out.append(item)
    return out


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as err:
        _fail(f"{path}: {err.strerror or err}", code=2)


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(_read_text(path))
    except yaml.YAMLError as err:
        _fail(f"{path}: not valid YAML: {err}", code=2)


def _fail(message: str, *, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)

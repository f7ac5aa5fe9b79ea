"""``omni``: the command line. It takes run-time choices only; job settings live in the manifest."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from omni_trainer.cli_common import ManifestArg, err_console, fail, load_job
from omni_trainer.config import ManifestError, load_manifest
from omni_trainer.launch import silence_known_noise

if TYPE_CHECKING:
    from omni_trainer.checkpoint.config import CheckpointConfig

app = typer.Typer(
    help="MegaScale-Omni: multimodal LLM training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _warn(job) -> None:
    """What the manifest lets through but changes the data or the network, said before anything
    runs."""
    from omni_trainer.distributed.layout import manifest_warnings

    for line in [*manifest_warnings(job.spec.trainer), *job.job_warnings]:
        err_console.print("[bold yellow]warning:[/bold yellow] ", end="")
        err_console.print(line, markup=False)


@app.command()
def validate(
    manifest: ManifestArg,
    nproc: Annotated[
        int | None,
        typer.Option(
            min=1, help="check a local run on this many processes (default: the cluster fields)"
        ),
    ] = None,
    sources: Annotated[
        bool,
        typer.Option(
            "--sources",
            help="also open every data source and the checkpoint storage, with this "
            "machine's credentials",
        ),
    ] = False,
) -> None:
    """Check a whole manifest without starting anything (the operator's checks, cluster fields
    included); every problem is listed with its field path and the fix."""
    # Without --sources nothing is opened, the HF model either (as the operator cannot).
    job = load_job(manifest, whole=True, local_world_size=nproc, defer_hf=not sources)
    cfg = job.spec.trainer
    _warn(job)
    for field, part in cfg.model.unread_hf():
        err_console.print("[bold yellow]note:[/bold yellow] ", end="")
        err_console.print(
            f"spec.trainer.model.{field}.hf ({part.hf}) was not read: the checks that need "
            "its dimensions run with --sources, and in every pod before training",
            markup=False,
        )
    if sources:
        try:
            _check_sources(cfg)
        except ManifestError as err:
            raise fail(f"{manifest}: {err}") from None
    where = f"--nproc {nproc}" if nproc else "its cluster fields"
    typer.echo(
        f"{manifest}: valid OmniTrainingJob {job.metadata.name!r} on {where} "
        f"(modalities: {', '.join(cfg.model.modalities)}; "
        f"{len(cfg.data.sources)} sources; {cfg.train.steps} steps)"
    )


@app.command()
def train(
    manifest: ManifestArg,
    steps: Annotated[
        int | None, typer.Option(min=1, help="override spec.trainer.train.steps")
    ] = None,
    nproc: Annotated[int, typer.Option(min=1, help="local processes (one per GPU on GPUs)")] = 1,
    summary: Annotated[Path | None, typer.Option(help="write a JSON summary here")] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            envvar="OMNI_RESUME",
            help="auto: continue from the latest complete checkpoint (if any); none: start "
            "fresh, over an earlier run's checkpoints; unset, a run whose checkpoint.path "
            "holds an earlier run's checkpoints stops and asks which",
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            envvar="OMNI_METRICS_PORT",
            help="serve Prometheus metrics on this port (first process of the machine)",
        ),
    ] = None,
) -> None:
    """Train the manifest's job on this machine (torchrun: gloo on CPU, NCCL on GPUs)."""
    from omni_trainer.launch import inside_torchrun, launch_torchrun, run_worker

    if resume not in ("auto", "none", None):
        raise fail(f"--resume must be 'auto' or 'none', not {resume!r}")
    # Every rank of torchrun re-enters here: the manifest is checked at the world it runs in,
    # and before torchrun starts at --nproc, so a bad manifest is reported once.
    world = int(os.environ["WORLD_SIZE"]) if inside_torchrun() else nproc
    with _fatal_to_termination_log():
        job = load_manifest(manifest, whole=True, local_world_size=world)
        if not inside_torchrun():
            _warn(job)
        # Once per machine (a pod, or this launcher), before the process group forms.
        if os.environ.get("LOCAL_RANK", "0") == "0" and not os.environ.get(SOURCES_CHECKED):
            _check_sources(job.spec.trainer, for_export=False)
        if resume is None and not inside_torchrun():  # pods and workers always say which
            _refuse_overwrite(job.spec.trainer.checkpoint)
        if nproc > 1 and not inside_torchrun():
            forwarded = [
                *(["--steps", str(steps)] if steps else []),
                *(["--summary", str(summary)] if summary else []),
                "--resume",
                resume or "none",
            ]
            checked = {SOURCES_CHECKED: "1"}  # the local workers need not check again
            raise typer.Exit(
                launch_torchrun(manifest, nproc=nproc, forwarded=forwarded, env=checked)
            )
        result = run_worker(
            job,
            steps=steps,
            summary_path=summary,
            resume=resume == "auto",
            metrics_port=metrics_port,
        )
    if result and _is_rank0():
        from omni_trainer.termination import final_report, report

        report(final_report(result))
        _print_summary(result)


SOURCES_CHECKED = "OMNI_SOURCES_CHECKED"


def _refuse_overwrite(cfg: CheckpointConfig | None) -> None:
    """A fresh local run stops before it overwrites an earlier run's checkpoints."""
    from omni_trainer.checkpoint.earlier_run import earlier_run

    problem = earlier_run(cfg)
    if problem is not None:
        raise ManifestError(problem)


def _check_sources(cfg, *, for_export: bool = True) -> None:
    """Data sources and checkpoint storage reachable, or one ManifestError naming each cause
    (``preflight.check_sources``)."""
    from omni_trainer.preflight import check_sources

    found = check_sources(cfg, for_export=for_export)
    for line in found.warnings:
        err_console.print("[bold yellow]warning:[/bold yellow] ", end="")
        err_console.print(line, markup=False)
    if found.problems:
        raise ManifestError("the job's storage:\n" + "\n".join(found.problems))


@contextlib.contextmanager
def _fatal_to_termination_log() -> Iterator[None]:
    """A fatal error of ``omni train`` also goes to the container's termination message, which
    the operator puts into the job's status (``omni_trainer.termination``)."""
    from omni_trainer.termination import fatal_message, report

    try:
        yield
    except typer.Exit:  # torchrun's exit status: its workers reported for themselves
        raise
    except ManifestError as err:
        report(str(err))
        raise fail(str(err)) from None
    except Exception as err:
        report(fatal_message(err))
        raise


@app.command()
def plan(
    manifest: ManifestArg,
    world: Annotated[
        int | None, typer.Option(min=1, help="world size (default: the model-parallel size)")
    ] = None,
    step: Annotated[int, typer.Option(min=0, help="which training step's batch to plan")] = 0,
    policy: Annotated[str | None, typer.Option(help="compare another insertion policy")] = None,
    tune: Annotated[bool, typer.Option("--tune", help="search the parallel configuration")] = False,
    device: Annotated[
        str | None,
        typer.Option(
            help="--tune: GPU profile (H100, H200, GH200, A100); default: the GPU product the "
            "manifest's nodeSelector names, else H100"
        ),
    ] = None,
    gpus: Annotated[
        int | None, typer.Option(min=1, help="GPUs for --tune (default --world)")
    ] = None,
    proxy_gpus: Annotated[
        int | None,
        typer.Option(min=1, help="--tune: cap the proxy cluster proposed for validation"),
    ] = None,
) -> None:
    """Show where each encoder micro-batch runs in the LLM pipeline (the dataflow table), or with
    ``--tune`` predict the best parallel configurations for a cluster, and propose a proxy
    (fewer data-parallel replicas, the same replica) to validate the choice on a small cluster."""
    from omni_trainer.multiplex.dataflow.display import format_dataflow
    from omni_trainer.multiplex.dataflow.plan import POLICIES
    from omni_trainer.plan import plan_step

    job = load_job(manifest)
    cfg = job.spec.trainer
    if policy is not None and policy not in POLICIES:
        raise fail(f"--policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    p = cfg.parallelism
    if tune:
        _tune(
            cfg,
            name=job.metadata.name,
            gpus=gpus or world or p.tensor * p.pipeline,
            proxy_gpus=proxy_gpus,
            device_name=device,
            cluster=job.spec.model_extra,
        )
        return
    world = world or p.tensor * p.pipeline * p.context
    try:
        result = plan_step(cfg, world_size=world, step=step, policy=policy)
    except ManifestError as err:
        raise fail(str(err)) from None
    sim = result.simulation
    typer.echo(
        f"layout {result.dims.describe()} (world {world}); encoder items: "
        f"{result.data_parallel_items} data-parallel, {result.sequence_parallel_items} "
        f"sequence-parallel (eta {p.encoder.eta} tokens); replica 0, step {step}"
    )
    typer.echo(format_dataflow(result.table))
    typer.echo(
        f"time model (LLM forward op = 1, backward = 2): makespan {sim['makespan']:.2f}, "
        f"bubbles {sim['bubble_fraction']:.1%}"
    )
    for st in sim["stages"]:
        typer.echo(
            f"  stage {st['stage']}: encoder {st['encoder']:.2f}  llm {st['llm']:.2f}  "
            f"idle {st['idle']:.2f}  peak live encoder work {st['peak_encoder_activations']:.2f}"
        )


@app.command("export")
def export_cmd(
    manifest: ManifestArg,
    out: Annotated[Path, typer.Option(help="new directory for the Hugging Face model")],
    checkpoint: Annotated[
        str | None,
        typer.Option(
            help="a checkpoint root or one step-NNNNNNNN directory (default: the latest "
            "complete checkpoint under checkpoint.path)"
        ),
    ] = None,
    initial_weights: Annotated[
        bool,
        typer.Option(
            "--initial-weights",
            help="with no checkpoint, write the untrained weights the job starts from",
        ),
    ] = False,
) -> None:
    """Write the model as a Hugging Face model (safetensors, config.json, tokenizer files) in
    the family it was imported from (Llama for presets), from a checkpoint of any layout."""
    from omni_trainer.checkpoint.earlier_run import no_checkpoint
    from omni_trainer.interop.export import check_export, write_hf
    from omni_trainer.interop.runtime import resolve_checkpoint, single_process_model

    cfg = load_job(manifest).spec.trainer
    try:
        check_export(cfg, out)  # before any weight is allocated
        if not initial_weights and resolve_checkpoint(cfg, checkpoint) is None:
            raise fail(no_checkpoint(cfg.checkpoint))
        with single_process_model(cfg, checkpoint=checkpoint) as (model, step):
            result = write_hf(model, cfg, out, step=step)
    except (ValueError, OSError) as err:
        raise fail(str(err)) from None
    source = f"checkpoint step {step}" if step is not None else "initial weights"
    typer.echo(
        f"exported {source}: {result.tensors} tensors, {result.bytes / 2**20:,.1f} MiB -> {out} "
        f"({', '.join(result.files)})"
    )
    for part in result.skipped:
        err_console.print(f"note: not exported: {part}", markup=False)


@app.command()
def generate(
    manifest: ManifestArg,
    prompt: Annotated[str, typer.Option(help="one user turn (or the raw text with --raw)")],
    checkpoint: Annotated[
        str | None, typer.Option(help="as for export (default: latest, else initial)")
    ] = None,
    image: Annotated[
        list[Path] | None, typer.Option(help="an image (repeat for several; <image> marks where)")
    ] = None,
    audio: Annotated[
        list[Path] | None, typer.Option(help="an audio clip (repeat; <audio> marks where)")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    raw: Annotated[bool, typer.Option("--raw", help="no chat template")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Greedy decoding with the job's model in one process."""
    import json

    from omni_trainer.interop.generate import generate as run

    cfg = load_job(manifest).spec.trainer
    try:
        result = run(
            cfg,
            prompt,
            checkpoint=checkpoint,
            images=image or [],
            audio=audio or [],
            raw=raw,
            max_new_tokens=max_new_tokens,
        )
    except (ValueError, OSError) as err:
        raise fail(str(err)) from None
    typer.echo(json.dumps(result.as_dict()) if as_json else result.output_text)


def _tune(
    cfg,
    *,
    name: str,
    gpus: int,
    proxy_gpus: int | None = None,
    device_name: str | None = None,
    cluster: dict | None = None,
) -> None:
    """Predict the job on ``gpus`` GPUs for many configurations; print the best few beside the
    manifest's own layout (ties share a rank), and a proxy configuration of the best to
    validate it on a small cluster."""
    import json
    import time

    from rich.progress import Progress

    from omni_trainer.planner.manifest import (
        device_for,
        manifest_fields,
        own_layout,
        tie_ranks,
        trainer_problems,
    )
    from omni_trainer.planner.simulate import predict
    from omni_trainer.planner.tune import layouts, propose_proxy, tune
    from omni_trainer.planner.workloads import workload_from_config

    try:
        device, source = device_for(device_name, cluster)
    except ValueError as err:
        raise fail(str(err)) from None
    started = time.perf_counter()
    workload = workload_from_config(cfg, world_size=gpus, name=name)
    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("simulating configurations", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what[:60])

        runnable = [  # only what ``omni train`` accepts with this manifest
            lay for lay in layouts(workload, device=device) if not trainer_problems(cfg, lay)
        ]
        best = [
            c
            for c in tune(workload, device=device, candidates=runnable, progress=progress)
            if not trainer_problems(cfg, c.layout, policy=c.prediction.policy)
        ]
        own, why = own_layout(cfg, gpus)
        mine = None
        if own is not None:
            policy = cfg.parallelism.encoder.policy
            mine = predict(workload, own, policy=policy, device=device)
    if not best:
        raise fail(f"no configuration of {name} fits in {device.name} memory on {gpus} GPUs")
    searched = time.perf_counter() - started
    console = Console()
    console.print(f"device: {device.name} ({source})", highlight=False)
    title = f"{name} on {gpus} x {device.name} (predicted; searched in {searched:.1f} s)"
    table = Table(title=title)
    for col in ("#", "layout", "policy", "tokens/s", "MFU", "step s", "stage-0 GiB"):
        table.add_column(col)
    ranks = tie_ranks([c.prediction.tokens_per_s for c in best])
    rows = [(rank, c.prediction) for rank, c in zip(ranks, best, strict=True)]
    if mine is not None:
        rows.append(("own", mine))
    for rank, pr in rows:
        oom = " (OOM)" if pr.oom else ""
        table.add_row(
            rank,
            pr.layout.describe() + oom,
            pr.policy,
            f"{pr.tokens_per_s:,.0f}",
            f"{pr.mfu:.1%}",
            f"{pr.step_time:.2f}",
            f"{pr.stage0_gib:.1f}",
        )
    console.print(table)
    for rank, c in zip(ranks, best, strict=True):
        console.print(f"{rank}. {c.reason}", highlight=False)
    top = best[0].prediction
    fields = manifest_fields(top.layout, policy=top.policy)
    console.print(f"#1 as spec.trainer fields: {json.dumps(fields)}", highlight=False)
    if mine is None:
        console.print(f"own: the manifest's layout is not scored ({why})", highlight=False)
    elif mine.oom:
        console.print(
            f"own: the manifest's layout ({mine.layout.describe()}) does not fit in "
            f"{device.name} memory; #1 does",
            highlight=False,
        )
    else:
        console.print(
            f"own: the manifest's layout ({mine.layout.describe()}, {mine.policy}): "
            f"{mine.tokens_per_s:,.0f} tokens/s; switching to #1 gains "
            f"{top.tokens_per_s / mine.tokens_per_s:.2f}x",
            highlight=False,
        )
    if workload.note:
        console.print(f"data: {workload.note}", highlight=False)
    try:
        proxy = propose_proxy(workload, top, device=device, max_gpus=proxy_gpus)
    except ValueError as err:
        raise fail(str(err)) from None
    console.print(proxy.reason, highlight=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def supervise(
    ctx: typer.Context,
    attempt_file: Annotated[
        Path, typer.Option(help="the file naming the restart attempt to run (from the operator)")
    ],
    state_dir: Annotated[
        Path, typer.Option(help="a directory that outlives the container (an emptyDir)")
    ],
    standby: Annotated[
        bool, typer.Option(help="a hot spare: warm up, then wait until the operator assigns it")
    ] = False,
    warm: Annotated[
        bool,
        typer.Option(
            help="keep a pre-imported trainer the workers fork from (omni_trainer.warm: the "
            "command runs `-m omni_trainer.warm`), so restarts skip the imports"
        ),
    ] = False,
    report_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="report a failed attempt over HTTP on this port (the pod's readinessProbe) and "
            "keep the container; without it, a failure ends the container",
        ),
    ] = None,
) -> None:
    """A trainer pod's init: run the command after `--` for the operator's restart attempt, and
    restart it in place when the operator names a newer one (restartPolicy.mode: in-place)."""
    from omni_trainer.failure_report import FailureReport
    from omni_trainer.pod_protocol import ATTEMPT_ENV
    from omni_trainer.supervisor import Supervisor

    if not ctx.args:
        raise fail("omni supervise needs the command to run after `--`")
    pods = int(os.environ.get(ATTEMPT_ENV, "0"))  # the attempt that created this pod
    report = None
    if report_port is not None:
        try:
            report = FailureReport(report_port, os.environ.get("OMNI_METRICS_ADDR", "0.0.0.0"))
        except OSError as err:
            raise fail(f"omni supervise --report-port={report_port}: {err}") from None
    code = Supervisor(ctx.args, attempt_file=attempt_file, state_dir=state_dir, pods=pods,
                      pod=os.environ.get("POD_NAME"), standby=standby, warm=warm,
                      report=report.start() if report else None).run()  # fmt: skip
    raise typer.Exit(code)


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _print_summary(s: dict) -> None:
    table = Table(title=f"summary: {s['job']}", show_header=False)
    rows = [
        (
            "steps",
            f"{s['steps']}" + (f" (resumed at {s['first_step']})" if s["first_step"] else ""),
        ),
        ("loss", f"{s['initial_loss']:.4f} -> {s['final_loss']:.4f}"),
        ("tokens/s", f"{s['tokens_per_second']:,.0f}"),
        (
            "MFU",
            f"{s['mfu']:.2%} of {s['peak_flops'] / 1e9:,.1f} GFLOP/s ({s['peak_flops_source']})",
        ),
        ("layout", f"{s['layout']['name']} (world {s['world_size']})"),
        ("samples", ", ".join(f"{k} {v}" for k, v in s["samples_per_modality"].items())),
        ("skipped", ", ".join(f"{k} {v}" for k, v in s.get("skipped_samples", {}).items()) or "0"),
        ("wall time", f"{s['wall_time_s']:.1f} s ({s['mean_step_time_s'] * 1e3:.0f} ms/step)"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def _register_plugins() -> None:
    """Commands of other installed parts (e.g. the operator's ``omni render``), found through the
    ``omni.commands`` entry point group so that the trainer never imports them itself."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="omni.commands"):
        try:
            register = ep.load()
        except ImportError as err:  # an optional part whose extra is not installed
            err_console.print(f"note: {ep.name} commands unavailable ({err})", markup=False)
            continue
        register(app)


def _add_data_commands() -> None:
    from omni_trainer.data_cli import data_app

    app.add_typer(data_app, name="data")


_add_data_commands()
_register_plugins()
silence_known_noise()  # before any command imports megatron-core

if __name__ == "__main__":
    app()

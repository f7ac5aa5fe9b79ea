"""``omni plan``: the dataflow table of one training step (where each encoder micro-batch runs
in the LLM pipeline) and its time model; with ``--tune``, the search of :mod:`.tune`."""

from __future__ import annotations

from typing import Annotated

import typer

from omni_trainer.cli.common import ManifestArg, fail, load_job
from omni_trainer.config import ManifestError


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
        from omni_trainer.cli.tune import run_tune

        run_tune(
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

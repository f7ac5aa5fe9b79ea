"""Insertion policies ranked: interleaved repeats, medians with min and max, paired ratios.

One torchrun launch of real processes (gloo, one compute thread each) trains the same job with every
policy in turn, A B C D B C D A C D A B ..., ``--repeats`` times: a burst of load from the other
users of the machine lands on all policies alike, each pair is compared within a repeat (adjacent in
time), and the order turns by one each repeat, so no policy always runs first (step times drift up
over a launch: about 10% in 6 repeats on this machine). Per policy and stage it prints the median
seconds per step in encoder work, LLM compute and waiting (for encoder outputs or gradients, and for
pipeline neighbours), the peak bytes encoder forwards keep for backward, the step time's median
(min, max), and for each pair ``X vs Y median step-time ratio R (min A, max B, N runs)`` with R =
Y's step time / X's in the same repeat (> 1: X faster). The loss curves of all runs must be equal.

Two predictions of the per-stage rows: ``planner`` (``omni plan``'s time model: op costs from
the cost model, one device per stage, one seconds-per-unit fit on LLM seconds) and ``replayed``
(:mod:`omni_trainer.multiplex.replay`: the executed tables with op seconds fit per stage and kind
on the encoder, LLM and data timers; this machine's cores shared by the runnable stages and the
cores the other processes kept busy (/proc/stat less this launch's CPU time); the p2p latency
from a ping-pong; op durations drawn from the op log's spread). Waits never enter a fit;
held-out compares the odd repeats' waits with a fit on the even ones, same-run each run with its
own.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("auto", "uniform", "front_loaded", "stage0")


def bench_job(pipeline: int, eta: int, encoder_scale: int = 1) -> dict:
    """An image-heavy job where the encoders cost a real share of the step; ``encoder_scale``
    multiplies the ViT's layers (its FLOPs and activations grow by exactly that factor)."""
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    t = doc["spec"]["trainer"]
    t["model"]["llm"]["numLayers"] = 4
    t["model"]["encoders"]["image"] = {
        "preset": "vit-tiny",
        "hiddenSize": 128,
        "numLayers": 4 * encoder_scale,
    }
    t["data"].update(seqLength=512, globalBatchSize=8, microBatchSize=1)
    t["data"]["sources"] = [
        {
            "kind": "synthetic",
            "name": "openimages",
            "modality": "image",
            "preset": "openimages",
            "lengthScale": 0.06,
        },
        {
            "kind": "synthetic",
            "name": "longtext",
            "modality": "text",
            "preset": "longtext",
            "lengthScale": 0.02,
        },
    ]
    t["data"]["mixture"] = [{"atTokens": 0, "weights": {"image": 7, "text": 3}}]
    t["parallelism"] = {"pipeline": pipeline, "encoder": {"eta": eta}}
    return doc


# ---------------------------------------------------------------------------- worker (torchrun)


def worker(spec_path: Path) -> None:
    """Every rank: the policies interleaved, ``repeats`` times; rank 0 writes the runs."""
    import copy
    from dataclasses import asdict

    import torch
    import torch.distributed as dist

    from omni_trainer.config import parse_manifest
    from omni_trainer.distributed.config import ParallelDims
    from omni_trainer.mcore.parallel import (
        build_process_groups,
        destroy_distributed,
        init_distributed,
    )
    from omni_trainer.trainer import Trainer

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    _, world, device = init_distributed()
    data = spec["job"]["spec"]["trainer"]["data"]
    runs = []
    try:
        # One set of groups for every run (the policy changes nothing in the layout): megatron's
        # destroy_model_parallel leaves the old groups alive, and their gloo threads, hundreds
        # per rank after a few runs, took a growing share of the cores (step times doubled).
        first = parse_manifest(spec["job"]).spec.trainer
        dims = ParallelDims.from_config(first.parallelism, world)
        groups = build_process_groups(
            dims, device, reorder_group_size=first.data.reorder.group_size
        )
        for repeat in range(spec["repeats"]):
            numel = data["seqLength"] * data["microBatchSize"] * first.model.llm.hidden_size
            latency = p2p_latency(numel=numel)
            for policy in turned(spec["policies"], repeat):
                doc = copy.deepcopy(spec["job"])
                doc["spec"]["trainer"]["parallelism"]["encoder"]["policy"] = policy
                cfg = parse_manifest(doc).spec.trainer
                start = time.time()
                summary = asdict(Trainer(cfg, groups=groups, steps=spec["steps"]).train())
                runs.append(
                    {
                        "repeat": repeat,
                        "policy": policy,
                        "summary": summary,
                        "latency": latency,
                        "window": (start, time.time()),
                        "threads": len(os.listdir("/proc/self/task")),
                        "rss": _rss_bytes(),
                    }
                )
                dist.barrier()
        if dist.get_rank() == 0:
            Path(spec["out"]).write_text(json.dumps(runs))
    finally:
        destroy_distributed()


def turned(policies: list[str], repeat: int) -> list[str]:
    """Repeat ``repeat``'s order: the policies turned left by ``repeat``."""
    k = repeat % len(policies)
    return [*policies[k:], *policies[:k]]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def p2p_latency(*, numel: int, rounds: int = 20) -> float:
    """One-way seconds of an activation-sized message between pipeline neighbours (rank k and
    k+1: pipeline-only layouts), the median over ``rounds`` ping-pongs of every pair: transfer
    plus the blocked receiver's wake-up, under the machine's load of the moment."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(numel)
    mine = []
    for a in range(world - 1):
        if rank in (a, a + 1):
            for _ in range(rounds):
                start = time.perf_counter()
                if rank == a:
                    dist.send(buf, a + 1)
                    dist.recv(buf, a + 1)
                    mine.append((time.perf_counter() - start) / 2)
                else:
                    dist.recv(buf, a)
                    dist.send(buf, a)
        dist.barrier()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    samples = [x for xs in everyone for x in xs]
    return statistics.median(samples) if samples else 0.0


def launch(job: dict, *, nproc: int, steps: int, repeats: int, policies: tuple[str, ...]) -> list:
    """One torchrun launch of ``nproc`` single-threaded processes; the runs in order."""
    from omni_trainer.launch import torchrun_argv

    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "runs.json"
        spec.write_text(
            json.dumps(
                {
                    "job": job,
                    "steps": steps,
                    "repeats": repeats,
                    "policies": list(policies),
                    "out": str(out),
                }
            )
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMNI_NUM_THREADS": "1", "OMNI_OP_LOG": "1"}
        proc = subprocess.Popen(
            [*torchrun_argv(nproc), __file__, "--worker", str(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        samples: list[tuple[float, float, float]] = []
        done = threading.Event()
        sampler = threading.Thread(target=_sample_cpu, args=(proc.pid, samples, done), daemon=True)
        sampler.start()
        stdout, stderr = proc.communicate()
        done.set()
        sampler.join()
        if proc.returncode:
            sys.exit(f"bench launch failed\n{stdout[-2000:]}\n{stderr[-4000:]}")
        runs = json.loads(out.read_text())
        for run in runs:
            run["launch_cores"], run["others_cores"] = cores_used(samples, *run["window"])
        return runs


def _sample_cpu(pid: int, samples: list[tuple[float, float, float]], done: threading.Event) -> None:
    """Every 0.2 s: the time, the machine's busy CPU seconds (/proc/stat) and those of the
    launch's processes (torchrun and its workers, psutil): what the others used is the
    difference. (Runnable-task counts overstate it: gloo's idle loop threads show as runnable.)"""
    import psutil

    tick = os.sysconf("SC_CLK_TCK")
    root = psutil.Process(pid)
    while not done.wait(0.2):
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / tick  # less idle and iowait
        try:
            mine = sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])
        except psutil.Error:  # a process ended between the listing and the read
            continue
        samples.append((time.time(), busy, mine))


def cores_used(
    samples: list[tuple[float, float, float]], start: float, end: float
) -> tuple[float, float]:
    """Cores this launch and the machine's other processes kept busy between ``start`` and
    ``end``: the launch's CPU seconds, and the machine's busy ones less those, over the elapsed
    time ((0, 0) with fewer than 2 samples)."""
    inside = [x for x in samples if start <= x[0] <= end]
    if len(inside) < 2:
        return 0.0, 0.0
    (t0, busy0, mine0), (t1, busy1, mine1) = inside[0], inside[-1]
    mine = (mine1 - mine0) / (t1 - t0)
    return mine, max(0.0, (busy1 - busy0) / (t1 - t0) - mine)


# ---------------------------------------------------------------------------- analysis (pure)


@dataclass(frozen=True)
class Spread:
    """Median, min and max of a few runs."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), len(values))


def step_time(summary: dict) -> float:
    """One run's step time: the median of its steps after the first (warm-up)."""
    curve = summary["step_time_curve"]
    return statistics.median(curve[1:] if len(curve) > 1 else curve)


def per_stage(summary: dict) -> dict[int, dict[str, float]]:
    """One run, per stage: mean over its ranks of seconds per step; peak bytes the max."""
    stages: dict[int, list[dict]] = {}
    for r in summary["breakdown"]:
        stages.setdefault(r["stage"], []).append(r)
    out = {}
    for stage, rows in sorted(stages.items()):
        n = len(rows)
        out[stage] = {
            "encoder": sum(r["encoder_s"] for r in rows) / n,
            "llm": sum(r["llm_s"] for r in rows) / n,
            "waiting": sum(r["encoder_wait_s"] + r["pipeline_wait_s"] for r in rows) / n,
            "data": sum(r.get("data_s", 0.0) for r in rows) / n,
            "peak_mib": max(r["encoder_activation_peak_bytes"] for r in rows) / 2**20,
        }
    return out


def pair_ratios(times: dict[str, dict[int, float]], x: str, y: str) -> Spread:
    """Y's step time over X's in each repeat both ran (> 1: X faster)."""
    common = sorted(set(times[x]) & set(times[y]))
    return Spread.of([times[y][r] / times[x][r] for r in common])


def step_tables(job: dict, *, world: int, steps: int, policies: tuple[str, ...]) -> dict:
    """Per policy, ``omni plan``'s dataflow tables of the timed steps (after the first): the
    tables the trainer executes (planned from the same data and manifest)."""
    from omni_trainer.config import parse_manifest
    from omni_trainer.plan import plan_step

    cfg = parse_manifest(job).spec.trainer
    return {
        p: [
            plan_step(cfg, world_size=world, step=s, policy=p).table
            for s in range(1, max(steps, 2))
        ]
        for p in policies
    }


def simulated(tables: dict) -> dict:
    """The planner's time model on those tables, per policy: mean makespan and per stage
    encoder / LLM / idle, in LLM forward ops (``omni plan``'s simulation)."""
    from omni_trainer.multiplex.dataflow.simulate import simulate

    out = {}
    for p, steps in tables.items():
        sims = [simulate(t) for t in steps]
        out[p] = {
            "makespan": statistics.mean(sim["makespan"] for sim in sims),
            "stages": {
                k: {
                    key: statistics.mean(sim["stages"][k][name] for sim in sims)
                    for key, name in (("encoder", "encoder"), ("llm", "llm"), ("waiting", "idle"))
                }
                for k in range(len(sims[0]["stages"]))
            },
        }
    return out


def halves(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """Fit and held-out runs: even repeats fit, odd ones are predicted (one repeat: the same)."""
    fit = [r for r in runs if r["repeat"] % 2 == 0]
    held = [r for r in runs if r["repeat"] % 2 == 1]
    return fit, held or fit


def _op_seconds(runs: list[dict]) -> list[dict[str, float]]:
    """Per stage, the runs' median encoder, LLM and data seconds per step (the op timers)."""
    stages = [per_stage(r["summary"]) for r in runs]
    return [
        {k: statistics.median(run[s][k] for run in stages) for k in ("encoder", "llm", "data")}
        for s in sorted(stages[0])
    ]


def _waits(runs: list[dict]) -> list[float]:
    """Per stage, the runs' median measured waiting per step."""
    stages = [per_stage(r["summary"]) for r in runs]
    return [statistics.median(run[s]["waiting"] for run in stages) for s in sorted(stages[0])]


def spread(summary: dict) -> dict[int, tuple[float, ...]]:
    """Per stage, its LLM forwards' durations over their rank's mean (the op log): how the
    machine's load spreads ops of one cost, tails included; empty without a log."""
    out: dict[int, list[float]] = {}
    for row in summary["breakdown"]:
        d = [
            b - a for step in row.get("op_log", []) for name, a, b in step if name == "llm_forward"
        ]
        mean = statistics.mean(d) if d else 0.0
        out.setdefault(row["stage"], []).extend(x / mean for x in d if mean)
    return {s: tuple(v) for s, v in out.items()}


def op_ratios(summary: dict) -> dict[int, tuple[float, float]]:
    """Per stage, backward over forward seconds of its LLM ops and of its encoder ops, from
    the op log: LLM forwards are logged, the backwards are the rest of the LLM seconds; an
    encoder backward is the encoder span right after its gradient's wait. The cost model's 2
    where the log has nothing."""
    out: dict[int, list[tuple[float, float]]] = {}
    for row in summary["breakdown"]:
        log = row.get("op_log", [])
        fwd = sum(b - a for step in log for name, a, b in step if name == "llm_forward")
        llm = (row["llm_s"] * len(log) - fwd) / fwd if fwd else 2.0
        enc = {True: 0.0, False: 0.0}
        for step in log:
            for (before, _, _), (name, a, b) in itertools.pairwise([("", 0, 0), *step]):
                if name == "encoder":
                    enc[before == "encoder_wait"] += b - a
        out.setdefault(row["stage"], []).append(
            (llm, enc[True] / enc[False] if enc[True] and enc[False] else 2.0)
        )
    return {
        s: tuple(statistics.mean(v) for v in zip(*rows, strict=True)) for s, rows in out.items()
    }


def _replay_mean(
    tables: list, runs: list[dict], *, cores: int, samples: int = 24
) -> list[dict[str, float]]:
    """Per stage, the replay's seconds per step (mean over the tables and ``samples`` draws of
    op durations), op durations fit on the runs' op timers, latency their median ping-pong,
    the draws from their op logs' spread."""
    import random

    from omni_trainer.multiplex.replay import fit_op_times, replay

    latency = statistics.median(r.get("latency", 0.0) for r in runs)
    background = statistics.median(r.get("others_cores", 0.0) for r in runs)
    spreads = [spread(r["summary"]) for r in runs]
    shapes = [op_ratios(r["summary"]) for r in runs]
    ratios = [
        tuple(statistics.median(x[s][k] for x in shapes) for k in (0, 1)) for s in sorted(shapes[0])
    ]
    machine = {"cores": cores, "latency": latency, "background": background}
    fit = fit_op_times(tables, _op_seconds(runs), **machine, backward_ratio=ratios)
    times = [
        dataclasses.replace(t, spread=tuple(x for one in spreads for x in one[s]))
        for s, t in enumerate(fit)
    ]
    rng = random.Random(0)
    reps = [
        replay(t, times, **machine, rng=rng).stages
        for t in tables
        for _ in range(samples if any(x.spread for x in times) else 1)
    ]
    return [
        {k: statistics.mean(getattr(r[s], k) for r in reps) for k in ("encoder", "llm", "waiting")}
        for s in range(len(times))
    ]


def replayed(runs: list[dict], tables: dict, *, cores: int) -> dict:
    """Per policy and stage, the replay against measured waits, two ways (waits never fit):
    ``held_out``: op seconds and latency from the even repeats, waits of the odd ones;
    ``same_run``: each run replayed with its own op seconds and latency (the machine's load of
    that run), the median over runs, against the median measured waiting."""
    fit_runs, held_runs = halves(runs)
    out = {}
    for p, steps in tables.items():
        mine = [r for r in runs if r["policy"] == p]
        held = _replay_mean(steps, [r for r in fit_runs if r["policy"] == p], cores=cores)
        held_waits = _waits([r for r in held_runs if r["policy"] == p])
        each = [_replay_mean(steps, [r], cores=cores) for r in mine]
        out[p] = {
            s: {
                **held[s],
                "measured_waiting": held_waits[s],
                "same_run_waiting": statistics.median(e[s]["waiting"] for e in each),
                "same_run_measured": _waits(mine)[s],
            }
            for s in range(len(held))
        }
    return out


def agreement(rows: list[tuple[float, float]], tolerance: float = 0.25) -> tuple[int, float]:
    """(measured, replayed) waits: how many agree within ``tolerance`` of the measured, and the
    ratio measured / replayed farthest from 1 (inf where the replay says no wait)."""
    ok = sum(abs(r - m) <= tolerance * m for m, r in rows)
    ratios = [m / r if r > 0 else (1.0 if m == 0 else math.inf) for m, r in rows]
    return ok, max(ratios, key=lambda x: abs(math.log(x)) if 0 < x < math.inf else math.inf)


def seconds_per_unit(runs: list[dict], sim: dict) -> float:
    """Calibration: measured LLM seconds per simulated LLM unit (the same for every policy)."""
    measured = statistics.median(
        sum(s["llm"] for s in per_stage(r["summary"]).values()) for r in runs
    )
    units = statistics.mean(sum(s["llm"] for s in v["stages"].values()) for v in sim.values())
    return measured / units


def _row(label: str, stage: int, v: dict[str, float], tail: str = "") -> str:
    return f"{label:<13}{stage:>6}{v['encoder']:>9.3f}{v['llm']:>8.3f}{v['waiting']:>9.3f}{tail}"


def _vs(measured: float, model: float, name: str) -> str:
    return f"{'':>18}   waiting measured/{name} x{measured / model:.2f}" if model else ""


def report(
    runs: list[dict], policies: tuple[str, ...], sim: dict | None = None, rep: dict | None = None
) -> list[str]:
    """The printed lines: per policy and stage (with the planner's and the replay's rows when
    given), then the replay's agreement, each pair, and the loss check."""
    times: dict[str, dict[int, float]] = {p: {} for p in policies}
    stages: dict[str, list[dict[int, dict[str, float]]]] = {p: [] for p in policies}
    for run in runs:
        times[run["policy"]][run["repeat"]] = step_time(run["summary"])
        stages[run["policy"]].append(per_stage(run["summary"]))
    lines = [
        f"{'policy':<13}{'stage':>6}{'encoder':>9}{'llm':>8}{'waiting':>9}"
        f"{'peak enc act MiB':>18}   (medians over runs, s/step)"
    ]
    peaks = {}
    unit = seconds_per_unit(runs, sim) if sim is not None else 0.0
    if sim is not None:
        lines.insert(
            0,
            f"planner: omni plan's time model x {unit:.4f} s per LLM forward op (op costs from "
            "the cost model, one unit fit on LLM s, a device per stage)",
        )
    if rep is not None:
        fit, held = halves(runs)
        lines.insert(
            len(lines) - 1,
            f"replayed: the executed tables replayed on {rep['cores']} cores shared with others' "
            "CPU use (/proc/stat less this launch's), the measured p2p latency, op durations "
            "drawn from the LLM forwards' spread, backward/forward ratios from the op log, op "
            "seconds fit per stage and kind on encoder/LLM/data timers, never on "
            f"waits; held-out: fit on repeats {sorted({r['repeat'] for r in fit})}, measured "
            f"waiting of repeats {sorted({r['repeat'] for r in held})}; same-run: each run "
            "replayed with its own op seconds and latency",
        )
    agree: dict[str, list[tuple[float, float]]] = {"held-out": [], "same-run": []}
    for p in policies:
        for stage in sorted(stages[p][0]):
            med = {
                k: statistics.median(run[stage][k] for run in stages[p])
                for k in ("encoder", "llm", "waiting")
            }
            peak = max(run[stage]["peak_mib"] for run in stages[p])
            lines.append(_row(p, stage, med, f"{peak:>18.2f}"))
            if sim is not None:
                m = {k: v * unit for k, v in sim[p]["stages"][stage].items()}
                lines.append(
                    _row("  planner", stage, m, _vs(med["waiting"], m["waiting"], "planner"))
                )
            if rep is not None:
                r = rep["policies"][p][stage]
                agree["held-out"].append((r["measured_waiting"], r["waiting"]))
                agree["same-run"].append((r["same_run_measured"], r["same_run_waiting"]))
                tail = _vs(r["measured_waiting"], r["waiting"], "replayed")
                if r["same_run_waiting"]:
                    ratio = r["same_run_measured"] / r["same_run_waiting"]
                    tail += f" held-out, x{ratio:.2f} same-run"
                lines.append(_row("  replayed", stage, r, tail))
        peaks[p] = max(run[s]["peak_mib"] for run in stages[p] for s in run)
        t = Spread.of(list(times[p].values()))
        lines.append(
            f"{'':<13}{'step':>6}{t.median:>9.3f} s (min {t.low:.3f}, max {t.high:.3f}, "
            f"{t.n} runs); peak encoder activations {peaks[p]:.2f} MiB"
            + (f"; planner makespan {sim[p]['makespan'] * unit:.3f} s" if sim else "")
        )
    for how, rows in agree.items():
        if rows:
            ok, worst = agreement(rows)
            lines.append(
                f"simulated waits within 25% of measured: {ok} of {len(rows)} stage rows "
                f"(worst x{worst:.2f})   ({how}: replayed vs measured)"
            )
    for x, y in itertools.combinations(policies, 2):
        r = pair_ratios(times, x, y)
        lines.append(
            f"{x} vs {y} median step-time ratio {r.median:.3f} (min {r.low:.3f}, "
            f"max {r.high:.3f}, {r.n} runs); peak encoder activations x{peaks[x] / peaks[y]:.2f}"
            if peaks[y]
            else f"{x} vs {y} median step-time ratio {r.median:.3f} (min {r.low:.3f}, "
            f"max {r.high:.3f}, {r.n} runs)"
        )
    if all("threads" in run for run in runs):  # rank 0's, after each run in launch order
        threads, rss = [run["threads"] for run in runs], [run["rss"] / 2**20 for run in runs]
        lines.append(
            f"rank 0 after each run: threads {min(threads)}-{max(threads)} (first {threads[0]}, "
            f"last {threads[-1]}), RSS first {rss[0]:.0f} MiB, last {rss[-1]:.0f} MiB"
        )
    if all("launch_cores" in run for run in runs):
        cells = [
            f"{p} {statistics.median(r['launch_cores'] for r in runs if r['policy'] == p):.2f}"
            for p in policies
        ]
        others = statistics.median(run["others_cores"] for run in runs)
        lines.append(f"cores busy, median over runs: this launch {', '.join(cells)}; "
                     f"other processes {others:.2f}")  # fmt: skip
    curves = [run["summary"]["loss_curve"] for run in runs]
    same = all(abs(a - b) < 1e-5 for c in curves for a, b in zip(c, curves[0], strict=True))
    lines.append(f"loss curves of all {len(runs)} runs equal within 1e-5: {same}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="per run; the first is warm-up")
    ap.add_argument(
        "--repeats",
        type=int,
        default=8,
        help="best a multiple of the policies (each runs first equally often)",
    )
    ap.add_argument("--eta", type=int, default=256)
    ap.add_argument(
        "--memory-budget",
        help="auto's encoder.memoryBudget (e.g. 100Mi; default: uniform's peak x HEADROOM)",
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--encoder-scales",
        default="1",
        help="robustness: ViT layers x each (comma-separated); step-time growth per policy",
    )
    ap.add_argument(
        "--cores",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="cores the stages share in the replay (default: this process's affinity mask)",
    )
    ap.add_argument(
        "--shared-cores",
        choices=("detect", "yes", "no"),
        default="detect",
        help="auto's sharedCores (detect: the processes outnumber --cores)",
    )
    ap.add_argument(
        "--runs",
        type=Path,
        help="keep the runs in PATH.x<scale>.json; when it exists, analyse it instead of training",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="2 steps per run, once; auto and uniform by default"
    )
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.smoke:
        args.steps, args.repeats = 2, 1
        if args.policies == ",".join(POLICIES):
            args.policies = "auto,uniform"
    from omni_trainer.multiplex.encoder_policy import cores_are_shared

    policies = tuple(args.policies.split(","))
    scales = [int(x) for x in args.encoder_scales.split(",")]
    growth: dict[int, tuple[dict[str, float], dict[str, float]]] = {}
    for scale in scales:
        job = bench_job(args.pipeline, args.eta, scale)
        encoder = job["spec"]["trainer"]["parallelism"]["encoder"]
        if args.memory_budget:
            encoder["memoryBudget"] = args.memory_budget
        # what the trainer would detect, set explicitly so that ``omni plan`` shows its tables
        encoder["sharedCores"] = (
            cores_are_shared(args.nproc, 1, args.cores)
            if args.shared_cores == "detect"
            else args.shared_cores == "yes"
        )
        saved = args.runs and args.runs.with_suffix(f".x{scale}.json")
        if saved and saved.exists():  # the same job, steps and policies: analysed again
            runs = json.loads(saved.read_text())
        else:
            runs = launch(
                job, nproc=args.nproc, steps=args.steps, repeats=args.repeats, policies=policies
            )
            if saved:
                saved.write_text(json.dumps(runs))
        tables = step_tables(job, world=args.nproc, steps=args.steps, policies=policies)
        sim = simulated(tables)
        rep = {"cores": args.cores, "policies": replayed(runs, tables, cores=args.cores)}
        print(
            f"pp={args.pipeline} on {args.nproc} processes (1 thread each), encoder x{scale}, "
            f"policies interleaved {args.repeats} times, {args.steps} steps per run (the first "
            "excluded); ratio = Y's step time / X's in the same repeat (> 1: X faster)"
        )
        if encoder["sharedCores"]:
            print(
                f"auto: sharedCores (the stages share {args.cores} cores): the front-loaded "
                "table wherever it fits the budget"
            )
        print("\n".join(report(runs, policies, sim, rep)))
        measured = {
            p: statistics.median(step_time(r["summary"]) for r in runs if r["policy"] == p)
            for p in policies
        }
        growth[scale] = (measured, {p: sim[p]["makespan"] for p in policies})
    if len(scales) > 1:
        base = scales[0]
        print(f"step-time growth over encoder x{base}: measured (planner)")
        for scale in scales[1:]:
            m, s = growth[scale]
            cells = [
                f"{p} x{m[p] / growth[base][0][p]:.2f} ({s[p] / growth[base][1][p]:.2f})"
                for p in policies
            ]
            print(f"  encoder x{scale}: " + ", ".join(cells))


if __name__ == "__main__":
    main()

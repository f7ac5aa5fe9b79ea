# MegaScale-Omni developer entry points. Everything installs into .venv/ in this repository.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build for this machine; GPU images pin their CUDA build instead (dockerfiles/).
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= trainer,operator,sandbox,test
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
PYTEST_ARGS ?=

.PHONY: setup demo test lint format clean bench-multiplex

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 needed, found " + sys.version' 
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first: an unpinned torch (asked for by megatron-core) would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)]"
	touch $@

demo: setup
	$(BIN)/omni train examples/tiny-cpu.yaml --summary runs/tiny-cpu/summary.json

# The README's test command, in two lanes side by side: the Kubernetes tests (tests/sandbox,
# tests/operator: the real operator, kubelet and trainer processes, much of it waiting on polls)
# with the chart's (Helm, schemas, checkov in a venv of its own), and the rest (mostly computing),
# so the run takes about the longer lane, not their sum; one sandbox file runs in the rest lane
# to even them out (BALANCE). Each lane prints its slowest tests. With PYTEST_ARGS, one pytest
# run with those arguments instead.
BALANCE := tests/sandbox/test_sandbox_fast_tier.py
KUBERNETES_ONLY := $(filter-out $(BALANCE),$(wildcard tests/sandbox/test_*.py))
test: setup
	@# bytecode once for the tree: each of the suite's hundreds of processes would compile it again
	@$(BIN)/python -m compileall -q -j 0 trainer operator bench tests charts
ifeq ($(strip $(PYTEST_ARGS)),)
	@$(BIN)/python -m pytest -q --durations=25 -p no:cacheprovider tests/sandbox tests/operator \
	  tests/chart --ignore=$(BALANCE) > .pytest-kubernetes.log 2>&1 & lane=$$!; \
	$(BIN)/python -m pytest -q --durations=25 $(addprefix --ignore=,$(KUBERNETES_ONLY)) \
	  --ignore=tests/operator --ignore=tests/chart; \
	rest=$$?; wait $$lane; kube=$$?; \
	echo "---- tests/sandbox (less $(BALANCE)) tests/operator tests/chart (run beside the above)"; \
	cat .pytest-kubernetes.log; \
	echo "test lanes: rest exit $$rest, kubernetes exit $$kube"; [ $$rest -eq 0 ] && [ $$kube -eq 0 ]
else
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
endif

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) runs .pytest_cache .ruff_cache

# Every bench target takes BENCH_ARGS; BENCH_ARGS=--smoke is its smoke run (seconds, the smallest
# sizes, the whole path: what tests/dist/test_bench_smoke.py runs in CI; gpu-check's is
# GPU_CHECK_ARGS=--cpu-smoke).
BENCH_ARGS ?=

# Policies interleaved, 5 repeats, one thread per process: pp2 on 2 processes, pp4 on 4.
bench-multiplex: setup
	$(BIN)/python bench/multiplex.py --pipeline 2 --nproc 2 $(BENCH_ARGS)
	$(BIN)/python bench/multiplex.py --pipeline 4 --nproc 4 $(BENCH_ARGS)

# The CRD is generated from the operator's pydantic models; tests fail when crds/ is stale.
.PHONY: crds
crds: setup
	$(BIN)/python -m omni_operator.crd crds

.PHONY: bench-core

# Trainer core tokens/s before vs after at one layout (BEFORE=a baseline source tree), plus
# bf16 and recompute memory figures on this tree.
BEFORE ?= /tmp/omni-before
bench-core: setup
	$(BIN)/python bench/core.py --before $(BEFORE) $(BENCH_ARGS)

.PHONY: bench-shared-cluster
# 48 jobs of 1-8 nodes arriving over time on 32 nodes: the operator's admission code on a
# simulated clock; queue wait and GPU utilisation per policy, no node overcommitted.
bench-shared-cluster: setup
	$(BIN)/python bench/shared_cluster.py $(BENCH_ARGS)

.PHONY: bench-data
# Data time per step with vs without prefetch (llava-tiny, real files), decoded images/s per core.
bench-data: setup
	$(BIN)/python bench/data.py $(BENCH_ARGS)

.PHONY: bench-balance

# Grouped Karmarkar-Karp reordering vs greedy and no reordering (the paper's technique 7).
bench-balance: setup
	$(BIN)/python bench/balance.py $(BENCH_ARGS)

.PHONY: bench-freeze

# LLaVA stage 1 (projector only: LLM and encoders frozen) vs full training, steps side by side.
bench-freeze: setup
	$(BIN)/python bench/freeze.py $(BENCH_ARGS)

.PHONY: bench-interop

# Hugging Face import (per rank, tp1 and tp2) and export: time and peak host memory of a 1.2B
# random Llama in bf16 (BENCH_ARGS=--size small for a quick run).
bench-interop: setup
	$(BIN)/python bench/interop.py $(BENCH_ARGS)

.PHONY: bench-checkpoint

# Async loader snapshot vs synchronous save (1 MB, 100 MB; BENCH_ARGS=--big adds 1 GB) and
# first vs later DCP saves with plan caching on and off (the paper's techniques 8, 13-15).
bench-checkpoint: setup
	$(BIN)/python bench/checkpoint.py $(BENCH_ARGS)

# What the network preflight adds to an attempt (seconds) per size, healthy and one node late.
.PHONY: bench-preflight
bench-preflight: setup
	$(BIN)/python bench/preflight.py $(BENCH_ARGS)

# --- install and observe (chart, dashboards, images) -------------------------------------------
.PHONY: checkov
# checkov on the chart's objects and the operator's pods (charts/checkov_scan.py): every failing
# check must be one the script accepts with its reason. checkov gets a venv of its own.
CHECKOV_VENV := .venv-checkov
checkov: setup
	test -x $(CHECKOV_VENV)/bin/checkov || ($(PYTHON) -m venv $(CHECKOV_VENV) \
	  && $(CHECKOV_VENV)/bin/pip install --quiet --disable-pip-version-check checkov)
	$(BIN)/python charts/checkov_scan.py --checkov $(CHECKOV_VENV)/bin/checkov

.PHONY: dashboards chart images

# Grafana dashboards as code -> JSON in the chart; tests fail when the files are stale.
dashboards: setup
	$(BIN)/python -m omni_operator.dashboards charts/megascale-omni/dashboards

# The chart embeds the generated CRD and dashboards; then Helm (helm-python-sdk) lints it.
chart: crds dashboards
	cp crds/omnitrainingjobs.omni.megascale.io.yaml charts/megascale-omni/crds/
	$(BIN)/python -c 'import helm_python as h, json; r = h.lint("charts/megascale-omni", strict=True); print(json.dumps(r, indent=1)); raise SystemExit(1 if r["errors"] or any(m["severity"] >= 3 for m in r["messages"]) else 0)'

IMAGE_REGISTRY ?= ghcr.io/megascale-omni
IMAGE_TAG ?= 0.1.0
# docker build only where a Docker engine answers (none on CPU CI machines).
images:
	@if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then \
	  docker build -f dockerfiles/operator.Dockerfile -t $(IMAGE_REGISTRY)/operator:$(IMAGE_TAG) . && \
	  docker build -f dockerfiles/trainer.Dockerfile -t $(IMAGE_REGISTRY)/trainer:$(IMAGE_TAG) . ; \
	else \
	  echo "make images: no Docker engine answers here; skipped (dockerfiles/ are checked by tests/chart)"; \
	fi

.PHONY: bench-paper

# Predicted throughput of workloads A-D (the MegaScale-Omni paper) on H100 profiles: uniform multiplexing vs
# stage0, front_loaded and disaggregated, image:text 1:9..9:1, plus PP stage 0 memory (issue 8).
bench-paper: setup
	$(BIN)/python bench/paper.py $(BENCH_ARGS)

.PHONY: bench-operator

# The real kopf operator against the API emulator: job -> all pods, node lost -> all pods
# recreated and a crashed trainer restarted in place, for 8, 64 and 512 nodes, with the
# operator's API requests per reconcile.
bench-operator: setup
	$(BIN)/python bench/operator_scale.py $(BENCH_ARGS)

.PHONY: bench-calibrate

# Calibration against reality (issue 8): the planner's simulator, fed a CPU profile measured in
# the same run, predicts the tiny example's step time at world 1/2/4; omni train measures it.
bench-calibrate: setup
	$(BIN)/python bench/calibrate.py $(BENCH_ARGS)

.PHONY: gpu-check

# The GPU path on one GPU in under 8 minutes: TE vs local spec, a ~1B LLM + ViT-L bf16 run at 8K
# (tokens/s, MFU), checkpoints across specs; JSON to $(OUT) (CPU: GPU_CHECK_ARGS=--cpu-smoke).
gpu-check: setup
	$(BIN)/python bench/gpu_check.py --out $(or $(OUT),.) $(GPU_CHECK_ARGS)

.PHONY: bench-faults

# Each fault kind injected into the tiny job in the sandbox (crash, container killed, hang,
# SIGTERM, node lost, image missing on restart; --faults adds suspend, straggler): detection,
# first step, steps recomputed and training time lost, restartPolicy.mode in-place side by side
# with recreate. A node lost with a hot spare beside recreating, with an assumed image pull time:
# make bench-faults BENCH_ARGS='--modes in-place+spare recreate --faults crash node-lost --pull-seconds 30'
bench-faults: setup
	$(BIN)/python bench/faults.py $(BENCH_ARGS)

.PHONY: fault-suite

# 26 faults of 12 kinds in one in-place job of the tiny model in the sandbox (the operator in a
# process of its own, SIGKILLed during a restart; a checkpoint corrupted in place; a node lost
# twice, quarantined, and back): every fault's outcome, and every step's sample fingerprint and
# loss compared with the same job run uninterrupted (exit 1 unless all equal and all survived).
fault-suite: setup
	$(BIN)/python bench/faults.py --suite $(BENCH_ARGS)

.PHONY: bench-fast-tier

# One node lost 12+ steps past a persistent checkpoint (every 20 steps), without and with the
# fast tier (every 2 steps on node-local disks with peer copies): steps recomputed, time lost,
# and the mean step time (the fast tier's cost per step) side by side.
bench-fast-tier: setup
	$(BIN)/python bench/faults.py --modes recreate recreate+fast --faults node-lost \
		--interval 20 --past 12 $(BENCH_ARGS)

# syntax=docker/dockerfile:1
# The trainer image: CUDA + cuDNN, torch (CUDA build), megatron-core, TransformerEngine, this package.
# Build from the repository root:  make images   (or)
#   docker build -f dockerfiles/trainer.Dockerfile -t ghcr.io/megascale-omni/trainer:0.1.0 .
# The operator runs pods of this image with `torchrun ... -m omni_trainer.cli train /etc/omni/job.yaml`
# as UID 10001 (omni_operator.render.TRAINER_UID), under `omni supervise` when restarts are in place
# (restartPolicy.mode, the default: it restarts torchrun inside the pod); locally
# `docker run IMAGE job.yaml` trains.
ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

# Build stage: TransformerEngine compiles its torch extension against nvcc and cuDNN headers.
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-${UBUNTU} AS build
# megatron-core is pinned to the tested 0.16 series (pyproject.toml), on Python 3.12 as on 3.11.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG NVTE_CUDA_ARCHS="80;90"
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS} MAX_JOBS=8
RUN apt-get update && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev git build-essential ninja-build \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/omni
ENV PATH=/opt/omni/bin:$PATH
# torch first, from the CUDA index: megatron-core's unpinned torch must not pick another build.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" \
 && pip install pybind11 setuptools wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trainer/ trainer/
COPY operator/ operator/
# `trainer` extra: megatron-core, psutil, boto3, prometheus-client; `gpu` extra: TransformerEngine
# (built against the torch above, hence no build isolation).
# The smoke import includes the GPU modules: TE, megatron's TE layer spec (built, as the trainer
# builds it on GPUs) and the trainer's core.
RUN pip install --no-build-isolation ".[trainer,gpu]" \
 && python -c "import torch, megatron.core, omni_trainer.cli, omni_trainer.components.metrics, omni_trainer.supervisor, psutil" \
 && python -c "import transformer_engine.pytorch, megatron.core.extensions.transformer_engine, omni_trainer.trainer" \
 && python -c "from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec as te; te()"

# Runtime stage: the same CUDA/cuDNN libraries without the compiler.
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-${UBUNTU}
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/omni/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3 libibverbs1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/omni /opt/omni
# Non-root and numeric, above the host's range of users (10001, as the operator's image); the
# operator's pods run as 10001 too.
RUN groupadd --gid 10001 omni && useradd --uid 10001 --gid 10001 --no-create-home \
    --shell /usr/sbin/nologin omni
USER 10001:10001
WORKDIR /workspace
# 29500: torchrun rendezvous; 9464: trainer metrics (/metrics).
EXPOSE 29500 9464
ENTRYPOINT ["omni", "train"]

# syntax=docker/dockerfile:1
# The operator image: kopf + omni_operator (+ the pure config models of omni_trainer). No torch.
# Build from the repository root:  make images   (or)
#   docker build -f dockerfiles/operator.Dockerfile -t ghcr.io/megascale-omni/operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trainer/ trainer/
COPY operator/ operator/
RUN python -m venv /opt/omni \
 && /opt/omni/bin/pip install ".[operator]" \
 # The operator extra must never pull torch (tests/chart/test_dockerfiles.py checks the resolution).
 && if /opt/omni/bin/python -c "import torch" 2>/dev/null; then echo "torch leaked in" >&2; exit 1; fi \
 # Every operator entry point imports from the extra alone (the kopf handlers above all).
 && /opt/omni/bin/python -c "import kopf, omni_operator.handlers, omni_operator.metrics, omni_operator.cli"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/omni/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/omni /opt/omni
# Non-root, numeric (the chart's podSecurityContext runs as 10001 with a read-only root fs).
RUN groupadd --gid 10001 omni && useradd --uid 10001 --gid 10001 --no-create-home \
    --shell /usr/sbin/nologin omni
USER 10001:10001
# 8080: kopf liveness (/healthz); 9090: operator metrics (/metrics).
EXPOSE 8080 9090
# omni_operator.handlers is the kopf handlers package.
# The chart passes the run options (namespaces, peering, liveness) as args.
ENTRYPOINT ["kopf", "run", "-m", "omni_operator.handlers"]
CMD ["--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]

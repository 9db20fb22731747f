# The offline image: the Prefect flows (lanes[worker]: prefect, prefect-dask,
# prefect-kubernetes, boto3, pyarrow, onnxruntime-gpu; no torch), as a non-root user.
# One image for the three roles of the offline lane on Kubernetes:
#   - the Prefect worker that polls the work pool and creates a Job per flow run
#     (`prefect worker start --pool POOL --type kubernetes`);
#   - the flow run's Job (the work pool's base job template names this image);
#   - the Dask scheduler and workers of `runner: {kind: dask, address: ...}`.
# Build from the repository's root:
#
#   docker build -f infra/images/worker.Dockerfile -t lanes-worker .
#   docker build -f infra/images/worker.Dockerfile --build-arg BASE=python:3.11-slim -t lanes-worker-cpu .
#
# The project (workloads.yaml, the handler modules it names) is at /app, the folder that
# `lanes compile --project-dir /app` names; the models are mounted (or baked: copy them
# in a stage of your own FROM this one, as serve.Dockerfile's serve-baked does).
# Inputs and outputs should be s3:// URIs: a Job's disk is gone when it ends.
ARG BASE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

FROM ${BASE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/lanes
WORKDIR /src
COPY pyproject.toml README.md ./
COPY lanes/ lanes/
COPY serving/ serving/
COPY flows/ flows/
COPY router/ router/
# The worker extra and nothing else: the image holds what `pip install lanes[worker]` holds.
RUN /opt/lanes/bin/pip install --no-cache-dir ".[worker]"

# The project as it stands beside workloads.yaml, the modules its `handler:` and `guard:`
# name included (lanes imports them from the spec's folder). .dockerignore keeps out
# .venv, data and lanes' own development folders; the models are baked in their own
# stage or mounted, and lanes itself is installed in /opt/lanes.
FROM ${BASE} AS project
WORKDIR /app
COPY . .
RUN rm -rf .lanes lanes

FROM ${BASE} AS worker
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin lanes
COPY --from=build /opt/lanes /opt/lanes
ENV PATH=/opt/lanes/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    DO_NOT_TRACK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_HOME=/tmp/prefect \
    LANES_HOME=/tmp/lanes
WORKDIR /app
COPY --from=project --chown=10001:10001 /app/ ./
USER 10001
# 8786/8787: a Dask scheduler and its dashboard, when this image runs one.
EXPOSE 8786 8787
# The worker has no port of its own; the check is that the installed flows import.
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import lanes.flows.batch"]
CMD ["prefect", "worker", "start", "--pool", "lanes", "--type", "kubernetes"]

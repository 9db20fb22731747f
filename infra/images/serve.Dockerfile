# The serving image: `lanes serve` on onnxruntime-gpu, from `pip install lanes[serve,batch]`
# (no torch; prefect only for the Batch API), as a non-root user. Build from the
# repository's root:
#
#   docker build -f infra/images/serve.Dockerfile -t lanes-serve .                 # models baked in
#   docker build -f infra/images/serve.Dockerfile --target serve -t lanes-serve .  # models mounted
#
# Baked (the default, last stage): the project's .lanes/models is copied to
# /app/.lanes/models, where the demo workloads.yaml looks for it, and sealed (`lanes
# models seal`). Mounted (--target serve): nothing is copied; mount the model files
# read-only where the spec's model paths point (sealed where they were prepared), e.g.
# `-v $PWD/.lanes/models:/app/.lanes/models:ro`, or a volume in Kubernetes
# (`lanes render k8s --models-claim NAME`). Either way /app/workloads.yaml is the spec;
# in Kubernetes a ConfigMap replaces it (lanes render k8s).
#
# onnxruntime-gpu 1.31 is built against CUDA 13 and cuDNN 9: the base brings both.
# On a machine without a GPU the same image runs on the CPU provider (LANES_DEVICE=cpu).
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
# The serve extra and the Batch API's (prefect's client, boto3: ~130 MiB of a several-GiB
# image, imported only when a batch is touched): the rendered pods take PREFECT_API_URL,
# and without these /v1/batches would answer 503. ".[serve]" alone serves the rest.
RUN /opt/lanes/bin/pip install --no-cache-dir ".[serve,batch]"

# The project as it stands beside workloads.yaml, the modules its `handler:` and `guard:`
# name included (lanes imports them from the spec's folder). .dockerignore keeps out
# .venv, data and lanes' own development folders; the models are baked in their own
# stage or mounted, and lanes itself is installed in /opt/lanes.
FROM ${BASE} AS project
WORKDIR /app
COPY . .
RUN rm -rf .lanes lanes

FROM ${BASE} AS serve
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin lanes
COPY --from=build /opt/lanes /opt/lanes
ENV PATH=/opt/lanes/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    LANES_HOST=0.0.0.0 \
    LANES_PORT=8000 \
    LANES_HOME=/tmp/lanes
WORKDIR /app
COPY --from=project --chown=10001:10001 /app/ ./
USER 10001
EXPOSE 8000
# /healthz answers while the process lives; /readyz (the Kubernetes readiness probe)
# only once every model has loaded.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["lanes"]
CMD ["serve", "/app/workloads.yaml"]

FROM serve AS serve-baked
COPY --chown=10001:10001 .lanes/models/ .lanes/models/
# Each model file's digest sealed beside it (lanes.digests), once, here: a pod starts
# with an empty LANES_HOME and would otherwise hash every model on each start. The
# build's own digest cache is not kept.
RUN lanes models seal /app/workloads.yaml && rm -rf /tmp/lanes

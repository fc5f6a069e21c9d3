# One Dockerfile for the five services: a shared builder stage (the venv), a shared runtime stage (user, volumes'
# mount points, setup script), and one small final stage per service (its ports, health check and entrypoint).
# Build from the repository root, naming the service as the target:
#   docker build --target retriever -t prorag-retriever .                               CPU (the defaults)
#   docker build --target policy -t prorag-policy --build-arg BASE=vllm/vllm-openai:v0.33.0 \
#     --build-arg FLAVOR=gpu --build-arg LOCK=vllm.lock .                                vLLM (compose's gpu profile)
#   docker build --target prm -t prorag-prm --build-arg BASE=pytorch/pytorch:2.14.0-cuda12.8-cudnn9-runtime \
#     --build-arg FLAVOR=gpu --build-arg LOCK=cuda.lock .                                likewise trainer
#   ... --target retriever -t prorag-retriever-gpu --build-arg BASE=pytorch/pytorch:2.14.0-cuda12.8-cudnn9-runtime \
#     --build-arg FLAVOR=gpu --build-arg LOCK=cuda-faiss-gpu.lock
#                                                  the GPU retriever (and the gpu setup: e5 in fp16, faiss on the GPU)
# compose.yaml passes exactly these per service; docs/DEPLOY.md has the table of what each image holds and why the
# versions agree.
# Build arguments (default):
#   BASE=python:3.11-slim         builder and runtime base. GPU: vllm/vllm-openai:v0.33.0 (policy; vLLM 0.33.0 pins
#                                 torch 2.14.0 and transformers >=5.16.1,<5.21), pytorch/pytorch:2.14.0-cuda12.8-cudnn9-runtime
#                                 (prm, trainer, retriever-gpu: the torch vLLM pins, so what is trained here loads there).
#                                 Pin it by digest: BASE=name:tag@sha256:<digest> (compose: PRORAG_*_BASE in .env)
#   BUILDER_BASE=$BASE            e.g. the -cudnn9-devel tag of BASE to compile flash-attn (needs nvcc)
#   FLAVOR=cpu                    cpu = a plain venv, everything from the lock; gpu = a venv over the base's
#                                 site-packages: torch, vllm and the CUDA wheels from BASE, never re-installed
#   LOCK=cpu.lock                 the hashed lockfile in requirements/ (scripts/lock.py): cpu.lock, cuda.lock,
#                                 cuda-faiss-gpu.lock (faiss-gpu-cu12 in faiss-cpu's place), vllm.lock
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu   where cpu.lock's torch 2.13.0+cpu is fetched when no wheel
#                                 lies in build/wheels ('' = build/wheels only); its sha256 is the lock's either way
#   FLASH_ATTN_VERSION=''         e.g. 2.8.3.post2 (built against BASE's torch); empty: no code path selects it yet
#   EXTRA_PIP=''                  more requirement specs (outside the lock: not reproducible)
#
# Runs as uid/gid 10001 (not root); PRORAG_HOME=/data (mount the data volumes there); health over grpc.health.v1
# through `prorag health` (which reads the PRORAG_TLS_* / PRORAG_TOKEN* settings when TLS or tokens are on).
# Plain Dockerfile syntax: builds with the classic builder and with BuildKit, no frontend image to pull (the classic
# builder also runs the stages before the target; the final stages have no RUN, so that costs nothing).
# Pin BASE by digest (docs/DEPLOY.md, "Base images by digest"): BASE=python:3.11-slim@sha256:<digest>.
# UNPINNED: python:3.11-slim's digest could not be read where this was written (no registry reachable)
ARG BASE=python:3.11-slim
ARG BUILDER_BASE=${BASE}

FROM ${BUILDER_BASE} AS builder
ARG FLAVOR=cpu
ARG LOCK=cpu.lock
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG FLASH_ATTN_VERSION=
ARG EXTRA_PIP=
USER root
WORKDIR /src
# the dependency layer: only the lockfiles (and the optional local wheels) reach it, so it is rebuilt when they change
# and never for a change of the code, pyproject.toml or README.md
COPY scripts/docker/build_venv.sh /usr/local/bin/prorag-build-venv
COPY requirements requirements
# optional local wheels (e.g. the torch CPU wheel where no index is reachable); the lock keeps the COPY valid when
# build/wheels does not exist
COPY build/wheel[s] requirements/cpu.lock /wheels/
RUN prorag-build-venv deps
COPY pyproject.toml README.md ./
COPY protos protos
COPY prorag prorag
COPY services services
COPY prorag_app prorag_app
RUN prorag-build-venv project

FROM ${BASE} AS runtime
USER root
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    PRORAG_HOME=/data HOME=/home/prorag MPLCONFIGDIR=/tmp/matplotlib
# the data volumes' mount points exist and belong to the service user, so fresh named volumes do too
RUN (getent group 10001 >/dev/null || groupadd --gid 10001 prorag) \
 && (getent passwd 10001 >/dev/null || useradd --uid 10001 --gid 10001 --home-dir /home/prorag --no-create-home \
        --shell /usr/sbin/nologin prorag) \
 && mkdir -p /home/prorag /data/data/indexes /data/data/models /data/data/adapters /data/runs \
 && chown -R 10001:10001 /home/prorag /data
COPY --from=builder /opt/venv /opt/venv
# the one-shot setup (compose's setup services, the k8s Job): `prorag setup cpu|gpu`
COPY scripts/docker/setup.sh /usr/local/bin/prorag-setup
USER 10001:10001
WORKDIR /data
# 0.0.0.0 inside the container network below; compose publishes on 127.0.0.1 by default (the 91xx metrics
# ports stay inside the network: plain HTTP for a Prometheus there)
# health: readiness of the service (SERVING once what it serves is loaded), except the PRM's (below)

FROM runtime AS retriever
EXPOSE 50051 8000 9101
HEALTHCHECK --interval=30s --timeout=30s --start-period=300s --retries=3 \
  CMD ["prorag", "health", "--target", "127.0.0.1:50051", "--service", "prorag.v1.Retriever"]
ENTRYPOINT ["prorag", "serve", "retriever", "--host", "0.0.0.0"]

FROM runtime AS policy
EXPOSE 50052 8001 9102
HEALTHCHECK --interval=30s --timeout=30s --start-period=300s --retries=3 \
  CMD ["prorag", "health", "--target", "127.0.0.1:50052", "--service", "prorag.v1.Policy"]
ENTRYPOINT ["prorag", "serve", "policy", "--host", "0.0.0.0"]

FROM runtime AS prm
EXPOSE 50053 9103
# liveness only: the PRM is live but not ready until a trained PRM is given (`--set model=...`)
HEALTHCHECK --interval=30s --timeout=30s --start-period=300s --retries=3 \
  CMD ["prorag", "health", "--target", "127.0.0.1:50053"]
ENTRYPOINT ["prorag", "serve", "prm", "--host", "0.0.0.0"]

FROM runtime AS judge
EXPOSE 50054 9104
HEALTHCHECK --interval=30s --timeout=30s --start-period=300s --retries=3 \
  CMD ["prorag", "health", "--target", "127.0.0.1:50054", "--service", "prorag.v1.Judge"]
ENTRYPOINT ["prorag", "serve", "judge", "--host", "0.0.0.0"]

FROM runtime AS trainer
EXPOSE 50055 9105
HEALTHCHECK --interval=30s --timeout=30s --start-period=300s --retries=3 \
  CMD ["prorag", "health", "--target", "127.0.0.1:50055", "--service", "prorag.v1.Trainer"]
ENTRYPOINT ["prorag", "serve", "trainer", "--host", "0.0.0.0"]

# syntax=docker/dockerfile:1
# asyncrl images. Every install step is docker/install.sh, the script `make install` runs outside Docker.
#
#   docker build --target cpu -t asyncrl:cpu .   CPU torch + asyncrl (the default target)
#   docker build --target dev -t asyncrl:dev .   cpu + dev tools and extras: what the devcontainer builds
#   docker build --target gpu -t asyncrl:gpu .   CUDA 13: vLLM 0.26.0 (torch 2.11). --build-arg FLASH_ATTN=1
#                                                adds flash-attn 2 built for H100/H200 (~30 min more;
#                                                FLASH_ATTN_CUDA_ARCHS="80;90" adds A100). Left out by default:
#                                                torch's varlen kernel, the trainer's default, is its kernel
#   docker build --target trainer -t asyncrl:trainer .
#                                                the trainer's own image: the gpu image's CUDA 13 and torch 2.11,
#                                                flash-attn-4 (model.attn_implementation=varlen_fa4), no vLLM
#
# One entrypoint, the CLI: `docker run asyncrl:cpu prepare experiment=reverse_text` runs `asyncrl prepare ...`
# in /runs (mount a volume there: every relative path of the config, outputs/ included, lands in it).
# Every image installs wheels only (no compiler in the cpu and dev images): the few dependencies that ship only
# as source (docker/source-only.txt; docker/locks/ records what each image resolves to) are compiled into
# wheels by a builder stage (wheels, gpu-wheels) and copied in.
# Everything runs as the non-root user asyncrl, written USER 1000:1000 (numeric, so that the host and
# Kubernetes' runAsNonRoot can check it); USER 0:0 is root, for apt only.

# ---------------------------------------------------------------------------------------------------
# CPU base: Python, the user, the install script and pyproject.toml (the requirements' one source)
FROM python:3.12.12-slim-bookworm AS cpu-base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# where the CPU torch comes from (see docker/install.sh); the cu130 index gives a CUDA torch instead
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV TORCH_INDEX_URL=${TORCH_INDEX_URL}
RUN useradd --create-home --uid 1000 --shell /bin/bash asyncrl \
 && install -d -o asyncrl -g asyncrl /opt/venv /opt/asyncrl /opt/source-wheels /runs
USER 1000:1000
# (made by the user, so that a named volume mounted here starts out writable by it)
RUN mkdir -p /home/asyncrl/.cache/huggingface
WORKDIR /opt/asyncrl
COPY --chown=asyncrl:asyncrl pyproject.toml ./
COPY --chown=asyncrl:asyncrl docker/install.sh docker/source-only.txt docker/

# ---------------------------------------------------------------------------------------------------
# wheels: the builder of the cpu and dev images. The source-only dependencies compiled into /opt/source-wheels
# with the image's own Python; the compiler stays in this stage (not /opt/wheels: docker/image-test.sh mounts
# the host's local wheels there)
FROM cpu-base AS wheels
USER 0:0
# Debian's current compiler: pinning it would break the build at each point release
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
USER 1000:1000
ENV VIRTUAL_ENV=/opt/venv
ENV PATH=${VIRTUAL_ENV}/bin:${PATH}
RUN python -m venv "${VIRTUAL_ENV}" && SOURCE_WHEELS=/opt/source-wheels docker/install.sh source-wheels deps

# ---------------------------------------------------------------------------------------------------
# dev: the cpu image's stack plus the dev extra and tools, asyncrl installed editable. The devcontainer
# builds this target and re-points the editable install at the workspace (postCreateCommand).
FROM cpu-base AS dev
USER 0:0
# Debian's current versions of these tools: pinning them would break the build at each point release
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends git make less procps openssh-client \
 && rm -rf /var/lib/apt/lists/*
USER 1000:1000
# in the home: the devcontainer's UID remapping (updateRemoteUserUID) chowns the home and nothing else
ENV VIRTUAL_ENV=/home/asyncrl/.venv
ENV PATH=${VIRTUAL_ENV}/bin:${PATH}
COPY --from=wheels /opt/source-wheels /opt/source-wheels
RUN python -m venv "${VIRTUAL_ENV}" && SOURCE_WHEELS=/opt/source-wheels docker/install.sh dev deps
COPY --chown=asyncrl:asyncrl . .
RUN ASYNCRL_EDITABLE=1 docker/install.sh dev project
ENTRYPOINT ["asyncrl"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------------
# GPU base: CUDA 13.0 (torch 2.11's) with nvcc and a C++ compiler: flash-attn's build needs them, and at run
# time Triton compiles its launchers and vLLM's FlashInfer/DeepGEMM JIT-compile kernels. Python 3.12: Ubuntu's.
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04 AS gpu-base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEBIAN_FRONTEND=noninteractive
# Ubuntu's current versions (security updates); the CUDA stack itself is pinned by the base image and torch
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential python3 python3-dev python3-venv git \
 && rm -rf /var/lib/apt/lists/*
# Ubuntu's images have a user `ubuntu` with uid 1000: asyncrl takes its place, as in the cpu image
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && useradd --create-home --uid 1000 --shell /bin/bash asyncrl \
 && install -d -o asyncrl -g asyncrl /opt/venv /opt/asyncrl /opt/source-wheels /runs
USER 1000:1000
RUN mkdir -p /home/asyncrl/.cache/huggingface && python3 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv
ENV PATH=${VIRTUAL_ENV}/bin:${PATH}
WORKDIR /opt/asyncrl
COPY --chown=asyncrl:asyncrl pyproject.toml ./
COPY --chown=asyncrl:asyncrl docker/install.sh docker/source-only.txt docker/

# gpu-wheels: the gpu and trainer images' builder. The source-only dependencies, and flash-attn 2 with FLASH_ATTN=1,
# compiled here, so that the gpu image gets the wheels without the compiler's leftovers
FROM gpu-base AS gpu-wheels
ARG FLASH_ATTN=0
ARG FLASH_ATTN_CUDA_ARCHS=90
ARG MAX_JOBS=4
RUN SOURCE_WHEELS=/opt/source-wheels docker/install.sh source-wheels deps \
 && if [ "${FLASH_ATTN}" = 1 ]; then FLASH_ATTN_WHEELS=/opt/source-wheels docker/install.sh flash-attn-wheel deps; fi

# ---------------------------------------------------------------------------------------------------
# gpu: vLLM sidecar, FSDP2 trainer and orchestrator (docker-compose.yml runs one container each)
FROM gpu-base AS gpu
ARG FLASH_ATTN=0
COPY --from=gpu-wheels /opt/source-wheels /opt/source-wheels
RUN SOURCE_WHEELS=/opt/source-wheels FLASH_ATTN_WHEELS=/opt/source-wheels docker/install.sh gpu deps
COPY --chown=asyncrl:asyncrl README.md ./
COPY --chown=asyncrl:asyncrl src/ src/
COPY --chown=asyncrl:asyncrl environments/ environments/
RUN docker/install.sh gpu project
WORKDIR /runs
ENTRYPOINT ["asyncrl"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------------
# trainer: the trainer's processes (asyncrl sft, asyncrl train) with flash-attn-4 and without vLLM.
# An image of its own because the two cannot share one environment: flash-attn-4 needs newer nvidia-cutlass-dsl
# and apache-tvm-ffi than vLLM 0.26.0 pins (pyproject.toml's trainer extra). Same base and torch as gpu, so that
# the trainer and the sidecar beside it compute alike (docker-compose.yml runs the sidecar from gpu).
FROM gpu-base AS trainer
COPY --from=gpu-wheels /opt/source-wheels /opt/source-wheels
RUN SOURCE_WHEELS=/opt/source-wheels docker/install.sh trainer deps
COPY --chown=asyncrl:asyncrl README.md ./
COPY --chown=asyncrl:asyncrl src/ src/
COPY --chown=asyncrl:asyncrl environments/ environments/
RUN docker/install.sh trainer project
WORKDIR /runs
ENTRYPOINT ["asyncrl"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------------
# cpu: the last stage, so that a plain `docker build .` builds it
FROM cpu-base AS cpu
ENV VIRTUAL_ENV=/opt/venv
ENV PATH=${VIRTUAL_ENV}/bin:${PATH}
COPY --from=wheels /opt/source-wheels /opt/source-wheels
RUN python -m venv "${VIRTUAL_ENV}" && SOURCE_WHEELS=/opt/source-wheels docker/install.sh cpu deps
COPY --chown=asyncrl:asyncrl README.md ./
COPY --chown=asyncrl:asyncrl src/ src/
COPY --chown=asyncrl:asyncrl environments/ environments/
RUN docker/install.sh cpu project
WORKDIR /runs
ENTRYPOINT ["asyncrl"]
CMD ["--help"]

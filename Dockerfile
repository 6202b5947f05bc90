# trainproof: a preemption-proof PyTorch training job. `trainproof` is the entrypoint:
#   docker build -t trainproof:local .
#   docker run --gpus all --rm trainproof:local train --store s3://bucket/run --task tinylm --max-steps 1000
#
# Base image: nvidia/cuda *base* flavour, not *runtime*/*cudnn-runtime* nor pytorch/pytorch.
# - torch 2.13.0 from PyPI is the CUDA 13.0 build and brings its own CUDA libraries and cuDNN as pip wheels
#   (see infra/docker/requirements.lock.txt); a runtime/cudnn image would ship a second, unused copy (~3 GB)
#   that can disagree in version with the one torch really loads.
# - The base flavour still sets what the NVIDIA container toolkit needs (NVIDIA_VISIBLE_DEVICES,
#   NVIDIA_DRIVER_CAPABILITIES) and NVIDIA_REQUIRE_CUDA=cuda>=13.0, so a host whose driver is too old for
#   CUDA 13.0 (< 580) fails at container start with a clear message instead of inside torch.
# - pytorch/pytorch images pin torch by tag too, but bring conda and a root-owned /opt/conda; the pinned
#   lock file below pins every package, not only torch.
# - Ubuntu 24.04's python3 is CPython 3.12 (torch has cp312 wheels; the lock file is resolved for it).
# Note: the lock file is for x86_64; an arm64 image (GH200) needs a lock resolved for aarch64 (REQUIREMENTS_LOCK).
# No `# syntax=` line: BuildKit's built-in frontend (Docker >= 20.10) has everything used here (RUN --mount), and a
# syntax line makes every build pull a frontend image from Docker Hub, which fails on a machine without it.
#
# Build arguments: BASE_IMAGE and REQUIREMENTS_LOCK (a path in the build context). The CI's container test builds
# this file with a Debian 12 base and a CPU-torch lock (scripts/docker.sh); the product image uses the defaults.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04

FROM ${BASE_IMAGE} AS build
ARG REQUIREMENTS_LOCK=infra/docker/requirements.lock.txt
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
# Distribution packages are not pinned: Ubuntu replaces point releases in its archive, so a pinned
# `python3=3.12.3-…` stops building within months; the base image tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Dependencies first, in their own layer: torch and the CUDA wheels (several GB) are not reinstalled when
# only the project's code changes. The cache mount keeps downloaded wheels across builds, out of the image.
COPY ${REQUIREMENTS_LOCK} /tmp/requirements.lock.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --require-virtualenv -r /tmp/requirements.lock.txt
# The project itself, without the test extra, against the already installed, pinned dependencies (and the
# pinned setuptools as its build backend: --no-build-isolation). A regular, not an editable, install.
COPY pyproject.toml README.md /src/
COPY trainproof /src/trainproof
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --require-virtualenv --no-deps --no-build-isolation /src \
    && pip check

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# tini is PID 1: it forwards SIGTERM to trainproof (a Python PID 1 would get no default signal handling
# before its handlers are installed) and reaps zombies. ca-certificates: HTTPS to S3 through aiohttp.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 tini ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin trainproof
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# A numeric user, so Kubernetes' runAsNonRoot can verify it without a runAsUser.
USER 10001
WORKDIR /home/trainproof
# No HEALTHCHECK: a batch job is judged by its exit code (0 done, 75 run again, 2 do not retry, 1 retry).
ENTRYPOINT ["tini", "--", "trainproof"]
CMD ["--help"]

# syntax=docker/dockerfile:1
# Tessera image: `tessera` is the entry point (shards, workers, peer ranks, federated server/clients).
#   CPU (default):  docker build -t tessera .
#   CUDA:           docker build -t tessera:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 .
#                   (torch's CUDA wheels bring the CUDA runtime; the host needs the NVIDIA driver and
#                   the NVIDIA container toolkit; compose's GPU reservation hands the devices in)
# Nothing secret is baked in: TLS keys and tokens come as compose secrets (/run/secrets/...).
ARG PYTHON=3.12

FROM python:${PYTHON}-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# a C compiler for the sparse table's row kernel (ps/_rowkernel.c, built by setup.py; without it the
# shards run the numpy path). Only in this stage: the runtime image gets the built library, not gcc.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/tessera
ENV PATH=/opt/tessera/bin:$PATH
WORKDIR /src
# torch first, from the chosen index (CPU or a CUDA build), so the project's range installs nothing more
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml setup.py README.md ./
COPY tessera ./tessera
COPY ps ./ps
COPY worker ./worker
COPY federated ./federated
RUN pip install . && python -c "import tessera.cli, prometheus_client, grpc_health; from ps import rowkernel; assert rowkernel.KERNEL is not None, rowkernel.UNAVAILABLE"

FROM python:${PYTHON}-slim AS runtime
LABEL org.opencontainers.image.title="tessera" \
      org.opencontainers.image.description="Distributed training for torch: parameter server, peer all-reduce, federated learning"
COPY --from=build /opt/tessera /opt/tessera
ENV PATH=/opt/tessera/bin:$PATH PYTHONUNBUFFERED=1 \
    TESSERA_HEALTH_ADDR=127.0.0.1:7000 TESSERA_HEALTH_ARGS=""
RUN groupadd --system --gid 10001 tessera \
    && useradd --system --uid 10001 --gid tessera --home-dir /data --create-home --shell /usr/sbin/nologin tessera \
    && mkdir -p /data/checkpoints /data/metrics \
    && chown -R tessera:tessera /data
USER 10001:10001
WORKDIR /data
VOLUME ["/data/checkpoints", "/data/metrics"]
EXPOSE 7000 7100 9100 29400
# the standard gRPC health service of the server in this container (SERVING: healthy), asked by
# `python -m tessera.health` (`tessera health` without loading torch: cheap every few seconds); a TLS server
# is probed with TESSERA_HEALTH_ARGS (e.g. --tls-ca FILE). Containers that serve no gRPC (workers) turn it off.
HEALTHCHECK --interval=5s --timeout=4s --start-period=20s --retries=5 \
    CMD ["sh", "-c", "exec python -m tessera.health \"$TESSERA_HEALTH_ADDR\" $TESSERA_HEALTH_ARGS"]
ENTRYPOINT ["tessera"]
CMD ["--help"]

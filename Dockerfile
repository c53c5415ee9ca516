# The loraplex server image the Helm chart (helm/loraplex) runs: `loraplex serve` on port 8000.
# Build: docker build -t ghcr.io/loraplex/loraplex:0.1.0 .
# torch==2.13.0 from PyPI is its CUDA build on Linux x86_64, so the image runs on GPU nodes
# (nvidia.com/gpu) through the NVIDIA container runtime; no CUDA toolkit is needed in the image.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    LORAPLEX_DATA_DIR=/data \
    LORAPLEX_HOST=0.0.0.0 \
    LORAPLEX_PORT=8000

WORKDIR /src
# Dependencies first, so a code change does not reinstall torch.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); \
open('/tmp/req.txt', 'w').write('\n'.join(d['project']['dependencies']))" \
    && pip install -r /tmp/req.txt

COPY platform platform
COPY engine engine
COPY kernels kernels
COPY migrations migrations
COPY admin_ui admin_ui
COPY bench bench
RUN pip install --no-deps . && rm -rf /src

RUN useradd --uid 10001 --create-home loraplex && mkdir /data && chown loraplex /data
USER 10001
WORKDIR /data
EXPOSE 8000
ENTRYPOINT ["loraplex"]
CMD ["serve"]

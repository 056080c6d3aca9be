# vllm-router (PyPI: a Rust binary with a Python launcher) for deploy/k8s/router.yaml:
#   docker build -f deploy/router.Dockerfile -t pagedserve-router .
FROM python:3.11-slim
RUN pip install --no-cache-dir vllm-router==0.1.17 \
 && useradd --uid 10001 --create-home --shell /usr/sbin/nologin router
USER router
ENTRYPOINT ["vllm-router"]

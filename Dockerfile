# epp: the Endpoint Picker as a small, non-root image running `epp serve`.
#
#   docker build -t epp:0.1.0 .
#   docker run --rm epp:0.1.0 --help
#
# Stage 1 installs epp and its dependencies (binary wheels) into a virtual environment; stage 2
# copies only that environment onto a clean python:3.11-slim: no pip run, no compiler, no sources.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/epp
WORKDIR /src
COPY pyproject.toml README.md ./
COPY epp ./epp
# Dependencies from binary wheels only (a missing wheel fails here instead of needing a compiler);
# pip byte-compiles everything it installs, as the final image's file system is read-only.
# xds-protos ships an older copy of opentelemetry/proto/: reinstall opentelemetry-proto last.
RUN /opt/epp/bin/pip install --only-binary=:all: --no-binary=epp . \
 && /opt/epp/bin/pip install --only-binary=:all: --force-reinstall --no-deps \
      "opentelemetry-proto==$(/opt/epp/bin/python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')" \
 && /opt/epp/bin/pip uninstall --yes pip setuptools

FROM python:3.11-slim
# uid/gid 65532 ("nonroot", as in distroless images); the Kubernetes manifests run as the same ids.
RUN groupadd --gid 65532 epp \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin epp
COPY --from=build /opt/epp /opt/epp
ENV PATH=/opt/epp/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
# ext_proc (gRPC), gRPC health, Prometheus metrics
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp", "serve"]
CMD ["--config-file", "/etc/epp/config.yaml"]

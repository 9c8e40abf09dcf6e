# epp: the Endpoint Picker as a small, non-root image running `epp serve`.
#
#   docker build -t epp:0.1.0 .          (make image: the same with podman on a local base)
#   docker run --rm epp:0.1.0 --help
#
# Versions come from the lock files (make lock), installed with their hashes. Layers: the
# dependencies (requirements-image.lock) come before epp's own files, so a code change rebuilds
# and ships only epp's layer. The final image has no pip, setuptools or wheel and writes nothing
# at run time (everything byte-compiled here; the root file system can be read-only).
ARG BASE=python:3.11.14-slim-bookworm

FROM ${BASE} AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COPY requirements-image.lock /src/
# xds-protos ships an older copy of opentelemetry/proto/: reinstall opentelemetry-proto last.
RUN python -m venv /opt/epp \
 && /opt/epp/bin/pip install --no-deps --require-hashes --only-binary=:all: -r /src/requirements-image.lock \
 && awk '/^opentelemetry-proto==/{p=1} p{print; if (!/\\$/) exit}' /src/requirements-image.lock > /src/otel.txt \
 && /opt/epp/bin/pip install --no-deps --require-hashes --only-binary=:all: --force-reinstall -r /src/otel.txt \
 && /opt/epp/bin/pip uninstall --yes pip setuptools wheel 2>/dev/null; rm -rf /opt/epp/bin/pip* /opt/epp/bin/activate*

FROM ${BASE} AS app
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COPY requirements-build.lock /src/
RUN python -m venv /opt/build \
 && /opt/build/bin/pip install --no-deps --require-hashes --only-binary=:all: -r /src/requirements-build.lock
COPY --from=deps /opt/epp /opt/epp
COPY pyproject.toml README.md /src/
COPY epp /src/epp
# epp alone, into its own prefix (merged into /opt/epp by the final stage), byte-compiled
RUN cd /src && /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
 && /opt/build/bin/pip install --no-deps --no-compile --prefix /opt/epp-app /wheels/epp-*.whl \
 && sed -i '1s|^#!.*|#!/opt/epp/bin/python|' /opt/epp-app/bin/epp \
 && /opt/epp/bin/python -m compileall -q /opt/epp-app/lib

FROM ${BASE}
# uid/gid 65532 ("nonroot", as in distroless images); the Kubernetes manifests run as the same ids.
# The base's pip, setuptools and wheel go; the standard library is byte-compiled (the slim base
# ships no .pyc: every start would compile it again, and a read-only root cannot keep them).
RUN groupadd --gid 65532 epp \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin epp \
 && py=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])') \
 && purelib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && rm -rf "$purelib"/pip "$purelib"/pip-* "$purelib"/setuptools* "$purelib"/wheel* "$purelib"/_distutils_hack \
      "$purelib"/distutils-precedence.pth "$py"/ensurepip/_bundled /usr/share/python-wheels \
      /usr/local/bin/pip* /usr/bin/pip* \
 && python -m compileall -q -j 0 "$py" >/dev/null
COPY --from=deps /opt/epp /opt/epp
COPY --from=app /opt/epp-app/ /opt/epp/
ENV PATH=/opt/epp/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
USER 65532:65532
# ext_proc (gRPC), gRPC health, Prometheus metrics
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp", "serve"]
# last: a new revision changes no layer above
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.title="epp" \
      org.opencontainers.image.licenses="Apache-2.0"

CMD ["--config-file", "/etc/epp/config.yaml"]

# epp: the Endpoint Picker as a small non-root image running `epp serve`.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY epp ./epp
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin epp
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 65532:65532
# ext_proc, gRPC health, Prometheus metrics
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp", "serve"]
CMD ["--config-file", "/etc/epp/config.yaml"]

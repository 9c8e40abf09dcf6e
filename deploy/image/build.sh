#!/usr/bin/env bash
# make image: build the Dockerfile with Debian's podman on a local Debian bookworm base (made by
# mmdebstrap and tagged with the name the Dockerfile's FROM uses: no registry is needed), then
# print the image's size, the build time and the start-up time. IMAGE=name:tag overrides epp:0.1.0.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/image/tools.sh
IMAGE=${IMAGE:-epp:$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}
BASE=$(sed -n 's/^ARG BASE=//p' Dockerfile)

need_tools || { rc=$?; ((rc == 2)) && exit 0; exit $rc; }

if ! podman image exists "$BASE"; then
  echo "make image: base $BASE from Debian bookworm (mmdebstrap)"
  start=$(date +%s)
  mmdebstrap --quiet --variant=minbase --format=tar \
    --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm - http://deb.debian.org/debian | podman import --quiet - "$BASE" >/dev/null
  echo "make image: base ready in $(( $(date +%s) - start )) s"
fi

echo "make image: building $IMAGE (podman build)"
start=$(date +%s.%N)
# pip inside the build trusts this host's CA bundle: mounted read-only for the build's RUN steps only
podman build --quiet --layers \
  --volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
  --build-arg REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
  --build-arg SOURCE="$(git config --get remote.origin.url 2>/dev/null || echo unknown)" \
  -t "$IMAGE" . >/dev/null
build=$(echo "$(date +%s.%N) - $start" | bc)
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
start=$(date +%s.%N)
podman run --rm --read-only --read-only-tmpfs=false --network none "$IMAGE" --help >/dev/null
startup=$(echo "$(date +%s.%N) - $start" | bc)
printf 'make image: %s  size %d MB  build %.1f s  start-up (epp serve --help in a container) %.2f s\n' \
  "$IMAGE" $(( size / 1000000 )) "$build" "$startup"

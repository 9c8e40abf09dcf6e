#!/usr/bin/env bash
# make image-test: tests/image run against the built image inside a private network namespace.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/image/tools.sh
need_tools || { rc=$?; ((rc == 2)) && exit 0; exit $rc; }
IMAGE=${IMAGE:-epp:$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}
podman image exists "$IMAGE" || { echo "make image-test: no image $IMAGE (make image first)"; exit 1; }
NS=epp-image-$$
ip netns add "$NS"
trap 'ip netns delete "$NS"' EXIT
ip -n "$NS" link set lo up
EPP_IMAGE="$IMAGE" EPP_NETNS="$NS" PATH="$PWD/.venv/bin:$PATH" \
  .venv/bin/pytest -q -s -p no:cacheprovider tests/image

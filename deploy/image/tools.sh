# Sourced by build.sh and test.sh: podman, runc, mmdebstrap from Debian, and this VM's containers.conf.
# need_tools returns 0 when they are there (installing them when root with apt), else says why and
# returns 1 under CI=true (the target fails) or 2 elsewhere (skip).
need_tools() {
  local missing=()
  for tool in podman runc mmdebstrap ip bc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  if ((${#missing[@]})); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
      echo "make image: installing ${missing[*]} (apt)"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap iproute2 bc >/dev/null
    else
      echo "make image: ${missing[*]} missing and cannot be installed here (needs root and apt)"
      [[ ${CI:-} == true ]] && return 1
      echo "make image: skipped"
      return 2
    fi
  fi
  # runc (crun is not usable on this VM) and ulimits containers can start under
  export CONTAINERS_CONF=$PWD/.image/containers.conf
  mkdir -p .image
  cat > "$CONTAINERS_CONF" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
CONF
}

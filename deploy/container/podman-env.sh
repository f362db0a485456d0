# Sourced by ./dev and the container tests: makes podman work on hosts where
# its defaults do not, by writing a containers.conf and exporting
# CONTAINERS_CONF. Leaves podman alone where a plain `podman run` works.
#
# Two host traits break rootful podman's defaults (both seen on sandboxed
# Debian 12 VMs):
#  - hybrid cgroups (v1 controllers plus a v2 hierarchy that holds one, e.g.
#    hugetlb): crun refuses them ("cgroups in hybrid mode not supported");
#    runc runs them.
#  - capped resource limits: as root podman raises RLIMIT_NOFILE and
#    RLIMIT_NPROC to 1048576 for every container, which fails without
#    CAP_SYS_RESOURCE ("setrlimit ... Operation not permitted").
#
# Usage: source deploy/container/podman-env.sh; colod_podman_env IMAGE
# IMAGE is any local image to probe with (the base image).
colod_podman_env() {
  local image=$1 conf runtime nofile nproc
  if podman run --rm --network none "$image" true >/dev/null 2>&1; then return 0; fi
  conf=${COLOD_PODMAN_CONF:-/tmp/colod-containers.conf}
  nofile=$(ulimit -Hn)
  [[ $nofile == unlimited ]] && nofile=1048576
  for runtime in crun runc; do
    command -v "$runtime" >/dev/null || continue
    # The largest process limit the host lets a container set: the hard limit,
    # halved until accepted (the sandbox may cap it below what ulimit shows).
    nproc=$(ulimit -Hu)
    [[ $nproc == unlimited ]] && nproc=1048576
    while ((nproc >= 1024)); do
      cat >"$conf" <<EOF
# Written by colod's deploy/container/podman-env.sh for this host.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "$runtime"
EOF
      if CONTAINERS_CONF=$conf podman run --rm --network none "$image" true >/dev/null 2>&1; then
        export CONTAINERS_CONF=$conf
        echo "podman: using $conf (runtime $runtime, nofile $nofile, nproc $nproc): the defaults do not run here" >&2
        return 0
      fi
      nproc=$((nproc / 2))
    done
  done
  echo "podman: cannot run a container on this host; the last error:" >&2
  podman run --rm --network none "$image" true >&2 || true
  return 1
}

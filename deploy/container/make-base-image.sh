#!/usr/bin/env bash
# Builds a Debian 12 (bookworm) base image from Debian's own packages with
# debootstrap and imports it into podman, for machines that reach Debian's
# package registry but no container registry. The result stands in for the
# public debian:12-slim image as the images' BASE.
#
#   deploy/container/make-base-image.sh [TAG]     (default: localhost/colod-base:bookworm)
#
# Environment: COLOD_DEBIAN_MIRROR (default: the first deb.debian.org-style URI
# in /etc/apt/sources*, else http://deb.debian.org/debian). Needs root, podman
# and debootstrap. Takes about a minute and a half; nothing is left behind but
# the image.
set -euo pipefail

tag=${1:-localhost/colod-base:bookworm}
[[ $(id -u) -eq 0 ]] || { echo "make-base-image: needs root (debootstrap)" >&2; exit 1; }
for tool in debootstrap podman; do
  command -v "$tool" >/dev/null || { echo "make-base-image: '$tool' is missing (apt-get install $tool)" >&2; exit 1; }
done

mirror=${COLOD_DEBIAN_MIRROR:-}
if [[ -z $mirror ]]; then
  # The mirror this machine already uses (a .sources file's URIs: or a sources.list line).
  mirror=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
           grep -v security | sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//' |
           awk '{print $1}' | grep -m1 -E '^https?://' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi

root=$(mktemp -d /tmp/colod-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT

echo "make-base-image: debootstrap --variant=minbase bookworm from $mirror" >&2
debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 || {
  tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"

# What debian:12-slim leaves out or sets up: no package caches or lists, no
# documentation, the security suite in the sources, apt without recommends.
cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${mirror%/debian}/debian-security bookworm-security main
EOF
cat >"$root/etc/apt/apt.conf.d/90colod-slim" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
EOF
cat >"$root/etc/dpkg/dpkg.cfg.d/90colod-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/log/*.log
# The base-files licenses stay: /usr/share/common-licenses holds texts the tests train on.

tar -C "$root" --numeric-owner -c . |
  podman import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
echo "make-base-image: $tag" >&2

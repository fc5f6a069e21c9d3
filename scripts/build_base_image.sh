#!/usr/bin/env bash
# Build a local stand-in for python:3.11-slim where no image registry can be reached:
# Debian bookworm (python3.11, venv, ca-certificates) made with debootstrap from Debian's own
# mirror and imported with `docker import`. The Dockerfiles only need `python3 -m venv`, so this
# image works as their BASE build argument. The host's CA bundle is copied in (HOST_CA_BUNDLE=none: not).
#
#   scripts/build_base_image.sh [TAG]          (default TAG: prorag-local/python:3.11-bookworm)
#
# Needs root, debootstrap (apt-get install debootstrap) and a running Docker engine.
set -euo pipefail
TAG="${1:-prorag-local/python:3.11-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
ROOTFS="${ROOTFS:-/var/tmp/prorag-bookworm-rootfs}"

if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG already present"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install -y debootstrap" >&2; exit 1; }
if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
  rm -rf "$ROOTFS"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libgomp1 \
    bookworm "$ROOTFS" "$MIRROR"
fi
# trust what the host trusts: pip inside the builds then works behind a TLS-intercepting proxy too
if [ "${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}" != none ] && [ -f "${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}" ]; then
  cp "${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
fi
# slim it down the way the official slim images are: no apt lists, no docs
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/var/cache/apt/*.bin
tar -C "$ROOTFS" -c . | docker import \
  -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  -c 'CMD ["python3"]' - "$TAG"
docker run --rm --network host "$TAG" python3 -c 'import sys, venv; print("base image ok:", sys.version.split()[0])'
echo "built $TAG"

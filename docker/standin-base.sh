#!/usr/bin/env bash
# Build a local stand-in for the `python:3.11-slim` base image from Debian's packages, for
# machines that reach Debian's archive and PyPI but no image registry.
#
#   docker/standin-base.sh [TAG]      default TAG: hdr-standin/python:3.11-slim
#
# What it is: Debian bookworm minbase (debootstrap) with python3 3.11, pip and venv, plus the
# names the official image has (`python`, `pip`), without Debian's externally-managed marker,
# and with this host's CA bundle and pip settings copied in, so that pip inside an image build
# reaches the package index through whatever TLS proxy the host itself trusts. Only the host's
# `cert` setting is carried over (its other pip sources are local paths a build cannot see).
# Build the images on it with `--build-arg BASE_IMAGE=TAG`.
#
# Settings: HDR_DEBIAN_MIRROR (default http://deb.debian.org/debian), HDR_CA_BUNDLE (default
# /etc/ssl/certs/ca-certificates.crt). Needs root and debootstrap.
set -euo pipefail

TAG="${1:-hdr-standin/python:3.11-slim}"
MIRROR="${HDR_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CA_BUNDLE="${HDR_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

log() { echo "standin-base: $*" >&2; }

ROOTFS="$(mktemp -d /var/tmp/hdr-standin.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT

log "debootstrap bookworm ($MIRROR) into $ROOTFS"
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || {
    tail -30 "$ROOTFS.log" >&2
    rm -f "$ROOTFS.log"
    exit 1
}
rm -f "$ROOTFS.log"

# The official image's names and behaviour: `python` and `pip`, pip allowed outside a venv.
ln -sf python3 "$ROOTFS/usr/bin/python"
ln -sf pip3 "$ROOTFS/usr/bin/pip"
rm -f "$ROOTFS"/usr/lib/python3.*/EXTERNALLY-MANAGED
# This host's trust store, used by pip (which otherwise trusts only its own bundle).
if [[ -f "$CA_BUNDLE" ]]; then
    cp "$CA_BUNDLE" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$ROOTFS/etc/pip.conf"
fi
# What the slim image does not carry: apt lists, caches, docs, man pages.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
    "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/*

log "importing as $TAG"
tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "stand-in for python:3.11-slim: Debian bookworm minbase + python3" \
    - "$TAG" >/dev/null
log "built $TAG ($(docker image inspect --format '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"

#!/usr/bin/env bash
# Build a container image of dispatchd from Debian packages and this checkout,
# without pulling any image from a registry: debootstrap makes the root file
# system from the Debian archive, the project is installed into a venv in it,
# and the engine imports the tree as an image.
#
#   sudo packaging/kubernetes/build-image.sh [IMAGE]     (default dispatchd:VERSION)
#
# Needs root (debootstrap, chroot), debootstrap (apt-get install debootstrap),
# and podman or docker for the import (DISPATCH_ENGINE=podman|docker). Not run
# by this project's tests: no container engine on the machines that run them.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "build-image.sh: run as root (debootstrap and chroot need it)" >&2; exit 2; }
command -v debootstrap >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }
engine=${DISPATCH_ENGINE:-$(command -v podman || command -v docker || true)}
[ -n "$engine" ] || { echo "build-image.sh: no podman or docker to import the image with" >&2; exit 2; }
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' dispatchd/__init__.py)
image=${1:-dispatchd:$version}
suite=${DISPATCH_SUITE:-bookworm}
mirror=${DISPATCH_MIRROR:-http://deb.debian.org/debian}

work=$(mktemp -d)
trap 'umount "$work/root/proc" 2>/dev/null || true; rm -rf "$work"' EXIT
root=$work/root
# What dispatchd needs at run time (scripts/_common.sh has the reasons), and
# what pip needs to build its C helper (removed again below).
run_pkgs=python3,python3-venv,libseccomp2,git,passt,nftables,ca-certificates
build_pkgs=gcc,python3-dev
debootstrap --variant=minbase --include="$run_pkgs,$build_pkgs" "$suite" "$root" "$mirror"

# The project, as an sdist of this checkout (nothing of .git or a venv).
mkdir -p "$root/tmp/src"
tar --exclude=./.git --exclude=./.venv --exclude='__pycache__' -cf - . | tar -C "$root/tmp/src" -xf -
mount -t proc proc "$root/proc"
chroot "$root" /bin/sh -euc '
    python3 -m venv /opt/dispatchd
    /opt/dispatchd/bin/pip install --no-cache-dir /tmp/src
    ln -s /opt/dispatchd/bin/dispatch /usr/local/bin/dispatch
    ln -s /opt/dispatchd/bin/dispatchd /usr/local/bin/dispatchd
    useradd --uid 1000 --create-home --shell /bin/sh dispatch
    mkdir -p /work && chown dispatch: /work
    DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq gcc python3-dev cpp
    DEBIAN_FRONTEND=noninteractive apt-get autoremove -y -qq
    apt-get clean
    rm -rf /tmp/src /var/lib/apt/lists/*
'
umount "$root/proc"

# pip reaches PyPI for the project's dependencies (msgspec...): the only
# network the build uses besides the Debian mirror.
tar -C "$root" --numeric-owner -cf "$work/rootfs.tar" .
"$engine" import \
    --change 'USER 1000:1000' \
    --change 'WORKDIR /work' \
    --change 'ENV XDG_STATE_HOME=/home/dispatch/.local/state HOME=/home/dispatch' \
    --change 'ENTRYPOINT ["/opt/dispatchd/bin/dispatchd"]' \
    "$work/rootfs.tar" "$image"
echo "built $image"

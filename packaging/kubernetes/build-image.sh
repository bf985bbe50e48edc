#!/usr/bin/env bash
# Build a container image of dispatchd from Debian packages and this checkout,
# without pulling any image from a registry: mmdebstrap makes the root file
# system from the Debian archive that this machine's apt uses, the project and
# its Python dependencies go into a venv in it from wheels built here, and the
# engine imports the tree as an image.
#
#   packaging/kubernetes/build-image.sh [--tar FILE | --import FILE] [IMAGE]
#
#   --tar FILE     write the root file system (a tar) to FILE and import nothing
#   --import FILE  build nothing: import FILE, made earlier with --tar, with
#                  the image's settings (a cache of the tree is imported so)
#   IMAGE          the name `podman import` (or `docker import`) gives it;
#                  default dispatchd:VERSION
#
# Runs as root or as an ordinary user: mmdebstrap's `unshare` mode makes the
# tree inside a user namespace of the caller's subordinate ids (/etc/subuid,
# newuidmap from uidmap). Needs mmdebstrap, gcc and python3-dev (the C helper's
# wheel), and podman or docker for the import. The network it uses: the Debian
# archive, and PyPI for the wheels of the dependencies.
# tests/integration/test_image.py runs it as the test user.
#
# Environment:
#   DISPATCH_APT_SOURCES  the apt sources the tree is made from; default this
#                         machine's own Debian entries (debian.sources, or
#                         sources.list)
#   DISPATCH_SUITE        default this machine's release (VERSION_CODENAME):
#                         the wheels built here, the C helper's among them,
#                         are for this machine's Python, which the image
#                         must then have too
#   DISPATCH_ENGINE       the engine's command, options allowed (split on
#                         blanks); default podman, else docker
#   DISPATCH_PYTHON       the Python that builds the wheels (default
#                         /usr/bin/python3, Debian's, as in the image)
set -euo pipefail
cd "$(dirname "$0")/../.."

tar_out="" tar_in=""
case "${1:-}" in
    --tar|--import)
        [ -n "${2:-}" ] || { echo "build-image.sh: $1 needs a file name" >&2; exit 2; }
        if [ "$1" = --tar ]; then tar_out=$2; else tar_in=$2; fi
        shift 2 ;;
esac
engine=""
if [ -z "$tar_out" ]; then
    engine=${DISPATCH_ENGINE:-$(command -v podman || command -v docker || true)}
    [ -n "$engine" ] || { echo "build-image.sh: no podman or docker to import the image with (or give --tar FILE)" >&2; exit 2; }
fi
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' dispatchd/__init__.py)
image=${1:-dispatchd:$version}

# The image's settings mirror packaging/kubernetes/daemonset.yaml: uid 1000,
# the socket in /run/dispatchd (a host path there), worktrees in /work.
import_image() {
    local cmd
    read -ra cmd <<<"$engine"  # DISPATCH_ENGINE may carry options: "podman --root DIR"
    "${cmd[@]}" import \
        --change 'USER 1000:1000' \
        --change 'WORKDIR /work' \
        --change 'ENV HOME=/home/dispatch' \
        --change 'ENV XDG_STATE_HOME=/home/dispatch/.local/state' \
        --change 'ENV DISPATCH_SOCKET=/run/dispatchd/dispatchd.sock' \
        --change 'ENTRYPOINT ["/opt/dispatchd/bin/dispatchd"]' \
        "$1" "$image"
    echo "built $image"
}
if [ -n "$tar_in" ]; then
    import_image "$tar_in"
    exit 0
fi
command -v mmdebstrap >/dev/null \
    || { echo "build-image.sh: mmdebstrap is missing (apt-get install mmdebstrap; scripts/_common.sh installs it)" >&2; exit 2; }
suite=${DISPATCH_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-}")}
[ -n "$suite" ] || { echo "build-image.sh: this machine names no Debian release: set DISPATCH_SUITE" >&2; exit 2; }
sources=${DISPATCH_APT_SOURCES:-}
if [ -z "$sources" ]; then
    for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
        [ -s "$f" ] && { sources=$f; break; }
    done
fi
[ -n "$sources" ] && [ -r "$sources" ] \
    || { echo "build-image.sh: no apt sources to build from: set DISPATCH_APT_SOURCES to a sources file" >&2; exit 2; }
python=${DISPATCH_PYTHON:-/usr/bin/python3}
if [ "$(id -u)" = 0 ]; then mode=root; else mode=unshare; fi

work=$(mktemp -d "${TMPDIR:-/tmp}/dispatchd-image-XXXXXX")
trap 'chmod -R u+rwx "$work" 2>/dev/null; rm -rf "$work"' EXIT

# The wheels, built here: this checkout's (with its C helper, compiled against
# this machine's Python, the image's too) and its dependencies', which pip
# fetches from PyPI. The image then needs no compiler and its build no network
# but the Debian archive.
"$python" -m venv "$work/buildenv"
"$work/buildenv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip wheel setuptools
mkdir "$work/src"
tar --exclude=./.git --exclude=./.venv --exclude='__pycache__' --exclude='*.so' --exclude=./.pytest_cache \
    --exclude=./.mypy_cache -cf - . | tar -C "$work/src" -xf -
"$work/buildenv/bin/pip" wheel --quiet --disable-pip-version-check --wheel-dir "$work/wheels" "$work/src"
ls "$work"/wheels/dispatchd-*.whl >/dev/null
# the C helper must be in the wheel: without it the image would run the slower
# Python path and say so, which is not what this script promises
unzip_list=$("$python" -c 'import sys, zipfile; print("\n".join(zipfile.ZipFile(sys.argv[1]).namelist()))' \
    "$work"/wheels/dispatchd-*.whl)
grep -q '^dispatchd/tools/_lines\..*\.so$' <<<"$unzip_list" \
    || { echo "build-image.sh: the wheel has no C helper (gcc and python3-dev are needed to build it)" >&2; exit 1; }

# What dispatchd needs at run time (scripts/_common.sh has the reasons): Python
# and its venv module, libseccomp, git, the network stacks (slirp4netns, the
# daemon's choice, and pasta from passt, for --network-stack pasta), nftables;
# bash for the shell tool; passwd for useradd (in every variant, named for clarity).
run_pkgs=python3,python3-venv,libseccomp2,git,slirp4netns,passt,nftables,ca-certificates,bash,passwd
# mmdebstrap runs the hooks with $1 the tree; in unshare mode as root of a user
# namespace of the caller's, so the ownership below is the image's own.
# --skip=cleanup/run: /run/dispatchd, the socket's directory, is made here.
mmdebstrap --mode="$mode" --variant=minbase --include="$run_pkgs" --format=tar --skip=cleanup/run \
    --customize-hook='mkdir -p "$1/tmp/wheels"' \
    --customize-hook="copy-in $work/wheels/. /tmp/wheels" \
    --customize-hook='chroot "$1" /bin/sh -euc "
        python3 -m venv /opt/dispatchd
        /opt/dispatchd/bin/pip install --quiet --no-index --find-links /tmp/wheels --disable-pip-version-check dispatchd
        ln -s /opt/dispatchd/bin/dispatch /usr/local/bin/dispatch
        ln -s /opt/dispatchd/bin/dispatchd /usr/local/bin/dispatchd
        useradd --uid 1000 --user-group --create-home --shell /bin/bash dispatch
        install -d -o dispatch -g dispatch -m 0700 /home/dispatch/.local /home/dispatch/.local/state
        install -d -o dispatch -g dispatch -m 0700 /run/dispatchd
        install -d -o dispatch -g dispatch -m 0755 /work
        rm -rf /tmp/wheels /var/lib/apt/lists/* /var/cache/apt/*.bin /root/.cache
    "' \
    --customize-hook='rm -f "$1/etc/resolv.conf" "$1/etc/hostname"' \
    "$suite" "$work/rootfs.tar" "$sources"

if [ -n "$tar_out" ]; then
    mv "$work/rootfs.tar" "$tar_out"
    echo "built $tar_out"
    exit 0
fi
import_image "$work/rootfs.tar"

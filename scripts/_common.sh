# Shared by scripts/test, scripts/demo and scripts/bench: set up the venv, and
# when run as root, provision an unprivileged user and re-run as it.
# Source it after `cd` to the repository root; it defines two functions.

# as_unprivileged_user SCRIPT ARGS...: as root, install the Debian packages
# dispatchd needs, create $DISPATCH_TEST_USER, copy this tree into its home and
# exec SCRIPT there as that user. As anyone else, return and carry on.
as_unprivileged_user() {
    [ "$(id -u)" = 0 ] || return 0
    local script=$1; shift
    local user=${DISPATCH_TEST_USER:-dispatchtest}
    local missing=()
    [ -x /usr/bin/python3 ] || missing+=(python3)
    /usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
    # grep reads it all (no -q): an early exit would end ldconfig with SIGPIPE,
    # which pipefail reports as the library missing
    ldconfig -p | grep 'libseccomp\.so\.2' >/dev/null || missing+=(libseccomp2)
    command -v git >/dev/null || missing+=(git)
    command -v runuser >/dev/null || missing+=(util-linux)
    # systemd-analyze and systemd-socket-activate, for tests/integration/test_systemd.py
    command -v systemd-analyze >/dev/null || missing+=(systemd)
    # the user-mode network stacks a session with the network on reaches out
    # through (slirp4netns, the daemon's choice where installed, and pasta:
    # the tests run both; docs/network.md, "Which stack"), and nftables,
    # which holds "ports" inside a session's own network namespace
    command -v slirp4netns >/dev/null || missing+=(slirp4netns)
    command -v pasta >/dev/null || missing+=(passt)
    command -v nft >/dev/null || missing+=(nftables)
    # patchelf, which gives a copy of slirp4netns a RUNPATH outside the
    # system's directories (tests/integration/test_stack_choice.py: a stack
    # built into /opt or a home directory loads its libraries from there)
    command -v patchelf >/dev/null || missing+=(patchelf)
    # the C helper of read_file and search_files (dispatchd/tools/_lines.c),
    # built by pip at install: a compiler and the headers of Debian's Python
    command -v gcc >/dev/null || missing+=(gcc)
    [ -f "$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)/Python.h" ] \
        || missing+=(python3-dev)
    # the baseline of search_files in ./scripts/bench
    command -v rg >/dev/null || missing+=(ripgrep)
    # apparmor_parser, which checks packaging/apparmor's profile (parsed only,
    # never loaded: tests/unit/test_apparmor_profile.py)
    [ -x /usr/sbin/apparmor_parser ] || missing+=(apparmor)
    # sshd and ssh, for tests/integration/test_remote.py: the test starts its
    # own unprivileged sshd on loopback to reach `dispatch bridge` over ssh
    [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
    command -v ssh >/dev/null || missing+=(openssh-client)
    # a rootless container engine, for tests/integration/test_container.py
    # (dispatchd inside Podman, with its defaults and with the flags of
    # packaging/containers/README.md); runc, as crun refuses a hybrid cgroup
    # hierarchy; uidmap for the test user's subordinate ids
    command -v podman >/dev/null || missing+=(podman)
    [ -x /usr/sbin/runc ] || missing+=(runc)
    command -v newuidmap >/dev/null || missing+=(uidmap)
    # mmdebstrap, which packaging/kubernetes/build-image.sh makes the image's
    # tree with from the Debian archive, as the test user (its unshare mode:
    # tests/integration/test_image.py)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing Debian packages: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    fi
    allow_tun
    id -u "$user" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$user"
    local home
    home=$(getent passwd "$user" | cut -d: -f6)
    # A copy of this tree of its own for each run (two runs at once never
    # delete each other's), with its venv kept per checkout between runs.
    local key dest venv venv_lock
    key=$(pwd -P | sha256sum | cut -c1-12)
    dest=$(mktemp -d "$home/dispatchd-run-XXXXXX")
    venv="$home/.cache/dispatchd-venvs/$key"
    tar --exclude=./.venv --exclude=./.git --exclude='__pycache__' --exclude=./.pytest_cache -cf - . | tar -C "$dest" -xf -
    mkdir -p "$venv"
    # The venv's editable install points at one run's copy: a second run of
    # the same checkout at once would point it at its own, and delete it
    # under the first when it ends. Runs of one checkout take turns (runs of
    # other checkouts have venvs of their own and go on side by side).
    exec {venv_lock}>"$venv.lock"
    if ! flock -n "$venv_lock"; then
        echo "another run of this checkout uses $venv: waiting for it to end"
        flock "$venv_lock"
    fi
    chown -R "$user:" "$dest"
    chown "$user:" "$home/.cache" "$home/.cache/dispatchd-venvs" "$venv"
    local cgroup
    cgroup=$(delegate_test_cgroup "$user")
    # Nothing of the run is left behind, however it ends (Ctrl-C included):
    # its copy, and its cgroup (emptied first). Globals: the trap runs after
    # this function's locals are gone.
    _RUN_DEST=$dest _RUN_CGROUP=$cgroup
    trap _end_run EXIT
    trap 'exit 130' INT TERM
    echo "dispatchd runs as an ordinary user: continuing as $user in $dest"
    # DISPATCH_TEST_PATH_FIRST=DIR: DIR ahead of the system's on the run's PATH,
    # for another build of a program the tests run (a stack: docs/network.md,
    # "Versions verified"); it must be readable by $user.
    [ -z "${DISPATCH_TEST_PATH_FIRST:-}" ] || echo "PATH starts with $DISPATCH_TEST_PATH_FIRST"
    local status=0
    runuser -u "$user" -- env -i HOME="$home" USER="$user" LOGNAME="$user" \
        PATH=${DISPATCH_TEST_PATH_FIRST:+$DISPATCH_TEST_PATH_FIRST:}/usr/local/bin:/usr/bin:/bin \
        LANG=C.UTF-8 ${CI:+CI=$CI} \
        ${DISPATCH_TYPECHECK:+DISPATCH_TYPECHECK=$DISPATCH_TYPECHECK} \
        ${DISPATCH_TEST_WORKERS:+DISPATCH_TEST_WORKERS=$DISPATCH_TEST_WORKERS} \
        DISPATCHD_VENV="$venv" ${cgroup:+DISPATCHD_TEST_CGROUP=$cgroup} \
        bash "$dest/$script" "$@" {venv_lock}>&- || status=$?
    exit "$status"
}

# _end_run: the EXIT trap of a root run: remove its copy and its cgroup, and
# say so if either is still there (a process of the run that would not die).
_end_run() {
    local dest=${_RUN_DEST:-} cgroup=${_RUN_CGROUP:-}
    [ -n "$dest" ] && rm -rf "$dest"
    if [ -n "$cgroup" ]; then
        echo $$ >"$(dirname "$cgroup")/cgroup.procs" 2>/dev/null  # out of it first, or the kill ends us
        remove_test_cgroup "$cgroup"
    fi
    [ -n "$dest" ] && [ -e "$dest" ] && echo "warning: $dest is left behind" >&2
    [ -n "$cgroup" ] && [ -e "$cgroup" ] && echo "warning: the cgroup $cgroup is left behind" >&2
    return 0
}

# show_command WORD...: print a command as one would type it, quoting the
# words that need it (the demo echoes what it runs).
show_command() {
    local out="" word
    for word in "$@"; do
        if [[ $word =~ ^[A-Za-z0-9_./=:,@%+-]+$ ]]; then
            out+=" $word"
        else
            out+=" ${word@Q}"
        fi
    done
    printf '%s\n' "${out# }"
}

# allow_tun: pasta and slirp4netns open /dev/net/tun inside the user's own
# namespaces; distributions ship it 0666, some machine images 0600 (root only).
allow_tun() {
    [ -c /dev/net/tun ] || { mkdir -p /dev/net && mknod -m 0666 /dev/net/tun c 10 200; } 2>/dev/null || return 0
    chmod 0666 /dev/net/tun 2>/dev/null || true
}

# remove_test_cgroup DIR: kill what is left in DIR's subtree and remove it, leaves first.
remove_test_cgroup() {
    local base=$1 d
    [ -d "$base" ] || return 0
    for d in $(find "$base" -depth -type d); do
        [ -f "$d/cgroup.kill" ] && echo 1 >"$d/cgroup.kill" 2>/dev/null
    done
    sleep 0.2
    find "$base" -depth -type d -exec rmdir {} \; 2>/dev/null || true
}

# delegate_test_cgroup USER: as root, give USER a cgroup v2 subtree, the way
# systemd's Delegate=yes gives one to the dispatchd service, so that the tests
# of per-session cgroups run for real; prints its path (nothing if cgroup v2
# cannot be written here, and the tests then check the fallback). This shell
# moves into BASE/runner: a process can only be moved between cgroups by a
# user who may write the cgroup.procs of their common ancestor, BASE.
delegate_test_cgroup() {
    local user=$1 mount base c
    mount=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/self/mounts)
    [ -n "$mount" ] || return 0
    base="$mount/dispatchd-test-$$"
    mkdir -p "$base/runner" 2>/dev/null || return 0
    for c in pids memory cpu; do
        # Offer to BASE each controller the machine has in cgroup v2 (not all
        # are: a hybrid hierarchy keeps them in v1); the tests see which.
        grep -qw "$c" "$mount/cgroup.controllers" && echo "+$c" >"$mount/cgroup.subtree_control" 2>/dev/null
    done
    chown "$user:" "$base" "$base/cgroup.procs" "$base/cgroup.subtree_control" "$base/cgroup.threads" || return 0
    echo $$ >"$base/runner/cgroup.procs" 2>/dev/null || { remove_test_cgroup "$base"; return 0; }
    echo "$base"
}

# ensure_venv: .venv from Debian's python3 (not a pyenv build another user
# cannot enter), with the project installed in it, editable.
ensure_venv() {
    local python=/usr/bin/python3
    [ -x "$python" ] || python=$(command -v python3)
    if [ -n "${DISPATCHD_VENV:-}" ]; then
        # a run copied here by as_unprivileged_user: the venv lives beside, per checkout
        [ -x "$DISPATCHD_VENV/bin/python" ] || "$python" -m venv "$DISPATCHD_VENV"
        ln -sfn "$DISPATCHD_VENV" .venv
    fi
    if [ ! -x .venv/bin/python ]; then
        [ -n "${VERBOSE_SETUP:-}" ] && echo "==> creating the virtual environment .venv (with $python)"
        "$python" -m venv .venv
    fi
    [ -n "${VERBOSE_SETUP:-}" ] && echo "==> installing dispatchd into .venv (pip; about a minute the first time)"
    .venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
}

# cpu_seconds: the CPU time (user + system, in seconds) used so far by this
# run: its cgroup's subtree when ./scripts/test made one, else this shell's
# waited-for children.
cpu_seconds() {
    local stat=${DISPATCHD_TEST_CGROUP:+$DISPATCHD_TEST_CGROUP/cpu.stat}
    if [ -n "$stat" ] && [ -r "$stat" ]; then
        awk '$1 == "usage_usec" { printf "%.1f\n", $2 / 1e6 }' "$stat"
    else
        # `times`, second line: the children's user and system time, "XmY.YYYs"
        times | awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] } printf "%.1f\n", t }'
    fi
}

# run_summary START CPU_BEFORE STATS: one line of what a test run cost: wall
# time, the load then, CPU seconds, daemons started and seconds slept (the
# sum over the STATS lines the pytest processes appended).
run_summary() {
    local start=$1 cpu_before=$2 stats=$3
    [ -f "$stats" ] || : >"$stats"
    awk -v start="$start" -v now="$(date +%s.%N)" -v cpu0="$cpu_before" -v cpu1="$(cpu_seconds)" \
        -v load="$(cut -d' ' -f1-3 /proc/loadavg)" -v cores="$(nproc)" '
        { for (i = 1; i <= NF; i++) { split($i, kv, "="); sum[kv[1]] += kv[2] } }
        END { printf "==> run: %.0f s wall (load %s on %d cores), %.0f s CPU, %d daemons started, %.0f s slept in tests\n",
                     now - start, load, cores, cpu1 - cpu0, sum["daemons"], sum["slept"] }' "$stats"
}

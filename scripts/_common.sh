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
    ldconfig -p | grep -q 'libseccomp\.so\.2' || missing+=(libseccomp2)
    command -v git >/dev/null || missing+=(git)
    command -v runuser >/dev/null || missing+=(util-linux)
    # systemd-analyze and systemd-socket-activate, for tests/integration/test_systemd.py
    command -v systemd-analyze >/dev/null || missing+=(systemd)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing Debian packages: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    fi
    id -u "$user" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$user"
    local home
    home=$(getent passwd "$user" | cut -d: -f6)
    local dest="$home/dispatchd"
    rm -rf "$dest"
    mkdir -p "$dest"
    tar --exclude=./.venv --exclude=./.git --exclude='__pycache__' --exclude=./.pytest_cache -cf - . | tar -C "$dest" -xf -
    chown -R "$user:" "$dest"
    local cgroup
    cgroup=$(delegate_test_cgroup "$user")
    echo "dispatchd runs as an ordinary user: continuing as $user in $dest"
    exec runuser -u "$user" -- env -i HOME="$home" USER="$user" LOGNAME="$user" \
        PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 ${CI:+CI=$CI} \
        ${cgroup:+DISPATCHD_TEST_CGROUP=$cgroup} \
        bash "$dest/$script" "$@"
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
    base="$mount/dispatchd-test"
    mkdir -p "$base/runner" 2>/dev/null || return 0
    for c in pids memory cpu; do
        # Offer to BASE each controller the machine has in cgroup v2 (not all
        # are: a hybrid hierarchy keeps them in v1); the tests see which.
        grep -qw "$c" "$mount/cgroup.controllers" && echo "+$c" >"$mount/cgroup.subtree_control" 2>/dev/null
    done
    chown "$user:" "$base" "$base/cgroup.procs" "$base/cgroup.subtree_control" "$base/cgroup.threads" || return 0
    echo $$ >"$base/runner/cgroup.procs" 2>/dev/null || return 0
    echo "$base"
}

# ensure_venv: .venv from Debian's python3 (not a pyenv build another user
# cannot enter), with the project installed in it, editable.
ensure_venv() {
    local python=/usr/bin/python3
    [ -x "$python" ] || python=$(command -v python3)
    [ -x .venv/bin/python ] || "$python" -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
}

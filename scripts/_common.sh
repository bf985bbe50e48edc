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
    echo "dispatchd runs as an ordinary user: continuing as $user in $dest"
    exec runuser -u "$user" -- env -i HOME="$home" USER="$user" LOGNAME="$user" \
        PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 ${CI:+CI=$CI} \
        bash "$dest/$script" "$@"
}

# ensure_venv: .venv from Debian's python3 (not a pyenv build another user
# cannot enter), with the project installed in it, editable.
ensure_venv() {
    local python=/usr/bin/python3
    [ -x "$python" ] || python=$(command -v python3)
    [ -x .venv/bin/python ] || "$python" -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
}

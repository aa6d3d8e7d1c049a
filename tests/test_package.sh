#!/bin/sh
# test_package: `make install` and the Debian package, checked without
# touching this machine. It builds the package as `make deb` does (own
# build dir, prefix /usr), inspects it with dpkg-deb (files, Depends,
# conffiles, maintainer scripts), unpacks it into a throwaway root
# (dpkg -x) where the binary must run and `systemd-analyze verify` must
# accept every unit, runs the maintainer scripts against logging stand-ins
# for useradd & co., and stages `cmake --install` into a DESTDIR.
#   KSCORE_SOURCE_DIR  the source tree;  KSCORE_BUILD_DIR  the ctest build
#   KSCORE_DEB         use this .deb instead of building one
set -eu

SRC=${KSCORE_SOURCE_DIR:?KSCORE_SOURCE_DIR is not set}
BUILD=${KSCORE_BUILD_DIR:?KSCORE_BUILD_DIR is not set}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kscore-pkg.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fails=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fails=$((fails + 1)); }
check() { # check DESCRIPTION COMMAND...
    d=$1; shift
    if "$@" >"$WORK/out" 2>&1; then ok "$d"; else bad "$d"; sed 's/^/     /' "$WORK/out"; fi
}

for tool in dpkg-deb cpack; do
    command -v $tool >/dev/null || { echo "SKIP: no $tool"; exit 77; }
done

# ---- the package ----------------------------------------------------------
DEB=${KSCORE_DEB:-}
if [ -z "$DEB" ]; then
    cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCMAKE_INSTALL_PREFIX=/usr -DKSCORE_SYSTEMD_UNITDIR=/lib/systemd/system \
        >"$WORK/cmake.log" 2>&1 || { cat "$WORK/cmake.log"; exit 1; }
    cmake --build "$WORK/build" -j2 --target kscore man >"$WORK/build.log" 2>&1 ||
        { tail -50 "$WORK/build.log"; exit 1; }
    (cd "$WORK/build" && cpack -G DEB) >"$WORK/cpack.log" 2>&1 ||
        { cat "$WORK/cpack.log"; exit 1; }
    DEB=$(ls "$WORK"/build/kscore_*.deb)
fi
echo "package: $DEB"
dpkg-deb -I "$DEB" >"$WORK/info"
dpkg-deb -c "$DEB" | awk '{print $1, $2, $6}' | sed 's#^\(.*\) \./#\1 /#' >"$WORK/files"
has_file() { grep -q " $1\$" "$WORK/files"; }
mode_of() { awk -v f="$1" '$3 == f {print $1 " " $2}' "$WORK/files"; }

for f in /usr/bin/kscore /usr/libexec/kscore/kscore-daemon \
    /lib/systemd/system/kscore-broker.service \
    /lib/systemd/system/kscore-agent.service /etc/kscore/broker.conf \
    /etc/kscore/agent.conf /lib/systemd/system/kscore-stack.service \
    /lib/systemd/system/kscore-stack-watch.service \
    /lib/systemd/system/kscore-stack-watch.timer /etc/default/kscore-stack; do
    check "package holds $f" has_file "$f"
done
# What the other install() rules add (man pages, bash completion) is in
# the package when those rules exist in this tree.
if [ -d "$SRC/deploy/man" ]; then
    check "package holds a man page" grep -q ' /usr/share/man/man[0-9]/kscore' "$WORK/files"
fi
if [ -f "$SRC/deploy/bash-completion/kscore" ]; then
    check "package holds the bash completion" grep -q ' /usr/share/bash-completion/completions/kscore$' "$WORK/files"
fi
check "no build path leaks into the package" sh -c "! grep -q ' /work\| /tmp\| /home' '$WORK/files'"
check "binary is root-owned 0755" test "$(mode_of /usr/bin/kscore)" = "-rwxr-xr-x root/root"
check "daemon half is root-owned 0755" test "$(mode_of /usr/libexec/kscore/kscore-daemon)" = "-rwxr-xr-x root/root"
check "configs are not world-readable" test "$(mode_of /etc/kscore/broker.conf)" = "-rw-r----- root/root"
check "/etc/default/kscore-stack is 0644" test "$(mode_of /etc/default/kscore-stack)" = "-rw-r--r-- root/root"

depends=$(sed -n 's/^ Depends: //p' "$WORK/info")
echo "Depends: $depends"
for lib in libnats libpq5 libprotobuf-c1 libjansson4 libssl3 libuuid1 passwd; do
    check "Depends names $lib" sh -c "echo '$depends' | grep -q '$lib'"
done
if grep -q microhttpd "$SRC/CMakeLists.txt" "$SRC"/*/CMakeLists.txt 2>/dev/null; then
    check "Depends names libmicrohttpd" sh -c "echo '$depends' | grep -q libmicrohttpd"
fi

mkdir "$WORK/ctl"
dpkg-deb -e "$DEB" "$WORK/ctl"
check "conffiles lists both configs" sh -c "grep -qx /etc/kscore/broker.conf '$WORK/ctl/conffiles' && grep -qx /etc/kscore/agent.conf '$WORK/ctl/conffiles'"
check "conffiles lists the stack's arguments" grep -qx /etc/default/kscore-stack "$WORK/ctl/conffiles"
for s in postinst prerm postrm; do
    check "$s is executable" test -x "$WORK/ctl/$s"
    check "$s is valid sh" sh -n "$WORK/ctl/$s"
done

# ---- the maintainer scripts, against stand-ins that log their calls -------
mkdir "$WORK/shim"
for c in getent groupadd useradd install chgrp chmod systemctl rm rmdir; do
    cat >"$WORK/shim/$c" <<SHIM
#!/bin/sh
echo "$c \$*" >>"$WORK/calls"
[ "$c" = getent ] && exit 2
exit 0
SHIM
    chmod +x "$WORK/shim/$c"
done
runscript() { : >"$WORK/calls"; PATH="$WORK/shim:$PATH" sh "$WORK/ctl/$1" "$2" ${3:-}; }
called() { grep -q -- "$1" "$WORK/calls"; }
check "postinst configure succeeds" runscript postinst configure
check "postinst makes the kscore group" called '^groupadd --system kscore$'
check "postinst makes the kscore system user, no login" called '^useradd --system --gid kscore .*--shell /usr/sbin/nologin.* kscore$'
check "postinst: /etc/kscore root:kscore 0750" called '^install -d -o root -g kscore -m 0750 /etc/kscore$'
check "postinst enables and starts nothing" sh -c "! grep -q 'enable\|start ' '$WORK/calls'"
check "prerm remove succeeds" runscript prerm remove
if [ -d /run/systemd/system ]; then
    check "prerm stops both units" called '^systemctl stop kscore-agent.service kscore-broker.service'
    check "prerm stops the stack's watch" called '^systemctl stop kscore-stack-watch.timer kscore-stack-watch.service'
    check "prerm stops the stack" called '^systemctl stop kscore-stack.service'
fi
check "postrm purge succeeds" runscript postrm purge
check "postrm purge removes the agent's state" called '^rm -rf /var/lib/kscore/agent$'
check "postrm purge keeps the stack (its database and CA)" sh -c "! grep -q '^rm .*/var/lib/kscore\(/stack\)\{0,1\}\$' '$WORK/calls'"
check "postrm purge removes the stack's enable links" called 'timers.target.wants/kscore-stack-watch.timer'
check "postrm purge leaves the kscore user" sh -c "! grep -q userdel '$WORK/calls'"

# ---- unpacked into a throwaway root ---------------------------------------
ROOT="$WORK/root"
dpkg-deb -x "$DEB" "$ROOT"
check "the unpacked binary runs" "$ROOT/usr/bin/kscore" --version
check "the unpacked binary finds every library" sh -c "! ldd '$ROOT/usr/bin/kscore' | grep -q 'not found'"
check "the unpacked daemon half finds every library" sh -c "! ldd '$ROOT/usr/libexec/kscore/kscore-daemon' | grep -q 'not found'"
# The operator's kscore starts like a small C program: what only the
# daemons use is the daemon half's (docs/development.md "Modules").
check "the operator's binary loads no libpq, libmicrohttpd or inih" sh -c "! ldd '$ROOT/usr/bin/kscore' | grep -q 'libpq\|libmicrohttpd\|libinih'"
# kscore finds its daemon half under the prefix it was unpacked to.
check "the unpacked kscore runs its daemon half" "$ROOT/usr/bin/kscore" keygen --help
grep -q '^ExecStart=/usr/bin/kscore broker --config /etc/kscore/broker.conf$' \
    "$ROOT/lib/systemd/system/kscore-broker.service" && ok "broker unit: ExecStart" || bad "broker unit: ExecStart"
grep -q '^ExecStart=/usr/bin/kscore agent --config /etc/kscore/agent.conf$' \
    "$ROOT/lib/systemd/system/kscore-agent.service" && ok "agent unit: ExecStart" || bad "agent unit: ExecStart"
for u in broker agent; do
    f="$ROOT/lib/systemd/system/kscore-$u.service"
    check "$u unit restarts on failure" grep -qx 'Restart=on-failure' "$f"
    check "$u unit restarts without a start limit" grep -qx 'StartLimitIntervalSec=0' "$f"
done
# The example configs are what the units read: the parser must take them
# as they ship (the agent's names a bundle the host does not have yet).
check "broker.conf as shipped parses" "$ROOT/usr/bin/kscore" broker \
    --config "$ROOT/etc/kscore/broker.conf" --show-config
sed '/^bundle/d' "$ROOT/etc/kscore/agent.conf" >"$WORK/agent.conf"
check "agent.conf as shipped parses" "$ROOT/usr/bin/kscore" agent \
    --config "$WORK/agent.conf" --show-config
# Every key the example configs show (set or commented out) has its entry
# in kscore.conf(5), as the package installs it (bundle and metrics_listen
# once had none).
for k in $(sed -n 's/^#\{0,1\}\([a-z_]*\) = .*/\1/p' "$ROOT/etc/kscore/broker.conf" \
        "$ROOT/etc/kscore/agent.conf" | sort -u); do
    check "kscore.conf(5) documents $k" grep -q "^\\\\fB$k\\\\fR = " \
        "$ROOT/usr/share/man/man5/kscore.conf.5"
done
check "broker unit runs as kscore" grep -qx 'User=kscore' "$ROOT/lib/systemd/system/kscore-broker.service"
check "broker unit: NoNewPrivileges" grep -qx 'NoNewPrivileges=yes' "$ROOT/lib/systemd/system/kscore-broker.service"
check "broker unit: control-group kill" grep -qx 'KillMode=control-group' "$ROOT/lib/systemd/system/kscore-broker.service"
a="$ROOT/lib/systemd/system/kscore-agent.service"
check "agent unit: children killed with it (mixed)" grep -qx 'KillMode=mixed' "$a"
check "agent unit: cgroup delegated" grep -qx 'Delegate=yes' "$a"
check "agent unit: not restarted after exit 78 (revoked)" grep -qx 'RestartPreventExitStatus=78' "$a"
check "agent unit: no sandbox its commands would inherit" sh -c "! grep -q '^\(NoNewPrivileges\|ProtectSystem\|ProtectHome\|PrivateTmp\|PrivateDevices\|User\)=' '$a'"
# The control host's stack: `kscore up` / `down` with the arguments of
# /etc/default/kscore-stack, in /var/lib/kscore/stack; the watch reloads
# it (a reload is `up` in the stack's own cgroup).
st="$ROOT/lib/systemd/system/kscore-stack.service"
check "stack unit: ExecStart is kscore up \$KSCORE_UP_ARGS" grep -qx 'ExecStart=/usr/bin/kscore up $KSCORE_UP_ARGS' "$st"
check "stack unit: ExecReload is the same up" grep -qx 'ExecReload=/usr/bin/kscore up $KSCORE_UP_ARGS' "$st"
check "stack unit: ExecStop is kscore down" grep -qx 'ExecStop=/usr/bin/kscore down' "$st"
check "stack unit: oneshot that stays active" sh -c "grep -qx 'Type=oneshot' '$st' && grep -qx 'RemainAfterExit=yes' '$st'"
check "stack unit: KSCORE_HOME is its state dir" sh -c "grep -qx 'Environment=KSCORE_HOME=/var/lib/kscore/stack' '$st' && grep -qx 'StateDirectory=kscore/stack' '$st'"
check "stack unit: reads /etc/default/kscore-stack" grep -qx 'EnvironmentFile=-/etc/default/kscore-stack' "$st"
check "stack unit: runs as root" sh -c "! grep -q '^User=' '$st'"
check "stack watch: only while the stack is active" grep -qx 'ExecCondition=/bin/systemctl is-active --quiet kscore-stack.service' \
    "$ROOT/lib/systemd/system/kscore-stack-watch.service"
check "stack watch: reloads the stack" grep -qx 'ExecStart=/bin/systemctl reload kscore-stack.service' \
    "$ROOT/lib/systemd/system/kscore-stack-watch.service"
check "stack watch timer: every 30 s" grep -qx 'OnUnitActiveSec=30s' "$ROOT/lib/systemd/system/kscore-stack-watch.timer"
# The shipped arguments are ones `kscore up` takes (as the unit passes
# them: one word each).
(. "$ROOT/etc/default/kscore-stack" && echo "$KSCORE_UP_ARGS") >"$WORK/upargs"
check "/etc/default/kscore-stack sets KSCORE_UP_ARGS" test -s "$WORK/upargs"

if command -v systemd-analyze >/dev/null; then
    # verify needs the host's targets (sysinit.target ...) inside the root.
    cp -an /lib/systemd/system/. "$ROOT/lib/systemd/system/" 2>/dev/null || true
    # ... and the host's commands the units run that are not the package's.
    mkdir -p "$ROOT/bin"
    cp -n "$(command -v systemctl || echo /bin/systemctl)" "$ROOT/bin/systemctl" 2>/dev/null || true
    for u in broker.service agent.service stack.service stack-watch.service \
        stack-watch.timer; do
        check "systemd-analyze verify kscore-$u (no warnings)" sh -c \
            "systemd-analyze verify --man=no --root='$ROOT' /lib/systemd/system/kscore-$u 2>&1 | tee /dev/stderr | { ! grep -q .; }"
    done
    exposure=$(systemd-analyze security --offline=yes --root="$ROOT" \
        /lib/systemd/system/kscore-broker.service 2>/dev/null |
        sed -n 's/.*Overall exposure level for kscore-broker.service: \([0-9.]*\).*/\1/p')
    echo "broker unit exposure (systemd-analyze security): ${exposure:-?}"
    if [ -n "$exposure" ]; then
        check "broker unit exposure below 3.0" awk -v e="$exposure" 'BEGIN{exit !(e < 3.0)}'
    fi
else
    echo "skip: no systemd-analyze"
fi

# ---- make install (the ctest build tree, staged) --------------------------
if [ -f "$BUILD/CMakeCache.txt" ]; then
    prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$BUILD/CMakeCache.txt")
    DESTDIR="$WORK/stage" cmake --install "$BUILD" >"$WORK/install.log" 2>&1 ||
        { cat "$WORK/install.log"; bad "cmake --install"; }
    S="$WORK/stage$prefix"
    check "make install: binary" test -x "$S/bin/kscore"
    check "make install: the daemon half" test -x "$S/libexec/kscore/kscore-daemon"
    check "make install: kscore runs its daemon half" "$S/bin/kscore" up --help
    check "make install: units" test -f "$S/lib/systemd/system/kscore-agent.service"
    check "make install: the stack's units" sh -c "test -f '$S/lib/systemd/system/kscore-stack.service' && test -f '$S/lib/systemd/system/kscore-stack-watch.timer'"
    check "make install: the stack unit names its binary" grep -q "^ExecStart=$prefix/bin/kscore up" "$S/lib/systemd/system/kscore-stack.service"
    check "make install: the stack's arguments where its unit reads them" test -f "$WORK/stage$(sed -n 's/^EnvironmentFile=-//p' "$S/lib/systemd/system/kscore-stack.service")"
    check "make install: units name its binary" grep -q "^ExecStart=$prefix/bin/kscore agent" "$S/lib/systemd/system/kscore-agent.service"
    check "make install: configs" test -f "$WORK/stage$(sed -n 's/^ExecStart=.*--config \(.*\)\/agent.conf$/\1/p' "$S/lib/systemd/system/kscore-agent.service")/agent.conf"
fi

echo "$fails failure(s)"
[ "$fails" = 0 ]

#!/bin/sh
# make fleet-demo: a broker host and three agent "hosts" on one machine.
#
# The agent hosts are network namespaces joined to a bridge (10.213.0.1/24
# on the host side, agents 10.213.0.11-13): each reaches the broker host
# only over TCP, as a machine on the LAN would. The steps are the ones of
# docs/deploying.md "Deploying a fleet":
#   kscore up --listen 10.213.0.1 --mtls     (nats-server TLS-only on that address)
#   kscore agent enroll ID --label ...       (one bundle file per agent)
#   kscore agent --bundle FILE               (inside each namespace)
#   kscore exec / kscore batch               (over TCP + mutual TLS)
#   kscore agent revoke ID                   (its commands are refused)
# Needs root (network namespaces) and iproute2. Everything it makes is
# removed at the end, also on failure or Ctrl-C: its own KSCORE_HOME, the
# namespaces, the bridge and the veth pairs (names ks<pid>*).
set -eu

KSCORE=${KSCORE:-$(pwd)/build/cli/kscore}
[ -x "$KSCORE" ] || { echo "fleet-demo: no $KSCORE (make build)" >&2; exit 1; }
if [ "$(id -u)" != 0 ]; then
    echo "fleet-demo: needs root to make network namespaces (sudo make fleet-demo)" >&2
    exit 1
fi
command -v ip >/dev/null || { echo "fleet-demo: needs ip (apt-get install iproute2)" >&2; exit 1; }
if ip -o addr show to 10.213.0.1 | grep -q .; then
    echo "fleet-demo: 10.213.0.1 is already in use here (ip -o addr)" >&2
    exit 1
fi

tag=ks$$
export KSCORE_HOME="${TMPDIR:-/tmp}/kscore-fleet-demo-$$"
mkdir -p "$KSCORE_HOME"
unset KSCORE_NATS_URL KSCORE_NATS_NKEY KSCORE_NATS_TLS_CA KSCORE_NATS_TLS_CERT KSCORE_NATS_TLS_KEY

cleanup() {
    set +e
    for i in 1 2 3; do
        [ -f "$KSCORE_HOME/agent$i.pid" ] && kill "$(cat "$KSCORE_HOME/agent$i.pid")" 2>/dev/null
    done
    sleep 1
    "$KSCORE" down >/dev/null 2>&1
    for i in 1 2 3; do
        ip netns del "${tag}n$i" 2>/dev/null
        ip link del "${tag}h$i" 2>/dev/null
    done
    ip link del "${tag}b" 2>/dev/null
    [ -n "${KSCORE_KEEP_TMP:-}" ] || rm -rf "$KSCORE_HOME"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { printf '\n== %s\n' "$*"; }
# Shows the command as one would type it (arguments with spaces quoted).
run() {
    printf '$'
    for a in "$@"; do
        case $a in *[[:space:]\"\$]*) printf " '%s'" "$a" ;; *) printf ' %s' "$a" ;; esac
    done
    printf '\n'
    "$@"
}

say "the network: bridge ${tag}b 10.213.0.1/24, namespaces ${tag}n1-3 with 10.213.0.11-13"
ip link add "${tag}b" type bridge
ip addr add 10.213.0.1/24 dev "${tag}b"
ip link set "${tag}b" up
for i in 1 2 3; do
    ip netns add "${tag}n$i"
    ip link add "${tag}h$i" type veth peer name "${tag}a$i"
    ip link set "${tag}a$i" netns "${tag}n$i"
    ip link set "${tag}h$i" master "${tag}b" up
    ip -n "${tag}n$i" addr add "10.213.0.1$i/24" dev "${tag}a$i"
    ip -n "${tag}n$i" link set "${tag}a$i" up
    ip -n "${tag}n$i" link set lo up
done

say "the broker host: nats-server TLS-only on 10.213.0.1, PostgreSQL local, the broker"
run "$KSCORE" up --listen 10.213.0.1 --mtls

say "enrol three agents: one bundle each (NATS url, NKey seed, CA, client certificate, trust key)"
zones="a a b"
i=0
for z in $zones; do
    i=$((i + 1))
    run "$KSCORE" agent enroll "web$i" --label "zone=$z" --out "$KSCORE_HOME/web$i.bundle"
done
run "$KSCORE" agent list

say "start each agent in its namespace with nothing but its bundle"
for i in 1 2 3; do
    printf '$ ip netns exec %s kscore agent --bundle web%s.bundle\n' "${tag}n$i" "$i"
    # setsid: the agent's own session, as a service would run it.
    setsid ip netns exec "${tag}n$i" "$KSCORE" agent --bundle "$KSCORE_HOME/web$i.bundle" \
        --state-dir "$KSCORE_HOME/state-web$i" >"$KSCORE_HOME/agent$i.log" 2>&1 &
    echo $! >"$KSCORE_HOME/agent$i.pid"
done
for _ in $(seq 1 100); do
    n=$("$KSCORE" agents --json | grep -o '"online":true' | wc -l)
    [ "$n" -ge 4 ] && break   # three remote agents and the local one
    sleep 0.2
done
run "$KSCORE" agents

say "exec on each remote agent: it runs in the agent's own network namespace"
for i in 1 2 3; do
    run "$KSCORE" exec --agent "web$i" -- sh -c 'ip -o -4 addr show | grep -v " lo "'
done

say "batch on the agents labelled zone=a"
run "$KSCORE" batch --select zone=a -- sh -c 'echo "$KSCORE_AGENT_ID up $(cut -d" " -f1 /proc/uptime)s"'

say "revoke web3: nats-server reloads and closes its connection, the broker forgets it"
run "$KSCORE" agent revoke web3
if "$KSCORE" exec --agent web3 -- true; then
    echo "fleet-demo: FAILED: a revoked agent still ran a command" >&2
    exit 1
fi
echo "(refused, as it should be)"
run "$KSCORE" batch --all -- true
say "done: everything is removed now"

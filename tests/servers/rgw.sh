#!/usr/bin/env bash
# Throwaway single-node Ceph cluster with an S3 endpoint (Ceph RGW), for tests.
#
# Usage:
#   rgw.sh DIR PORT    start: one monitor, one memstore OSD and radosgw (beast) serving S3
#                      on http://127.0.0.1:PORT. On success prints exactly one line on stdout,
#                        RGW_ENDPOINT=http://127.0.0.1:PORT ACCESS_KEY=... SECRET_KEY=...
#                      and exits 0; the daemons keep running in the background. On failure
#                      it stops whatever it started, prints the daemon log tails on stderr
#                      and exits non-zero.
#   rgw.sh stop DIR    stop the daemons recorded in DIR/run/*.pid (SIGTERM; SIGKILL for the
#                      OSD, whose in-memory data is throwaway) and wait until they have exited.
#                      Exits 0 also when nothing is running.
#
# Needs the Debian packages ceph-mon ceph-osd radosgw ceph-common (Ceph 16.2 "Pacific"),
# plus python3. Everything (config, data, logs, pid files, admin sockets, crash dumps) lives
# under DIR; nothing is written under /etc/ceph or /var. Starting wipes the cluster
# subdirectories of a previous run in DIR (after stopping its daemons); other files in DIR
# are left alone. The data is kept in memory (memstore), so it is gone once stopped.
#
# Environment knobs: RGW_START_TIMEOUT (seconds, default 90), RGW_MEMSTORE_BYTES
# (default 4 GiB), RGW_GC_PERIOD (seconds between garbage collections, default 30; a
# benchmark sets it long and runs `radosgw-admin -c DIR/ceph.conf gc process --include-all`
# itself, between its clocks), RGW_MON_PORT (default: a free port picked at random),
# PYTHON (the Python used for small helpers, default python3).
set -euo pipefail
unset CEPH_ARGS CEPH_CONF

ACCESS_KEY=unbroken-test-access
SECRET_KEY=unbroken-test-secret-key-0123456789
TIMEOUT=${RGW_START_TIMEOUT:-90}
MEMSTORE_BYTES=${RGW_MEMSTORE_BYTES:-4294967296}
GC_PERIOD=${RGW_GC_PERIOD:-30}
PYTHON=${PYTHON:-python3}

die() {
    echo "rgw.sh: $*" >&2
    exit 2
}

usage() {
    die "usage: rgw.sh DIR PORT | rgw.sh stop DIR"
}

# Stop the daemons whose pid files are in $1/run and wait until they are gone: radosgw first
# (it shuts down in a fraction of a second while the cluster is still up, but hangs without
# it), then the OSD, then the monitor.
stop_cluster() {
    local dir=$1 pidfile status=0
    [[ -d $dir/run ]] || return 0
    for pidfile in "$dir"/run/client.*.pid "$dir"/run/osd.*.pid "$dir"/run/mon.*.pid; do
        if [[ -e $pidfile ]]; then
            stop_daemon "$pidfile" || status=1
        fi
    done
    return "$status"
}

stop_daemon() {
    local pidfile=$1 pid name deadline
    pid=$(cat "$pidfile" 2>/dev/null || true)
    rm -f "$pidfile"
    [[ $pid =~ ^[0-9]+$ ]] || return 0
    # Only signal the process if it still is one of our Ceph daemons.
    name=$(cat "/proc/$pid/comm" 2>/dev/null || true)
    case $name in
        ceph-mon | ceph-osd | radosgw) ;;
        *) return 0 ;;
    esac
    if [[ $name == ceph-osd ]]; then
        # A memstore OSD writes all its data to disk on a clean shutdown; the data is
        # throwaway, so skip that.
        kill -KILL "$pid" 2>/dev/null || true
    else
        kill -TERM "$pid" 2>/dev/null || true
    fi
    deadline=$((SECONDS + 10))
    while alive "$pid"; do
        if ((SECONDS >= deadline + 10)); then
            echo "rgw.sh: process $pid ($name) does not exit" >&2
            return 1
        elif ((SECONDS >= deadline)); then
            kill -KILL "$pid" 2>/dev/null || true
        fi
        sleep 0.05
    done
}

# Whether process $1 exists and is not a zombie (the daemons are children of init once
# daemonised; an init that does not reap would leave zombies, which count as gone).
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]]
}

free_port() {
    "$PYTHON" -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

port_in_use() {
    # SO_REUSEADDR, as the daemons use: ignores TIME_WAIT leftovers, not listeners.
    "$PYTHON" -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)' "$1"
}

http_up() {
    "$PYTHON" -c 'import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=2)
except urllib.error.HTTPError:
    pass  # any HTTP answer will do
except Exception:
    sys.exit(1)' "$1"
}

if [[ ${1:-} == stop ]]; then
    [[ $# -eq 2 ]] || usage
    stop_cluster "$2"
    exit 0
fi
[[ $# -eq 2 ]] || usage
if ! [[ $2 =~ ^[0-9]+$ ]] || (($2 < 1 || $2 > 65535)); then
    die "bad port: $2"
fi
[[ $MEMSTORE_BYTES =~ ^[0-9]+$ ]] || die "bad RGW_MEMSTORE_BYTES: $MEMSTORE_BYTES"
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "bad RGW_START_TIMEOUT: $TIMEOUT"
PORT=$2

for bin in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool timeout "$PYTHON"; do
    command -v "$bin" >/dev/null || die "missing program: $bin (apt-get install ceph-mon ceph-osd radosgw ceph-common)"
done

mkdir -p "$1"
DIR=$(cd "$1" && pwd)
[[ $DIR != *[[:space:]]* ]] || die "DIR must not contain whitespace: $DIR"

stop_cluster "$DIR"
rm -rf "$DIR"/{ceph.conf,mon,osd,rgw,run,log,crash,tmp}
mkdir -p "$DIR"/{mon,osd,rgw,run,log,crash,tmp}

port_in_use "$PORT" && die "port $PORT on 127.0.0.1 is already in use"
MON_PORT=${RGW_MON_PORT:-$(free_port)}
FSID=$(cat /proc/sys/kernel/random/uuid)
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
CONF=$DIR/ceph.conf

cat >"$CONF" <<CONF
[global]
fsid = $FSID
mon_host = [v2:127.0.0.1:$MON_PORT]
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_msgr1 = false
ms_bind_ipv6 = false

auth_cluster_required = none
auth_service_required = none
auth_client_required = none
ms_cluster_mode = crc
ms_service_mode = crc
ms_client_mode = crc
ms_mon_cluster_mode = crc
ms_mon_service_mode = crc
ms_mon_client_mode = crc

keyring = $DIR/keyring
run_dir = $DIR/run
admin_socket = \$run_dir/\$name.\$pid.asok
pid_file = \$run_dir/\$name.pid
log_file = $DIR/log/\$name.log
mon_cluster_log_file = $DIR/log/cluster.log
crash_dir = $DIR/crash
tmp_dir = $DIR/tmp
mon_data = $DIR/mon/\$name
osd_data = $DIR/osd/\$name
mgr_data = $DIR/mgr/\$name
rgw_data = $DIR/rgw/\$name

osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
mon_warn_on_too_few_osds = false
mon_warn_on_pool_no_app = false
mon_warn_on_insecure_global_id_reclaim_allowed = false

[mon]
mon_data_avail_crit = 1
mon_data_avail_warn = 2
# Commit map changes (pool creation etc.) right away instead of batching them for 1 s.
paxos_propose_interval = 0.01
paxos_min_wait = 0.01

[osd]
osd_objectstore = memstore
memstore_device_bytes = $MEMSTORE_BYTES
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 1

[client.rgw]
rgw_frontends = beast endpoint=127.0.0.1:$PORT tcp_nodelay=1
rgw_thread_pool_size = 32
rgw_dynamic_resharding = false
rgw_enable_usage_log = false
# Reclaim the space of deleted and overwritten objects after ~30 s instead of 2 h: the OSD
# keeps everything in RAM, capped at memstore_device_bytes.
rgw_gc_obj_min_wait = $GC_PERIOD
rgw_gc_processor_period = $GC_PERIOD
CONF

ceph_cli() {
    timeout 30 ceph -c "$CONF" --connect-timeout 10 "$@"
}

# Report a failed start: the log tails (setup.log, the output of the commands run here,
# last), then the reason again as the very last line; stop what was started; exit 1.
fail() {
    local f
    echo "rgw.sh: $*" >&2
    for f in "$DIR"/log/{mon,osd,client}.*.log "$DIR/log/setup.log"; do
        [[ -s $f ]] || continue
        echo "----- tail of $f -----" >&2
        tail -n 15 "$f" | cut -c1-300 >&2
    done
    stop_cluster "$DIR" || true
    echo "rgw.sh: failed: $*" >&2
    exit 1
}

# Stop the daemons again if we are interrupted before the cluster is ready.
trap 'stop_cluster "$DIR"; exit 130' INT TERM

START=$SECONDS
deadline=$((SECONDS + TIMEOUT))

# Monitor.
monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON_PORT]" "$DIR/tmp/monmap" \
    >"$DIR/log/setup.log" 2>&1 || fail "monmaptool failed"
ceph-mon -c "$CONF" -i a --mkfs --monmap "$DIR/tmp/monmap" >>"$DIR/log/setup.log" 2>&1 ||
    fail "ceph-mon --mkfs failed"
ceph-mon -c "$CONF" -i a >>"$DIR/log/setup.log" 2>&1 || fail "ceph-mon failed to start"

# OSD: register it with the monitor, format its (in-memory) store, start it.
OSD_ID=$(ceph_cli osd new "$OSD_UUID" 2>>"$DIR/log/setup.log") || fail "ceph osd new failed"
[[ $OSD_ID =~ ^[0-9]+$ ]] || fail "ceph osd new returned: $OSD_ID"
mkdir -p "$DIR/osd/osd.$OSD_ID"
ceph-osd -c "$CONF" -i "$OSD_ID" --mkfs --osd-uuid "$OSD_UUID" >>"$DIR/log/setup.log" 2>&1 ||
    fail "ceph-osd --mkfs failed"
ceph-osd -c "$CONF" -i "$OSD_ID" >>"$DIR/log/setup.log" 2>&1 || fail "ceph-osd failed to start"
until [[ $(ceph_cli osd stat 2>>"$DIR/log/setup.log") == *" 1 up"* ]]; do
    ((SECONDS < deadline)) || fail "timed out waiting for the OSD to come up"
    sleep 0.5
done

# S3 user (this also creates the RGW realm, zone and pools), then the gateway itself.
timeout 60 radosgw-admin -c "$CONF" user create --uid=test --display-name=test \
    --access-key="$ACCESS_KEY" --secret="$SECRET_KEY" >/dev/null 2>>"$DIR/log/setup.log" ||
    fail "radosgw-admin user create failed"
radosgw -c "$CONF" -n client.rgw >>"$DIR/log/setup.log" 2>&1 || fail "radosgw failed to start"

# The daemonised radosgw writes its pid file shortly after its launcher returns (and removes
# it when it exits).
pid_deadline=$((SECONDS + 15))
until RGW_PID=$(cat "$DIR/run/client.rgw.pid" 2>/dev/null) && [[ $RGW_PID =~ ^[0-9]+$ ]]; do
    ((SECONDS < pid_deadline)) || fail "radosgw exited (no pid file)"
    sleep 0.05
done

ENDPOINT=http://127.0.0.1:$PORT
until http_up "$ENDPOINT"; do
    alive "$RGW_PID" || fail "radosgw exited"
    ((SECONDS < deadline)) || fail "timed out waiting for radosgw to answer on $ENDPOINT"
    sleep 0.2
done

trap - INT TERM
echo "rgw.sh: ready in $((SECONDS - START)) s" >&2
echo "RGW_ENDPOINT=$ENDPOINT ACCESS_KEY=$ACCESS_KEY SECRET_KEY=$SECRET_KEY"

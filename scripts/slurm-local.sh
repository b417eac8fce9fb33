#!/usr/bin/env bash
# A real Slurm 22.05 cluster with accounting on this one machine, for the Slurm tests and for
# trying launcher=slurm:  bash scripts/slurm-local.sh up|down|status
#
# Two emulated nodes (node1, node2) share this host: one slurmd per node, distinct ports, per-node
# spool dirs. Accounting (slurmdbd + MariaDB without networking) is not optional: submitit reads
# job states with sacct. Runs as root; installs Debian's packages when missing.
#
# Debian's Slurm clients (sbatch, squeue, sacct) read /etc/slurm/slurm.conf, so the two config
# files live there (written by this script, marked as such, never over a foreign config); all
# state, logs, the MariaDB data dir and the PIDs this script started live under $STATE.
# `down` stops exactly the PIDs recorded by `up`, never processes found by name.
set -euo pipefail

STATE=${SCALESTUDY_SLURM_STATE:-/var/tmp/scalestudy-slurm}
CONF_DIR=/etc/slurm
MARK="# written by scalestudy scripts/slurm-local.sh"
NODES=(node1 node2)
NODE_PORTS=(6831 6832)
# More CPUs than the host has (config_overrides lets slurmd accept it): a 1-CPU pipeline job
# (launcher.submit_only) and a 2x2 stage job then fit side by side without deadlock.
NODE_CPUS=4
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
DB_SOCKET=/run/mysqld/mysqld.sock
WAIT_S=60

log() { echo "slurm-local: $*" >&2; }
die() { log "error: $*"; exit 1; }

# --- PIDs ------------------------------------------------------------------------------------
pidfile() { echo "$STATE/pids/$1"; }

# A recorded PID counts as ours only while it still runs the program we started (PIDs get reused).
alive() {
    local file; file=$(pidfile "$1")
    [[ -f $file ]] || return 1
    local pid prog; read -r pid prog <"$file"
    [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$prog"
}

record() { mkdir -p "$STATE/pids"; echo "$2 $3" >"$(pidfile "$1")"; }

# Whether the process recorded for NAME still exists. While it execs its program its cmdline can
# read empty or the wrapper's for a moment, so alive() may say no then (a `up` failed so,
# "munged exited", with munged running): waiting for a daemon we just started asks this instead.
started() {
    local pid prog; read -r pid prog <"$(pidfile "$1")"
    kill -0 "$pid" 2>/dev/null
}

# start NAME PROGRAM COMMAND...: run COMMAND (which execs PROGRAM, in the foreground) in the
# background, in a new session.
start() {
    local name=$1 prog=$2; shift 2
    alive "$name" && return 0
    setsid "$@" >>"$STATE/log/$name.out" 2>&1 </dev/null &
    record "$name" $! "$prog"
}

stop() {
    local name=$1 pid prog
    alive "$name" || { rm -f "$(pidfile "$name")"; return 0; }
    read -r pid prog <"$(pidfile "$name")"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "$name ($pid) ignored SIGTERM for 10 s: SIGKILL"; kill -KILL "$pid" || true; fi
    rm -f "$(pidfile "$name")"
}

wait_for() {  # wait_for NAME COMMAND...: retry COMMAND for WAIT_S seconds while daemon NAME runs.
    local name=$1; shift
    for _ in $(seq $((WAIT_S * 5))); do
        "$@" >/dev/null 2>&1 && return 0
        [[ ! -f $(pidfile "$name") ]] || started "$name" || die "$name exited; see $STATE/log/$name.out"
        sleep 0.2
    done
    die "$name not ready after ${WAIT_S} s; logs in $STATE/log"
}

# --- install ---------------------------------------------------------------------------------
install_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    [[ $EUID -eq 0 ]] || die "installing ${missing[*]} needs root"
    local policy=/usr/sbin/policy-rc.d ours=0
    # Installing must not start the packaged services: this script starts its own daemons.
    if [[ ! -e $policy ]]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; ours=1; fi
    log "installing ${missing[*]}"
    if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >"$STATE/log/apt.out" 2>&1; then
        apt-get update -q >>"$STATE/log/apt.out" 2>&1
        apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$STATE/log/apt.out" 2>&1 \
            || { [[ $ours -eq 1 ]] && rm -f "$policy"; die "apt-get install failed; see $STATE/log/apt.out"; }
    fi
    [[ $ours -eq 1 ]] && rm -f "$policy"
    return 0
}

# --- config ----------------------------------------------------------------------------------
write_conf() {  # write_conf PATH MODE: stdin to PATH unless PATH is someone else's file.
    local path=$1 mode=$2
    if [[ -e $path ]] && ! head -1 "$path" | grep -qF "$MARK"; then
        die "$path exists and was not written by this script; move it away to use the local cluster"
    fi
    { echo "$MARK"; cat; } >"$path.tmp"
    chmod "$mode" "$path.tmp"
    mv "$path.tmp" "$path"
}

configure() {
    local host; host=$(hostname -s)
    mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/log" "$STATE/pids"
    for n in "${NODES[@]}"; do
        mkdir -p "$STATE/d-$n"
        # submitit uses the first node's name as MASTER_ADDR: every node name must resolve.
        grep -qE "^127\.0\.0\.1[[:space:]]+$n\$" /etc/hosts || echo "127.0.0.1 $n" >>/etc/hosts
    done
    local node_lines="" i
    for i in "${!NODES[@]}"; do
        node_lines+="NodeName=${NODES[$i]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORTS[$i]}"
        node_lines+=" CPUs=$NODE_CPUS RealMemory=4096 State=UNKNOWN"$'\n'
    done
    write_conf "$CONF_DIR/slurm.conf" 644 <<EOF
ClusterName=scalestudy
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# No cgroups and no systemd here: track processes by their parents, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The emulated nodes claim more CPUs than the host has.
SlurmdParameters=config_overrides
MailProg=/bin/true
MpiDefault=none
# Without batch_sched_delay=0 every batch job waits ~3 s to be scheduled.
SchedulerParameters=batch_sched_delay=0
# submitit jobs ignore SIGTERM: a cancelled job would hold its CPUs for the default 30 s.
KillWait=5
ReturnToService=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
${node_lines}PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP
EOF
    write_conf "$CONF_DIR/slurmdbd.conf" 600 <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
}

# --- daemons ---------------------------------------------------------------------------------
start_munge() {
    if ! alive munged && munge -n >/dev/null 2>&1; then
        log "using the munged that is already running (not ours: down leaves it alone)"
        return 0
    fi
    [[ -s /etc/munge/munge.key ]] || { mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; }
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
    # setpriv execs (no forking wrapper), so the recorded PID is munged itself.
    start munged munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground
    wait_for munged munge -n
}

start_mariadb() {
    install -d -o mysql -g mysql /run/mysqld "$STATE/mysql"
    if [[ ! -d $STATE/mysql/mysql ]]; then
        mariadb-install-db --user=mysql --datadir="$STATE/mysql" --auth-root-authentication-method=socket \
            >"$STATE/log/mariadb-install.out" 2>&1 || die "mariadb-install-db failed; see $STATE/log"
    fi
    # Root connects through the socket (unix_socket auth): no password, no TCP port.
    start mariadbd mariadbd /usr/sbin/mariadbd --user=mysql --datadir="$STATE/mysql" --socket=$DB_SOCKET \
        --skip-networking --pid-file=/run/mysqld/mariadbd.pid
    wait_for mariadbd mariadb --socket=$DB_SOCKET -e 'select 1'
}

nodes_idle() {
    local states; states=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    for n in "${NODES[@]}"; do grep -qE "^$n (idle|mix|alloc)" <<<"$states" || return 1; done
}

up() {
    mkdir -p "$STATE/log"
    install_packages
    configure
    start_munge
    start_mariadb
    start slurmdbd slurmdbd /usr/sbin/slurmdbd -D
    wait_for slurmdbd sacctmgr -n show cluster
    sacctmgr -i -Q add cluster scalestudy >/dev/null 2>&1 || true
    start slurmctld slurmctld /usr/sbin/slurmctld -D -i
    wait_for slurmctld scontrol ping
    for n in "${NODES[@]}"; do start "slurmd-$n" "slurmd -D -N $n" /usr/sbin/slurmd -D -N "$n"; done
    wait_for slurmd-node1 nodes_idle
    log "up: $(sinfo -h -o '%P %D %t' | tr '\n' ' ')(state in $STATE)"
}

down() {
    local n
    for n in "${NODES[@]}"; do stop "slurmd-$n"; done
    for n in slurmctld slurmdbd mariadbd munged; do stop "$n"; done
    log "down"
}

status() {
    local name rc=0
    for name in munged mariadbd slurmdbd slurmctld "${NODES[@]/#/slurmd-}"; do
        if alive "$name"; then echo "$name running (pid $(cut -d' ' -f1 <"$(pidfile "$name")"))"
        else echo "$name stopped"; rc=1; fi
    done
    [[ $rc -eq 0 ]] && sinfo -N
    return $rc
}

case ${1:-} in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac

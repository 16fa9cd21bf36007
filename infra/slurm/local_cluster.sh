#!/usr/bin/env bash
# A real single-host Slurm cluster for tests and demos: munge, slurmctld and slurmd from Debian's
# slurm-wlm, everything under one state directory (no change to /etc/slurm).
#
#   infra/slurm/local_cluster.sh start    # installs slurm-wlm and munge when missing (needs root)
#   infra/slurm/local_cluster.sh stop
#   infra/slurm/local_cluster.sh env      # prints `export SLURM_CONF=...` for this cluster
#
# Jobs run on the one real node (partition `local`). The `gpu` partition declares fake 8-GPU
# nodes that never register: the scheduler knows their shape, so `sbatch --test-only` can check
# a multi-node GPU job rendered from the production templates; the partition is DOWN, so a job
# really submitted there stays pending (PartitionDown) and nothing ever runs on a fake node.
set -euo pipefail

DIR="${LONGLIVE_SLURM_DIR:-/tmp/longlive-slurm}"
CONF="$DIR/slurm.conf"
HOST="$(hostname -s)"
FAKE_NODES="${LONGLIVE_SLURM_FAKE_NODES:-8}"

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "slurm-wlm and munge are not installed and this is not root: install them (apt-get install slurm-wlm munge)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends slurm-wlm slurm-client munge >/dev/null
}

write_config() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/munge"
  local cpus mem
  cpus="$(nproc)"
  mem="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
  cat > "$CONF" <<CONF
ClusterName=longlive-local
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${LONGLIVE_SLURMCTLD_PORT:-6817}
SlurmdPort=${LONGLIVE_SLURMD_PORT:-6818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
GresTypes=gpu
SlurmdParameters=config_overrides
InactiveLimit=0
# the fake nodes never answer: do not mark them down for it
SlurmdTimeout=0
KillWait=5
MinJobAge=600
OverTimeLimit=0
# a TIMEOUT is seen within a minute of the limit, not after the default 30 s sweep plus grace
MessageTimeout=10
NodeName=$HOST CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=gpu-[01-$(printf %02d "$FAKE_NODES")] CPUs=64 Sockets=2 CoresPerSocket=32 ThreadsPerCore=1 RealMemory=1000000 Gres=gpu:8 NodeAddr=127.0.0.1 State=DOWN Reason=declared_only
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=gpu-[01-$(printf %02d "$FAKE_NODES")] MaxTime=INFINITE State=DOWN
CONF
}

ports_free() {
  # a cluster left running from another state folder (a killed test run) holds the ports: slurmd
  # and slurmctld would then fail later with "Invalid node state specified", which names neither
  local port
  for port in "${LONGLIVE_SLURMCTLD_PORT:-6817}" "${LONGLIVE_SLURMD_PORT:-6818}"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "port $port is in use: another Slurm (or something else) listens there. Stop it (a cluster of this" \
           "script: LONGLIVE_SLURM_DIR=<its folder> $0 stop; running daemons: $(pgrep -a 'slurmctld|slurmd' \
           | tr '\n' ';' || true)) or choose free ports with LONGLIVE_SLURMCTLD_PORT and LONGLIVE_SLURMD_PORT" >&2
      exit 1
    fi
  done
}

start() {
  stop_daemons quiet
  ports_free
  install_packages
  write_config
  # munge: its own socket would need every client to know it; the system default is what slurm uses
  if ! pgrep -x munged >/dev/null; then
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null \
      || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    if id munge >/dev/null 2>&1; then
      runuser -u munge -- munged
    else
      munged --force
    fi
  fi
  SLURM_CONF="$CONF" slurmctld -c -f "$CONF"
  SLURM_CONF="$CONF" slurmd -c -f "$CONF"
  # ready when the real node is idle
  for _ in $(seq 1 60); do
    if SLURM_CONF="$CONF" sinfo -h -n "$HOST" -o %T 2>/dev/null | grep -q -E '^(idle|mixed|allocated)'; then
      # declared DOWN (a node in a config cannot start IDLE); resumed, they are schedulable shapes
      SLURM_CONF="$CONF" scontrol update nodename="gpu-[01-$(printf %02d "$FAKE_NODES")]" state=resume
      # ...once slurmctld has stopped flagging them as not responding (`idle*`)
      for _ in $(seq 1 60); do
        [ "$(SLURM_CONF="$CONF" sinfo -h -p gpu -o %T)" = idle ] && break
        sleep 1
      done
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    sleep 1
  done
  echo "the local Slurm node did not come up; logs in $DIR/log/" >&2
  SLURM_CONF="$CONF" sinfo >&2 || true
  tail -20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
  exit 1
}

stop_daemons() {
  for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid"; do
    local pid
    pid="$(cat "$pidfile" 2>/dev/null || true)"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      kill "$pid" || true
      for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
    rm -f "$pidfile"
  done
  [ "${1:-}" = quiet ] || echo "local Slurm stopped (state in $DIR)"
}

case "${1:-}" in
  start) start ;;
  stop) stop_daemons ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# A private 2-node Slurm cluster on 127.0.0.1 for the `slurm` tests (docs/launching.md):
# its own munged (own key and socket), slurmctld, and two slurmd (-N titan-n1, -N titan-n2),
# all configured, logged and keeping state under DIR, on ports that do not clash with a
# system Slurm. Only the processes it started (their pid files) are stopped.
#   scripts/slurm_cluster.sh start DIR   exits 0 with the cluster idle; prints
#                                        TITAN_TEST_SKIPPED (and exits 0) without Slurm/munge
#   scripts/slurm_cluster.sh stop DIR    cancels its jobs and stops its daemons
#   scripts/slurm_cluster.sh env DIR     prints the export line its clients need (SLURM_CONF)
# Environment: TITAN_SLURM_PORT (default 26817: slurmctld; the nodes use the next two).
set -euo pipefail
cmd="${1:?usage: slurm_cluster.sh start|stop|env DIR}"
dir="$(mkdir -p "${2:?usage: slurm_cluster.sh start|stop|env DIR}" && cd "$2" && pwd)"
port="${TITAN_SLURM_PORT:-26817}"
nodes=(titan-n1 titan-n2)
export SLURM_CONF="$dir/slurm.conf"
say() { echo "[slurm] $*"; }

skip() { echo "TITAN_TEST_SKIPPED: $*"; echo "$*" >"$dir/skipped"; exit 0; }

stop_pid() {  # a daemon we started, by the pid in its file
  local f="$1"
  [ -f "$f" ] || return 0
  local pid; pid="$(cat "$f")"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

write_conf() {
  cat >"$SLURM_CONF" <<CONF
ClusterName=titan
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$port
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool.%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
PlugStackConfig=$dir/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SwitchType=switch/none
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
JobRequeue=1
KillWait=30
SchedulerType=sched/builtin
NodeName=${nodes[0]} NodeAddr=127.0.0.1 Port=$((port + 1)) CPUs=2 State=UNKNOWN
NodeName=${nodes[1]} NodeAddr=127.0.0.1 Port=$((port + 2)) CPUs=2 State=UNKNOWN
PartitionName=titan Nodes=${nodes[0]},${nodes[1]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
  : >"$dir/plugstack.conf"
}

case "$cmd" in
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  start)
    rm -f "$dir/skipped"
    for c in munged slurmctld slurmd sbatch srun scontrol sinfo; do
      command -v "$c" >/dev/null || skip "$c not found (apt-get install slurm-wlm munge; scripts/setup.sh does)"
    done
    [ "$(id -u)" -eq 0 ] || skip "the private cluster runs its daemons as root (SlurmUser=root)"
    # The node names must resolve (the sbatch script's MASTER_ADDR is the first node's name).
    for n in "${nodes[@]}"; do
      if ! getent hosts "$n" >/dev/null; then
        [ -w /etc/hosts ] || skip "node name $n does not resolve and /etc/hosts is not writable"
        echo "127.0.0.1 $n  # titan-train scripts/slurm_cluster.sh" >>/etc/hosts
      fi
    done
    "$0" stop "$dir" >/dev/null 2>&1 || true
    mkdir -p "$dir/ctld" "$dir/munge"
    chmod 700 "$dir/munge"
    write_conf
    [ -f "$dir/munge/munge.key" ] || { head -c 1024 /dev/urandom >"$dir/munge/munge.key"; chmod 400 "$dir/munge/munge.key"; }
    munged --force --socket="$dir/munge.sock" --key-file="$dir/munge/munge.key" \
      --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/seed" ||
      { cat "$dir/munged.log" >&2; exit 1; }
    slurmctld -i || { cat "$dir/slurmctld.log" >&2; exit 1; }
    for n in "${nodes[@]}"; do slurmd -N "$n" || { cat "$dir/slurmd.$n.log" >&2; exit 1; }; done
    for _ in $(seq 150); do
      idle="$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle' || true)"
      [ "$idle" -eq 2 ] && { say "2 nodes idle: $(sinfo -h -N -o '%N' | tr '\n' ' ')(SLURM_CONF=$SLURM_CONF)"; exit 0; }
      sleep 0.2
    done
    sinfo -N >&2 || true
    tail -20 "$dir/slurmctld.log" >&2
    exit 1 ;;
  stop)
    [ -f "$SLURM_CONF" ] && [ -f "$dir/slurmctld.pid" ] && scancel --full --signal=KILL --partition=titan >/dev/null 2>&1 || true
    [ -f "$SLURM_CONF" ] && [ -f "$dir/slurmctld.pid" ] && scancel --partition=titan >/dev/null 2>&1 || true
    for n in "${nodes[@]}"; do stop_pid "$dir/slurmd.$n.pid"; done
    stop_pid "$dir/slurmctld.pid"
    stop_pid "$dir/munged.pid"
    say "stopped" ;;
  *) echo "usage: slurm_cluster.sh start|stop|env DIR" >&2; exit 2 ;;
esac

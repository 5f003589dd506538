#!/usr/bin/env bash
# Provision the real test infrastructure of harbor-hpc on a Debian 12 (bookworm) machine, as root:
# Docker Engine, two local registries (open :5000, password :5001), munge + a one-node Slurm,
# Apptainer 1.4.5, local base images, a folder of wheels for containers, and an env file.
#
# Idempotent: every part checks first and reuses what a previous run left when it still works,
# and repairs what it safely can: stopped daemons, stale pid files, another cluster's Slurm state,
# the munge key's owner and mode, a node left DOWN or DRAINED. A step that still fails says which
# step, the command, and what its daemons logged meanwhile.
# The package mirror is read from /etc/apt/sources.list.d/debian.sources at run time.
#
# Usage: bash .ci/provision.sh            (everything)
set -Eeuo pipefail
shopt -s inherit_errexit
# Any command that fails without its own message (set -e) says which step, the command, and
# what the daemons of that step wrote into their logs meanwhile (see on_error below).
trap 'on_error $? $LINENO "$BASH_COMMAND"' ERR

CI_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$CI_DIR/.." && pwd)"
STATE=/var/lib/harbor-hpc-ci
CACHE=/var/cache/harbor-hpc-ci
LOGS=/var/log/harbor-hpc-ci
ENV_FILE=$STATE/env.sh

APPTAINER_WANT=1.4.5
APPTAINER_GLIBC=/opt/harbor-hpc-ci/apptainer-glibc
APPTAINER_STARTER=/usr/lib/x86_64-linux-gnu/apptainer/bin/starter

BASE_IMAGE=local/debian:bookworm
NOPY_IMAGE=local/debian-nopython:bookworm
WHEELS=$CACHE/wheels
WHEEL_PKGS=(uvicorn fastapi)
TEST_USER=hpcuser   # the ordinary user the tests run as
OTHER_USER=hpcuser2 # "another user" for the tests, reached from TEST_USER with sudo
NOSUB_USER=hpcnosub # an ordinary user without /etc/subuid and /etc/subgid lines (CI's stage)
LAB_GROUP=hpclab    # a lab's group, both users in it: for the .sif store a lab shares
SUDOERS_FILE=/etc/sudoers.d/harbor-hpc-ci
AUTH_USER=hpcuser   # the password registry's login (not a Unix user)
AUTH_PASSWORD=hpcpass

APT_PKGS=(
  docker.io docker-registry apache2-utils debootstrap slurm-wlm munge slurmdbd mariadb-server
  squashfs-tools squashfuse fuse2fs fuse-overlayfs fuse3 uidmap patchelf tmux procps slirp4netns
  containernetworking-plugins gocryptfs curl ca-certificates iptables xz-utils zstd e2fsprogs util-linux passwd
  sudo nftables gcc libc6-dev
)

export DEBIAN_FRONTEND=noninteractive
umask 022
mkdir -p "$STATE" "$CACHE" "$LOGS"

if [ "$(id -u)" != 0 ]; then
  echo "provision.sh must run as root" >&2
  exit 1
fi

# One provisioning at a time (CI and a developer, say): wait for the other one to finish.
exec 9>"$STATE/provision.lock"
if ! flock -n 9; then
  echo "[provision] waiting for another provision.sh to finish"
  flock 9
fi

T_START=$EPOCHREALTIME

log() { echo "[provision] $*"; }

# What a failure reports: the step running (PART), and the lines the logs it watches gained since
# it began to watch them (a daemon says why it refused to start in its log, not on its stderr).
PART="setup"
MAIN_PID=$BASHPID
declare -A LOG_MARK=()
# watch_log FILE...: report FILE's new lines if this step fails.
watch_log() {
  local f
  for f; do LOG_MARK[$f]=$(stat -c %s "$f" 2>/dev/null || echo 0); done
}
show_logs() {
  # In a subshell (a $(...) or a background part) only the one line: the main shell, or
  # bg_wait, reports the rest.
  [ "$BASHPID" = "$MAIN_PID" ] || return 0
  local f grew=()
  for f in "${!LOG_MARK[@]}"; do
    if (($(stat -c %s "$f" 2>/dev/null || echo 0) > LOG_MARK[$f])); then grew+=("$f"); fi
  done
  for f in "${grew[@]}"; do
    echo "[provision] $f, since this step began:" >&2
    tail -c +"$((LOG_MARK[$f] + 1))" "$f" | tail -n 25 | sed 's/^/    /' >&2
  done
  # None of them said anything new: their last lines, for what led up to this.
  if [ ${#grew[@]} -eq 0 ]; then
    for f in "${!LOG_MARK[@]}"; do
      [ -s "$f" ] || continue
      echo "[provision] $f (nothing new), its last lines:" >&2
      tail -n 5 "$f" | sed 's/^/    /' >&2
    done
  fi
}
die() {
  echo "[provision] ERROR in step \"$PART\": $*" >&2
  show_logs
  exit 1
}
on_error() { # EXIT-STATUS LINE COMMAND (the ERR trap)
  echo "[provision] ERROR in step \"$PART\": \"$3\" failed (exit $1, .ci/provision.sh line $2)" >&2
  show_logs
}
elapsed() { # START -> seconds with one decimal
  awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'
}

# timed NAME FUNC: run FUNC, then print one timing line. FUNC sets PART_NOTE (reused/done).
timed() {
  local name=$1 start=$EPOCHREALTIME
  shift
  PART=$name
  LOG_MARK=()
  PART_NOTE="done"
  "$@"
  log "$(printf '%-22s %6ss  %s' "$name" "$(elapsed "$start")" "$PART_NOTE")"
}

# Background parts: bg_start NAME FUNC starts it with its own log; bg_wait NAME waits for it,
# prints its timing line, or its log's tail and fails.
declare -A BG_PID=()
bg_start() {
  local name=$1
  shift
  (
    start=$EPOCHREALTIME
    PART=$name
    PART_NOTE="done"
    "$@"
    printf '%s\n' "$(printf '%-22s %6ss  %s' "$name" "$(elapsed "$start")" "$PART_NOTE") (background)" \
      >"$LOGS/bg-$name.timing"
  ) >"$LOGS/bg-$name.log" 2>&1 </dev/null &
  BG_PID[$name]=$!
}
bg_wait() {
  local name=$1
  if ! wait "${BG_PID[$name]}"; then
    echo "[provision] background part '$name' failed; last lines of $LOGS/bg-$name.log:" >&2
    tail -n 40 "$LOGS/bg-$name.log" >&2 || true
    exit 1
  fi
  log "$(cat "$LOGS/bg-$name.timing")"
}

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND until it succeeds.
wait_for() {
  local limit=$1 what=$2 i
  shift 2
  for ((i = 0; i < limit * 4; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.25
  done
  die "timed out after ${limit}s waiting for $what"
}

# The Debian mirror: URIs of the stanza whose Suites hold plain "bookworm" (or the first stanza).
mirror_uri() {
  local f=/etc/apt/sources.list.d/debian.sources uri=""
  if [ -r "$f" ]; then
    uri=$(awk 'BEGIN { RS = ""; FS = "\n" }
      {
        u = ""; s = ""
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/) { v = $i; sub(/^URIs:[ \t]*/, "", v); split(v, a, /[ \t]+/); u = a[1] }
          if ($i ~ /^Suites:/) { s = $i " " }
        }
        if (u != "" && first == "") first = u
        if (u != "" && s ~ /[ \t]bookworm[ \t]/) { print u; found = 1; exit }
      }
      END { if (!found && first != "") print first }' "$f")
  fi
  if [ -z "$uri" ] && [ -r /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i ~ /:\/\//) { print $i; exit } }' \
      /etc/apt/sources.list)
  fi
  [ -n "$uri" ] || die "cannot find the Debian mirror URI in /etc/apt/sources.list.d/debian.sources"
  printf '%s\n' "${uri%/}"
}
MIRROR=$(mirror_uri)

# pid_alive PIDFILE [NAME]: the pid in the file is running (and is NAME: pids get reused).
pid_alive() {
  local pid
  [ -f "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null || true)
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  [ -z "${2:-}" ] || [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = "$2" ]
}
# stop_pid PIDFILE NAME: stop the NAME whose pid PIDFILE holds (a daemon this script started) and
# wait until it is gone (daemons remove their pid file before they are); false when none runs.
stop_pid() {
  local pid i
  pid_alive "$1" "$2" || return 1
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null || return 0 # gone meanwhile
  for ((i = 0; i < 120; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
  die "$2 (pid $pid from $1) did not stop within 30 s"
}
# clear_stale_pidfile PIDFILE NAME: remove a pid file whose NAME is gone. dockerd refuses to start
# beside one, and slurmctld and slurmd kill the pid they find there, whoever has it now.
# cancel_left_jobs SLURM_CONF: cancel the jobs of the test users that an earlier run (a CI run
# cut short, on a machine used again) left on that cluster, and print how many. Their checkout
# may be gone: requeued when a slurmd restarts, such a job fails to start and drains its node.
cancel_left_jobs() {
  local conf=$1 user ids n=0
  for user in "$TEST_USER" "$OTHER_USER" "$NOSUB_USER"; do
    id -u "$user" >/dev/null 2>&1 || continue
    ids=$(SLURM_CONF=$conf timeout 10 squeue -h -u "$user" -o %i 2>/dev/null || true)
    [ -n "$ids" ] || continue
    SLURM_CONF=$conf timeout 10 scancel -u "$user" || true
    n=$((n + $(wc -l <<<"$ids")))
  done
  echo "$n"
}
clear_stale_pidfile() {
  if [ -e "$1" ] && ! pid_alive "$1" "$2"; then
    rm -f "$1"
    log "removed the stale pid file $1 (no $2 runs with its pid)"
  fi
}


# ----------------------------------------------------------------------------------------------
# 1. apt packages
part_apt() {
  local p missing=()
  # pip for the python3 that downloads the wheels (part 7, from /); a find_spec costs no pip import.
  if ! (cd / && python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("pip") is None)') >/dev/null 2>&1; then
    APT_PKGS+=(python3-pip)
  fi
  # One dpkg-query for all: "name status" for each package dpkg knows.
  local -A status=()
  local name st
  while read -r name st; do
    status[${name%%:*}]=$st
  done < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${APT_PKGS[@]}" 2>/dev/null || true)
  for p in "${APT_PKGS[@]}"; do
    [ "${status[$p]:-}" = installed ] || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    PART_NOTE="reused (all ${#APT_PKGS[@]} packages installed)"
    return 0
  fi
  log "installing: ${missing[*]}"
  apt-get update -qq
  # policy-rc.d (if any) keeps the packages' services from starting; this script starts them.
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$LOGS/apt-install.log" 2>&1 ||
    {
      tail -n 30 "$LOGS/apt-install.log" >&2
      die "apt-get install failed"
    }
  PART_NOTE="installed ${#missing[@]} packages"
}

# ----------------------------------------------------------------------------------------------
# 2. Docker Engine
docker_ok() { timeout 10 docker info >/dev/null 2>&1; }
part_docker() {
  if docker_ok; then
    PART_NOTE="reused (daemon answering)"
    return 0
  fi
  watch_log "$LOGS/dockerd.log"
  if ! pgrep -x dockerd >/dev/null; then
    clear_stale_pidfile /run/docker.pid dockerd
    setsid -f dockerd >>"$LOGS/dockerd.log" 2>&1 </dev/null 9>&-
    PART_NOTE="started dockerd (log $LOGS/dockerd.log)"
  else
    PART_NOTE="waited for a starting dockerd"
  fi
  wait_for 90 "docker info" docker_ok
}

# ----------------------------------------------------------------------------------------------
# 3. Registries
http_code() { curl -s -o /dev/null -m 5 -w '%{http_code}' "$1" 2>/dev/null || true; }
registry_answers() { [ "$(http_code "http://127.0.0.1:$1/v2/")" = "$2" ]; }
part_registries() {
  local dir=$STATE/registry started=()
  mkdir -p "$dir/open" "$dir/auth"
  if [ ! -s "$dir/htpasswd" ] || ! htpasswd -vb "$dir/htpasswd" "$AUTH_USER" "$AUTH_PASSWORD" >/dev/null 2>&1; then
    htpasswd -Bbc "$dir/htpasswd" "$AUTH_USER" "$AUTH_PASSWORD" >/dev/null 2>&1
  fi
  local name port want pidf code
  for name in open auth; do
    if [ "$name" = open ]; then port=5000 want=200; else port=5001 want=401; fi
    pidf=$dir/$name.pid
    if ! cmp -s "$CI_DIR/registry/$name.yml" "$dir/$name.yml"; then
      install -m 644 "$CI_DIR/registry/$name.yml" "$dir/$name.yml"
      # A registry this script started with another configuration: stop it by its pid.
      if stop_pid "$pidf" docker-registry; then started+=("(config changed)"); fi
    fi
    if registry_answers "$port" "$want"; then continue; fi
    watch_log "$LOGS/registry-$name.log"
    # Ours, yet not answering (hung, or still failing to listen): it goes, a new one starts.
    if stop_pid "$pidf" docker-registry; then started+=("(stopped $name: not answering)"); fi
    code=$(http_code "http://127.0.0.1:$port/v2/")
    if [ "$code" != 000 ]; then
      die "127.0.0.1:$port answers /v2/ with HTTP $code, not $want: something else holds the port"
    fi
    # setsid (not a group leader here, so no fork): $! is the registry itself.
    setsid docker-registry serve "$dir/$name.yml" >>"$LOGS/registry-$name.log" 2>&1 </dev/null 9>&- &
    echo $! >"$pidf"
    disown
    started+=("$name:$port")
  done
  wait_for 30 "registry 127.0.0.1:5000 (HTTP 200)" registry_answers 5000 200
  wait_for 30 "registry 127.0.0.1:5001 (HTTP 401)" registry_answers 5001 401
  # The tests start logged out of the password registry.
  if grep -qs '"localhost:5001"' "${DOCKER_CONFIG:-$HOME/.docker}/config.json"; then
    docker logout localhost:5001 >/dev/null 2>&1 || true
  fi
  if [ ${#started[@]} -eq 0 ]; then PART_NOTE="reused (both answering)"; else PART_NOTE="started ${started[*]}"; fi
}

# ----------------------------------------------------------------------------------------------
# 4. munge + one-node Slurm
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
slurm_node_state() { sinfo -h -N -n "$SLURM_HOST" -o '%t' 2>/dev/null | head -n 1; }
slurm_node_usable() {
  case "$(slurm_node_state)" in
    idle | mix | alloc | comp) return 0 ;;
    *) return 1 ;;
  esac
}
slurmctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
# start_slurmd: the one-node cluster's slurmd, with enroot (part 7c) on its PATH: pyxis (7d)
# runs `enroot` from the PATH of slurmstepd, which slurmd starts.
ENROOT_PREFIX=/opt/harbor-hpc-ci/enroot
start_slurmd() {
  clear_stale_pidfile /run/slurmd.pid slurmd
  env PATH="$ENROOT_PREFIX/bin:$PATH" slurmd 9>&-
}
# slurm_conf KEY: KEY's value in the rendered slurm.conf (keys are case-insensitive there).
slurm_conf() { awk -F= -v k="$1" 'tolower($1) == tolower(k) { print $2; exit }' /etc/slurm/slurm.conf; }
# Another cluster's state in StateSaveLocation makes slurmctld refuse to start ("CLUSTER NAME
# MISMATCH"). On this single-purpose test machine none of it is ours: move it aside (kept, so
# nothing is lost) and start with an empty state.
move_foreign_slurm_state() {
  local dir cluster found aside
  dir=$(slurm_conf StateSaveLocation)
  cluster=$(slurm_conf ClusterName)
  [ -s "$dir/clustername" ] || return 1
  found=$(tr -d '[:space:]' <"$dir/clustername")
  [ "$found" != "$cluster" ] || return 1
  aside="$dir.$found.$(date +%Y%m%d-%H%M%S)"
  mv "$dir" "$aside"
  install -d -m 755 "$dir"
  log "slurmctld's state in $dir belongs to cluster $found, not $cluster: moved it to $aside"
}

part_slurm() {
  local notes=()
  watch_log /var/log/munge/munged.log /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log
  # munge
  install -d -o munge -g munge -m 700 /etc/munge /var/lib/munge /var/log/munge
  install -d -o munge -g munge -m 755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    notes+=("new munge key")
  fi
  # munged refuses a key that others may read, or that is not its own.
  if [ "$(stat -c '%U:%G %a' /etc/munge/munge.key)" != "munge:munge 400" ]; then
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
    notes+=("munge key owner/mode fixed")
  fi
  if munge_ok; then
    notes+=("munged reused")
  else
    # One that runs but does not answer holds the socket's lock: it goes first.
    if stop_pid /run/munge/munged.pid munged; then notes+=("stopped a munged not answering"); fi
    runuser -u munge -- /usr/sbin/munged --force 9>&-
    wait_for 20 "munged" munge_ok
    notes+=("munged started")
  fi

  # slurm.conf from the template
  SLURM_HOST=$(hostname -s)
  local cpus mem_mb real_mem defmem tmp changed=0
  cpus=$(($(nproc) * 4)) # four a processor: see slurm.conf.in
  mem_mb=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 }' /proc/meminfo)
  real_mem=$((mem_mb * 90 / 100)) # below what slurmd measures, or it drains the node
  defmem=$((real_mem / cpus))
  tmp=$(mktemp)
  sed -e "s/@HOSTNAME@/$SLURM_HOST/g" -e "s/@CPUS@/$cpus/g" -e "s/@REALMEMORY@/$real_mem/g" \
    -e "s/@DEFMEMPERCPU@/$defmem/g" "$CI_DIR/slurm.conf.in" >"$tmp"
  mkdir -p /etc/slurm
  if ! cmp -s "$tmp" /etc/slurm/slurm.conf; then
    install -m 644 "$tmp" /etc/slurm/slurm.conf
    changed=1
  fi
  rm -f "$tmp"
  # Two GPUs of the type `fake` (GRES): Slurm hands them out, sets CUDA_VISIBLE_DEVICES and lets
  # the job open only its own (ConstrainDevices) as for real ones. Their device files have an
  # NVIDIA GPU's numbers (195:N) and no driver: opening one given says "No such device or
  # address", one not given "Operation not permitted".
  local gpu
  for gpu in 0 1; do
    if [ "$(stat -c '%F %t:%T' "/dev/harbor-hpc-gpu$gpu" 2>/dev/null)" != "character special file c3:$gpu" ]; then
      rm -f "/dev/harbor-hpc-gpu$gpu"
      mknod -m 666 "/dev/harbor-hpc-gpu$gpu" c 195 "$gpu"
      changed=1
    fi
  done
  tmp=$(mktemp)
  echo "NodeName=$SLURM_HOST Name=gpu Type=fake File=/dev/harbor-hpc-gpu[0-1]" >"$tmp"
  if ! cmp -s "$tmp" /etc/slurm/gres.conf; then
    install -m 644 "$tmp" /etc/slurm/gres.conf
    changed=1
  fi
  rm -f "$tmp"
  if ! cmp -s "$CI_DIR/cgroup.conf" /etc/slurm/cgroup.conf; then
    install -m 644 "$CI_DIR/cgroup.conf" /etc/slurm/cgroup.conf
    changed=1
  fi
  install -d -m 755 /var/spool/slurmctld /var/spool/slurmd /var/log/slurm

  if [ "$changed" = 1 ]; then
    # Our own daemons from an earlier run with another configuration: stop them by pid.
    local name
    for name in slurmd slurmctld; do
      if stop_pid "/run/$name.pid" "$name"; then notes+=("restarting $name for the new slurm.conf"); fi
    done
  fi
  if slurmctld_up; then
    notes+=("slurmctld reused")
  else
    clear_stale_pidfile /run/slurmctld.pid slurmctld
    if move_foreign_slurm_state; then
      notes+=("another cluster's state moved aside")
      # A controller with no state learns of the node when its slurmd registers: make that now,
      # not at the next ping (20 s on).
      stop_pid /run/slurmd.pid slurmd || true
    fi
    slurmctld -i 9>&-
    wait_for 30 "slurmctld (scontrol ping)" slurmctld_up
    notes+=("slurmctld started")
  fi
  # CI's stages of clusters as they are run slurmd under a seccomp filter (.ci/nonetns.c) or
  # with a small /tmp of its own (.ci/smalltmp) and restart it plain when done; one left so (a
  # cancelled CI) is restarted plain here.
  if pid_alive /run/slurmd.pid slurmd; then
    local slurmd_pid
    slurmd_pid=$(cat /run/slurmd.pid)
    if grep -q '^Seccomp:[[:space:]]*2' "/proc/$slurmd_pid/status" ||
      [ "$(readlink "/proc/$slurmd_pid/ns/mnt")" != "$(readlink /proc/self/ns/mnt)" ]; then
      stop_pid /run/slurmd.pid slurmd || true
      notes+=("slurmd restarted as provisioned (a CI stage had left it filtered or in a mount namespace)")
    fi
  fi
  if pid_alive /run/slurmd.pid slurmd; then
    notes+=("slurmd reused")
  else
    start_slurmd
    notes+=("slurmd started")
  fi
  local i state reason resumed="" left
  left=$(cancel_left_jobs /etc/slurm/slurm.conf)
  [ "$left" = 0 ] || notes+=("cancelled $left job(s) an earlier run left")
  # Wait for the node; resume it when it is DOWN or DRAINED (a test cluster has no admin who
  # drained it on purpose).
  for ((i = 0; i < 120; i++)); do
    state=$(slurm_node_state)
    # slurmd gone (it exits when it cannot register): start it again, now and then.
    if ((i % 10 == 9)) && ! pgrep -x slurmd >/dev/null; then
      start_slurmd || true
    fi
    case "$state" in
      idle | mix | alloc | comp) break ;;
      down* | drain* | drng* | fail*)
        reason=$(sinfo -h -N -n "$SLURM_HOST" -o '%E' 2>/dev/null | head -n 1)
        if scontrol update nodename="$SLURM_HOST" state=resume >/dev/null 2>&1 && [ -z "$resumed" ]; then
          resumed="node resumed from $state ($reason)"
          notes+=("$resumed")
        fi
        ;;
    esac
    sleep 0.5
  done
  if ! slurm_node_usable; then
    reason=$(sinfo -h -N -n "$SLURM_HOST" -o '%E' 2>/dev/null | head -n 1)
    die "Slurm node $SLURM_HOST is still '${state:-unknown}' after 60 s${reason:+ ($reason)}"
  fi
  # A job end to end, unless everything was already running (then the node may be busy with
  # someone's jobs, and a test job would have to wait for them).
  local checked="no test job (all reused)"
  if [[ "${notes[*]}" == *started* || "${notes[*]}" == *restarting* ]]; then
    timeout 120 srun -N1 -n1 -t 1 -Q true || die "srun -N1 true failed"
    checked="srun ok"
  fi
  PART_NOTE=$(
    IFS=,
    echo "${notes[*]}; node $SLURM_HOST $(slurm_node_state), $checked"
  )
}

# ----------------------------------------------------------------------------------------------
# 5. Apptainer: Debian unstable's package, run on a private glibc (bookworm's is too old)
APT_U=$CACHE/apt-unstable
DEBS=$CACHE/apptainer-debs
apt_u() {
  apt-get -q \
    -o Dir::Etc::SourceList="$APT_U/unstable.list" -o Dir::Etc::SourceParts=/dev/null \
    -o Dir::State="$APT_U/state" -o Dir::State::Lists="$APT_U/lists" \
    -o Dir::State::status="$APT_U/status" -o Dir::Cache="$APT_U/cache" \
    -o Acquire::Languages=none -o APT::Architectures::=amd64 -o APT::Architecture=amd64 \
    -o Debug::NoLocking=true "$@"
}
apptainer_version() { apptainer version 2>/dev/null || true; }
apptainer_ok() {
  [ "$(apptainer_version)" = "$APPTAINER_WANT" ] &&
    [ -f "$STATE/apptainer.stamp" ] &&
    [ "$(patchelf --print-interpreter "$APPTAINER_STARTER" 2>/dev/null)" = "$APPTAINER_GLIBC/ld-linux-x86-64.so.2" ]
}
# Background: fetch the four .debs (only if the installed apptainer is not good and none are cached).
part_apptainer_fetch() {
  if apptainer_ok; then
    PART_NOTE="reused (installed)"
    return 0
  fi
  local p have=1
  for p in apptainer libc6 libseccomp2 libsqlite3-0; do
    compgen -G "$DEBS/${p}_*.deb" >/dev/null || have=0
  done
  if [ "$have" = 1 ]; then
    PART_NOTE="reused cached .debs"
    return 0
  fi
  mkdir -p "$APT_U/state" "$APT_U/lists/partial" "$APT_U/cache/archives/partial"
  : >"$APT_U/status"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR unstable main" \
    >"$APT_U/unstable.list"
  apt_u update
  local ver
  ver=$(apt_u -qq madison apptainer 2>/dev/null | awk -F'|' '{ gsub(/ /, "", $2); print $2 }' |
    grep -m1 "^${APPTAINER_WANT//./\\.}-" || true)
  local want=apptainer
  if [ -n "$ver" ]; then
    want="apptainer=$ver"
  else
    echo "WARNING: unstable has no apptainer $APPTAINER_WANT; taking its candidate" >&2
  fi
  local tmp
  tmp=$(mktemp -d "$CACHE/debs.XXXXXX")
  (cd "$tmp" && apt_u download "$want" libc6 libseccomp2 libsqlite3-0)
  rm -rf "$DEBS"
  mv "$tmp" "$DEBS"
  PART_NOTE="downloaded $(cd "$DEBS" && echo *.deb)"
}
part_apptainer_install() {
  local notes=()
  if apptainer_ok; then
    notes+=("apptainer $APPTAINER_WANT reused")
  else
    local scratch f
    scratch=$(mktemp -d "$CACHE/apptainer-unpack.XXXXXX")
    for f in "$DEBS"/*.deb; do dpkg-deb -x "$f" "$scratch"; done
    # The private glibc (plus unstable's libseccomp and libsqlite), dereferenced.
    rm -rf "$APPTAINER_GLIBC.new"
    mkdir -p "$APPTAINER_GLIBC.new"
    cp -L "$scratch"/usr/lib/x86_64-linux-gnu/*.so* "$APPTAINER_GLIBC.new/"
    [ -f "$APPTAINER_GLIBC.new/ld-linux-x86-64.so.2" ] || die "no ld-linux-x86-64.so.2 in unstable's libc6"
    # Point apptainer's two ELF programs at it (--force-rpath: a RUNPATH would not reach the
    # libraries' own dependencies), before anything is moved into place.
    for f in "$scratch/usr/bin/apptainer" "$scratch$APPTAINER_STARTER"; do
      patchelf --set-interpreter "$APPTAINER_GLIBC/ld-linux-x86-64.so.2" \
        --force-rpath --set-rpath "$APPTAINER_GLIBC" "$f"
    done
    # Swap things in by rename, so a running apptainer is never left half-installed.
    rm -rf "$APPTAINER_GLIBC.old"
    [ ! -e "$APPTAINER_GLIBC" ] || mv "$APPTAINER_GLIBC" "$APPTAINER_GLIBC.old"
    mv "$APPTAINER_GLIBC.new" "$APPTAINER_GLIBC"
    rm -rf "$APPTAINER_GLIBC.old"
    local libdir=/usr/lib/x86_64-linux-gnu/apptainer
    rm -rf "$libdir.new" "$libdir.old"
    cp -a "$scratch$libdir" "$libdir.new"
    [ ! -e "$libdir" ] || mv "$libdir" "$libdir.old"
    mv "$libdir.new" "$libdir"
    rm -rf "$libdir.old"
    for f in "$scratch"/usr/bin/*; do
      cp -a "$f" "/usr/bin/.$(basename "$f").new"
      mv -f "/usr/bin/.$(basename "$f").new" "/usr/bin/$(basename "$f")"
    done
    mkdir -p /etc/apptainer /var/lib/apptainer
    cp -a "$scratch/etc/apptainer/." /etc/apptainer/
    if [ -d "$scratch/var/lib/apptainer" ]; then cp -a "$scratch/var/lib/apptainer/." /var/lib/apptainer/; fi
    if [ -d "$scratch/usr/share" ]; then cp -a "$scratch/usr/share/." /usr/share/ 2>/dev/null || true; fi
    rm -rf "$scratch"
    local v
    v=$(apptainer_version)
    [ -n "$v" ] || die "the installed apptainer does not run"
    if [ "$v" != "$APPTAINER_WANT" ]; then
      echo "[provision] WARNING: apptainer version is $v, not $APPTAINER_WANT" >&2
    fi
    echo "$v" >"$STATE/apptainer.stamp"
    notes+=("apptainer $v installed")
  fi
  if [ "$(readlink /usr/bin/singularity 2>/dev/null || true)" != apptainer ]; then
    rm -f /usr/bin/singularity
    ln -s apptainer /usr/bin/singularity
  fi

  # squashfuse as a non-root user needs /dev/fuse.
  [ -e /dev/fuse ] || mknod -m 666 /dev/fuse c 10 229
  chmod 666 /dev/fuse
  # The tests' small filesystems (fuse2fs, to fill up) hold run folders, whose Slurm job output
  # slurmstepd opens as root: users may mount with allow_other (modes still checked).
  if ! grep -qx 'user_allow_other' /etc/fuse.conf 2>/dev/null; then
    echo user_allow_other >>/etc/fuse.conf
    notes+=("user_allow_other in /etc/fuse.conf")
  fi
  # slirp4netns (a network of its own for each container) as a non-root user needs /dev/net/tun,
  # which most distributions ship mode 666; this machine's is 600.
  [ -e /dev/net/tun ] || { mkdir -p /dev/net && mknod -m 666 /dev/net/tun c 10 200; }
  chmod 666 /dev/net/tun
  PART_NOTE=$(
    IFS=,
    echo "${notes[*]}"
  )
}

# ----------------------------------------------------------------------------------------------
# 5d. An egress test host: a network namespace of this machine's own (10.79.0.2, a veth pair from
# 10.79.0.1) where a server answers "reached PORT" on ports 80, 443 and 2222, for the network
# policy tests: what a container's allowlist lets through reaches it, the rest is refused.
EGRESS_NS=harbor-hpc-egress
EGRESS_HOST=10.79.0.2
egress_host_answers() {
  [ "$(timeout 5 bash -c "exec 3<>/dev/tcp/$EGRESS_HOST/80; head -c 10 <&3" 2>/dev/null)" = "reached 80" ]
}
part_egress_host() {
  if egress_host_answers; then
    PART_NOTE="reused $EGRESS_HOST"
    return 0
  fi
  if ! ip netns list | grep -qw "$EGRESS_NS"; then
    ip netns add "$EGRESS_NS"
    ip link add hh-egress0 type veth peer name hh-egress1
    ip link set hh-egress1 netns "$EGRESS_NS"
    ip addr add 10.79.0.1/24 dev hh-egress0
    ip link set hh-egress0 up
    ip -n "$EGRESS_NS" addr add "$EGRESS_HOST/24" dev hh-egress1
    ip -n "$EGRESS_NS" link set hh-egress1 up
    ip -n "$EGRESS_NS" link set lo up
  fi
  pkill -f 'harbor-hpc-egress-server' 2>/dev/null || true
  setsid ip netns exec "$EGRESS_NS" python3 -c '
import socketserver, sys  # harbor-hpc-egress-server
class Reply(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(b"reached %d\n" % self.server.server_address[1])
class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
import threading
servers = [Server(("0.0.0.0", port), Reply) for port in (80, 443, 2222)]
for server in servers[1:]:
    threading.Thread(target=server.serve_forever, daemon=True).start()
servers[0].serve_forever()
' harbor-hpc-egress-server >"$LOGS/egress-host.log" 2>&1 </dev/null 9>&- &
  wait_for 20 "the egress test host at $EGRESS_HOST" egress_host_answers
  PART_NOTE="started $EGRESS_HOST"
}

# ----------------------------------------------------------------------------------------------
# 5e. Three Slurm nodes on this machine (n1..n3, partition multi), beside the one-node cluster:
# each node is a slurmd in a network namespace of its own (its address on a bridge, no default
# route, as compute nodes often have none), a UTS namespace (its own hostname) and a mount
# namespace with its own /tmp (node-local scratch); one slurmctld of their own (ports 6827/6828,
# its own state). Users reach it with SLURM_CONF=$MULTI_CONF. Homes and $SHARED_DIR are shared.
MULTI_CONF=/etc/slurm-multi/slurm.conf
MULTI_NET=10.77.0
MULTI_BRIDGE=hh-multi0
MULTI_NODES=(n1 n2 n3)
MULTI_TMP=/var/tmp/harbor-hpc-nodes # each node's /tmp is its folder here
SHARED_DIR=/srv/harbor-hpc-shared   # a work folder every node sees (as a cluster's /scratch)
multi() { SLURM_CONF=$MULTI_CONF timeout 10 "$@"; }
multi_ctld_up() { multi scontrol ping 2>/dev/null | grep -q 'is UP'; }
multi_usable() { [ "$(multi sinfo -h -N -p multi -o '%t' 2>/dev/null | grep -cE '^(idle|mix|alloc|comp)')" = "${#MULTI_NODES[@]}" ]; }
nodes_reach_registries() { [ "$(ip netns exec hh-n1 curl -s -o /dev/null -w '%{http_code}' --max-time 5 http://127.0.0.1:5000/v2/)" = 200 ]; }
multi_node_net() { # NODE INDEX: its namespace, veth pair on the bridge, address, /etc/hosts line
  local node=$1 i=$2 ns=hh-$1
  if ! ip netns list | grep -qw "$ns"; then
    ip netns add "$ns"
    ip link add "hh-$node-h" type veth peer name "hh-$node-c"
    ip link set "hh-$node-h" master "$MULTI_BRIDGE" up
    ip link set "hh-$node-c" netns "$ns"
    ip -n "$ns" addr add "$MULTI_NET.1$i/24" dev "hh-$node-c"
    ip -n "$ns" link set "hh-$node-c" up
    ip -n "$ns" link set lo up
  fi
  grep -q "^$MULTI_NET.1$i $node\$" /etc/hosts || echo "$MULTI_NET.1$i $node" >>/etc/hosts
}
# The checkout being tested stays visible on the nodes when it lives under /tmp (a CI clone, its
# venv): bound back into each node's own /tmp, as a shared filesystem holds it on a cluster.
multi_keep() { case "$REPO_DIR" in /tmp/*) echo "$REPO_DIR" ;; *) echo "" ;; esac; }
# Nodes start, crash, lose their network and come back through .ci/node, installed for the tests.
NODE_TOOL=/usr/local/sbin/harbor-hpc-ci-node
NONETNS=/usr/local/sbin/harbor-hpc-ci-nonetns

part_multinode() {
  local notes=() i node tmp cpus mem_mb real_mem changed=0 left
  watch_log /var/log/slurm/slurmctld-multi.log
  if ! ip link show "$MULTI_BRIDGE" >/dev/null 2>&1; then
    ip link add "$MULTI_BRIDGE" type bridge
    ip addr add "$MULTI_NET.1/24" dev "$MULTI_BRIDGE"
    ip link set "$MULTI_BRIDGE" up
    notes+=("bridge made")
  fi
  # Docker sets FORWARD to DROP: traffic between nodes crosses the bridge through it.
  iptables -C FORWARD -i "$MULTI_BRIDGE" -o "$MULTI_BRIDGE" -j ACCEPT 2>/dev/null ||
    iptables -I FORWARD -i "$MULTI_BRIDGE" -o "$MULTI_BRIDGE" -j ACCEPT
  for i in "${!MULTI_NODES[@]}"; do multi_node_net "${MULTI_NODES[$i]}" "$((i + 1))"; done
  install -d -m 1777 "$SHARED_DIR"
  if ! cmp -s "$CI_DIR/node" "$NODE_TOOL"; then
    install -m 755 -o root -g root "$CI_DIR/node" "$NODE_TOOL"
    notes+=("installed $NODE_TOOL")
  fi
  # A command where no network namespace can be made (.ci/nonetns.c), for CI's stage of that.
  if ! cmp -s "$CI_DIR/nonetns.c" "$NONETNS.c" || [ ! -x "$NONETNS" ]; then
    gcc -O2 -Wall -Werror -o "$NONETNS.new" "$CI_DIR/nonetns.c" || die "cannot compile $CI_DIR/nonetns.c"
    mv "$NONETNS.new" "$NONETNS"
    install -m 644 "$CI_DIR/nonetns.c" "$NONETNS.c"
    notes+=("built $NONETNS")
  fi

  cpus=$(nproc)
  mem_mb=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 }' /proc/meminfo)
  # Each node offers what its processes see, the machine's memory (below what slurmd measures),
  # as it offers all of the machine's processors: the nodes share both.
  real_mem=$((mem_mb * 90 / 100))
  tmp=$(mktemp)
  sed -e "s/@HOSTNAME@/$(hostname -s)/g" -e "s/@NET@/$MULTI_NET/g" -e "s/@CPUS@/$cpus/g" \
    -e "s/@REALMEMORY@/$real_mem/g" -e "s/@DEFMEMPERCPU@/$((real_mem / cpus))/g" \
    "$CI_DIR/slurm-multi.conf.in" >"$tmp"
  install -d -m 755 /etc/slurm-multi /var/spool/slurmctld-multi /var/spool/slurmd-multi
  if ! cmp -s "$tmp" "$MULTI_CONF"; then
    install -m 644 "$tmp" "$MULTI_CONF"
    changed=1
  fi
  if ! cmp -s "$CI_DIR/cgroup.conf" /etc/slurm-multi/cgroup.conf; then
    install -m 644 "$CI_DIR/cgroup.conf" /etc/slurm-multi/cgroup.conf
    changed=1
  fi
  rm -f "$tmp"
  if [ "$changed" = 1 ]; then
    stop_pid /run/slurmctld-multi.pid slurmctld && notes+=("restarting for the new slurm.conf")
  fi
  # The nodes see the checkout they were started with: another one's nodes start again.
  if [ "$changed" = 1 ] || [ "$(cat "$STATE/multinode-checkout" 2>/dev/null)" != "$(multi_keep)" ]; then
    for node in "${MULTI_NODES[@]}"; do
      stop_pid "/run/slurmd-multi-$node.pid" slurmd && notes+=("slurmd $node stopped") || true
    done
  fi
  multi_keep >"$STATE/multinode-checkout"
  if multi_ctld_up; then
    notes+=("slurmctld reused")
  else
    clear_stale_pidfile /run/slurmctld-multi.pid slurmctld
    slurmctld -i -f "$MULTI_CONF" 9>&-
    wait_for 30 "the multi-node slurmctld (scontrol ping)" multi_ctld_up
    notes+=("slurmctld started")
  fi
  left=$(cancel_left_jobs "$MULTI_CONF")
  [ "$left" = 0 ] || notes+=("cancelled $left job(s) an earlier run left")
  for node in "${MULTI_NODES[@]}"; do
    # A fault test that ended early may have left its node cut off or crashed.
    "$NODE_TOOL" heal "$node"
    if pid_alive "/run/slurmd-multi-$node.pid" slurmd; then continue; fi
    "$NODE_TOOL" start "$node"
    notes+=("slurmd $node started")
  done
  for ((i = 0; i < 120; i++)); do
    multi_usable && break
    multi scontrol update nodename="n[1-3]" state=resume >/dev/null 2>&1 || true
    sleep 0.5
  done
  multi_usable || die "the multi-node cluster's nodes are not all up after 60 s: $(multi sinfo -N 2>&1 | tr '\n' ' ')"
  # The registries at localhost:5000/5001 on every node, as on this machine (.ci/registry/nodes.py).
  if ! nodes_reach_registries || ! cmp -s "$CI_DIR/registry/nodes.py" "$STATE/registry-nodes.py"; then
    pkill -f 'registry-nodes.py' 2>/dev/null || true
    install -m 644 "$CI_DIR/registry/nodes.py" "$STATE/registry-nodes.py"
    setsid python3 "$STATE/registry-nodes.py" "${MULTI_NODES[@]/#/hh-}" >"$LOGS/registry-nodes.log" 2>&1 </dev/null 9>&- &
    wait_for 20 "the registries from the nodes (localhost:5000 in hh-n1)" nodes_reach_registries
    notes+=("registries forwarded")
  fi
  if [[ "${notes[*]}" == *started* ]]; then
    multi srun -N3 -n3 -t 1 -Q hostname >/dev/null || die "srun -N3 hostname failed on the multi-node cluster"
    notes+=("srun -N3 ok")
  fi
  PART_NOTE=$(
    IFS=,
    echo "${notes[*]:-all reused}; nodes ${MULTI_NODES[*]} up"
  )
}

# ----------------------------------------------------------------------------------------------
# 5c. Ordinary users: TEST_USER runs the tests (what cluster users are), OTHER_USER is "another
# user" that TEST_USER becomes with sudo (no password, no root needed in the tests).
SUBID_COUNT=65536
# add_subid_range FILE USER: give USER a range in FILE unless it has one. A new range starts above
# every range already in the file (and at 1000000 at least), so it overlaps none of them.
add_subid_range() {
  local file=$1 user=$2 start
  if grep -q "^$user:" "$file"; then return 1; fi
  start=$(awk -F: 'BEGIN { m = 1000000 } $2 ~ /^[0-9]+$/ && $3 ~ /^[0-9]+$/ { if ($2 + $3 > m) m = $2 + $3 } END { print m }' "$file")
  echo "$user:$start:$SUBID_COUNT" >>"$file"
}
# subid_overlaps FILE USER...: print "a/b" for every two ranges in FILE that overlap where one
# of them belongs to one of USERs.
subid_overlaps() {
  local file=$1
  shift
  awk -F: -v users=" $* " '
    $2 ~ /^[0-9]+$/ && $3 ~ /^[0-9]+$/ { n++; u[n] = $1; s[n] = $2; e[n] = $2 + $3 }
    END {
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) {
        if (index(users, " " u[i] " ") == 0 && index(users, " " u[j] " ") == 0) continue
        if (s[i] < e[j] && s[j] < e[i]) print u[i] "(" s[i] ")/" u[j] "(" s[j] ")"
      }
    }' "$file"
}
part_users() {
  local notes=() u f overlaps
  for u in "$TEST_USER" "$OTHER_USER"; do
    if ! id "$u" >/dev/null 2>&1; then
      useradd -m -s /bin/bash "$u"
      notes+=("user $u created")
    fi
  done
  # Subordinate ids for --fakeroot (useradd may have given the users theirs already); none for
  # NOSUB_USER, as on clusters whose admins never added them (Apptainer then maps root alone).
  if ! id "$NOSUB_USER" >/dev/null 2>&1; then
    useradd -m -s /bin/bash "$NOSUB_USER"
    notes+=("user $NOSUB_USER created")
  fi
  for f in /etc/subuid /etc/subgid; do
    touch "$f"
    for u in root "$OTHER_USER" "$TEST_USER"; do
      if add_subid_range "$f" "$u"; then notes+=("$u range in $f"); fi
    done
    if grep -q "^$NOSUB_USER:" "$f"; then
      sed -i "/^$NOSUB_USER:/d" "$f"
      notes+=("$NOSUB_USER range removed from $f")
    fi
    overlaps=$(subid_overlaps "$f" root "$OTHER_USER" "$TEST_USER")
    [ -z "$overlaps" ] || die "overlapping ranges in $f: $overlaps"
  done
  # The testers use the Docker Engine (and apptainer build docker-daemon://...) as group members
  # (to make the test images; what they test runs without it).
  getent group docker >/dev/null || die "there is no group docker (the docker.io package makes it)"
  for u in "$TEST_USER" "$NOSUB_USER"; do
    if [[ " $(id -nG "$u") " != *" docker "* ]]; then
      usermod -aG docker "$u"
      notes+=("$u added to group docker")
    fi
  done
  # Both users are members of a lab group, as a lab sharing one .sif store would be.
  if ! getent group "$LAB_GROUP" >/dev/null; then
    groupadd "$LAB_GROUP"
    notes+=("group $LAB_GROUP created")
  fi
  for u in "$TEST_USER" "$OTHER_USER"; do
    if [[ " $(id -nG "$u") " != *" $LAB_GROUP "* ]]; then
      usermod -aG "$LAB_GROUP" "$u"
      notes+=("$u added to group $LAB_GROUP")
    fi
  done
  # The tester becomes the other user without a password (tests of "another local user").
  local tmp
  tmp=$(mktemp)
  printf '%s\n' "# Written by harbor-hpc's .ci/provision.sh: the test user acts as the other user," \
    "# and starts, crashes, cuts off and heals the multi-node cluster's nodes (.ci/node)." \
    "$TEST_USER ALL=($OTHER_USER) NOPASSWD: ALL" \
    "$TEST_USER ALL=(root) NOPASSWD: $NODE_TOOL start n[1-3], $NODE_TOOL crash n[1-3], $NODE_TOOL cut n[1-3], $NODE_TOOL heal n[1-3], $NODE_TOOL pids n[1-3]" >"$tmp"
  if ! cmp -s "$tmp" "$SUDOERS_FILE"; then
    visudo -cqf "$tmp" >/dev/null || {
      rm -f "$tmp"
      die "visudo rejects the sudoers drop-in for $SUDOERS_FILE"
    }
    install -m 0440 -o root -g root "$tmp" "$SUDOERS_FILE"
    notes+=("wrote $SUDOERS_FILE")
  fi
  rm -f "$tmp"
  chmod 0440 "$SUDOERS_FILE"
  visudo -cq >/dev/null || die "visudo -c fails with $SUDOERS_FILE in place"
  runuser -u "$TEST_USER" -- sudo -n -u "$OTHER_USER" -- true </dev/null ||
    die "$TEST_USER cannot run a command as $OTHER_USER with sudo -n"
  # The tests start logged out of the password registry (they log in with their own config).
  local tester_home
  tester_home=$(getent passwd "$TEST_USER" | cut -d: -f6)
  if grep -qs '"localhost:5001"' "$tester_home/.docker/config.json"; then
    runuser -u "$TEST_USER" -- env HOME="$tester_home" docker logout localhost:5001 >/dev/null 2>&1 || true
    notes+=("$TEST_USER logged out of localhost:5001")
  fi
  # The project's interpreter lives under /root/.pyenv: let ordinary users traverse /root (not
  # list it) so they can run our environment and CLI.
  chmod o+x /root
  [ ${#notes[@]} -gt 0 ] || notes=("reused ($TEST_USER, $OTHER_USER)")
  PART_NOTE=$(
    IFS=,
    echo "${notes[*]}"
  )
}

# ----------------------------------------------------------------------------------------------
# 5f. A one-node cluster with the low limits many sites set (issue 50), beside the others:
# node lim1 on this host (a slurmd of its own: Debian's Slurm runs several on one host, each
# its own cgroups), its own slurmctld (ports 6837/6838) with MaxArraySize=100, and accounting
# through slurmdbd and MariaDB so that per-user limits hold: MaxSubmitJobs=20 for each test
# user. Users reach it with SLURM_CONF=$LIMITS_CONF.
LIMITS_CONF=/etc/slurm-limits/slurm.conf
LIMITS_MAX_SUBMIT=20
limits() { SLURM_CONF=$LIMITS_CONF timeout 10 "$@"; }
mariadb_up() { mariadb -e 'select 1'; }
slurmdbd_up() { limits sacctmgr -n show cluster; }
limits_ctld_up() { limits scontrol ping 2>/dev/null | grep -q 'is UP'; }
limits_usable() { case "$(limits sinfo -h -N -o '%t' 2>/dev/null)" in idle | mix | alloc) return 0 ;; esac; return 1; }

part_limits() {
  local notes=() tmp cpus mem_mb real_mem changed=0 user i left
  watch_log /var/log/slurm/slurmdbd.log /var/log/slurm/slurmctld-limits.log /var/log/slurm/slurmd-limits.log
  if mariadb_up >/dev/null 2>&1; then
    notes+=("mariadb reused")
  else
    install -d -o mysql -g mysql -m 755 /run/mysqld
    setsid /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 --innodb-buffer-pool-size=32M \
      >"$LOGS/mariadbd.log" 2>&1 </dev/null 9>&- &
    wait_for 60 "mariadbd (mariadb -e 'select 1')" mariadb_up
    notes+=("mariadb started")
  fi
  mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost';
    ALTER USER 'slurm'@'localhost' IDENTIFIED BY 'harbor-hpc-ci';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  tmp=$(mktemp)
  cat >"$tmp" <<'DBD'
# slurmdbd for the cluster with low limits (.ci/provision.sh part 5f); the other clusters keep
# no accounting.
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=harbor-hpc-ci
StorageLoc=slurm_acct_db
DBD
  if ! cmp -s "$tmp" /etc/slurm/slurmdbd.conf; then
    install -m 600 "$tmp" /etc/slurm/slurmdbd.conf
    stop_pid /run/slurmdbd.pid slurmdbd && notes+=("restarting slurmdbd for its new conf") || true
  fi
  cpus=$(($(nproc) * 4)) # as the one-node cluster: slurm.conf.in says why
  mem_mb=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 }' /proc/meminfo)
  real_mem=$((mem_mb * 90 / 100))
  sed -e "s/@HOSTNAME@/$(hostname -s)/g" -e "s/@CPUS@/$cpus/g" -e "s/@REALMEMORY@/$real_mem/g" \
    -e "s/@DEFMEMPERCPU@/$((real_mem / cpus))/g" "$CI_DIR/slurm-limits.conf.in" >"$tmp"
  install -d -m 755 /etc/slurm-limits /var/spool/slurmctld-limits /var/spool/slurmd-limits
  if ! cmp -s "$tmp" "$LIMITS_CONF"; then
    install -m 644 "$tmp" "$LIMITS_CONF"
    changed=1
  fi
  if ! cmp -s "$CI_DIR/cgroup.conf" /etc/slurm-limits/cgroup.conf; then
    install -m 644 "$CI_DIR/cgroup.conf" /etc/slurm-limits/cgroup.conf
    changed=1
  fi
  rm -f "$tmp"
  if pid_alive /run/slurmdbd.pid slurmdbd; then
    notes+=("slurmdbd reused")
  else
    clear_stale_pidfile /run/slurmdbd.pid slurmdbd
    slurmdbd 9>&-
    wait_for 30 "slurmdbd (sacctmgr show cluster)" slurmdbd_up
    notes+=("slurmdbd started")
  fi
  # The associations the limits hold on (`-i`: no questions; adding what exists is refused).
  limits sacctmgr -i add cluster harbor-hpc-limits >/dev/null 2>&1 || true
  limits sacctmgr -i add account ci Cluster=harbor-hpc-limits >/dev/null 2>&1 || true
  limits sacctmgr -i add user root Account=ci >/dev/null 2>&1 || true
  for user in "$TEST_USER" "$OTHER_USER" "$NOSUB_USER"; do
    limits sacctmgr -i add user "$user" Account=ci >/dev/null 2>&1 || true
    limits sacctmgr -i modify user where name="$user" set MaxSubmitJobs=$LIMITS_MAX_SUBMIT >/dev/null 2>&1 || true
    [ "$(limits sacctmgr -n -P show assoc where user="$user" format=MaxSubmit)" = "$LIMITS_MAX_SUBMIT" ] ||
      die "sacctmgr did not set MaxSubmitJobs=$LIMITS_MAX_SUBMIT for $user on harbor-hpc-limits"
  done
  if [ "$changed" = 1 ]; then
    stop_pid /run/slurmctld-limits.pid slurmctld && notes+=("restarting for the new slurm.conf") || true
    stop_pid /run/slurmd-limits.pid slurmd || true
  fi
  if limits_ctld_up; then
    notes+=("slurmctld reused")
  else
    clear_stale_pidfile /run/slurmctld-limits.pid slurmctld
    slurmctld -i -f "$LIMITS_CONF" 9>&-
    wait_for 30 "the limits cluster's slurmctld (scontrol ping)" limits_ctld_up
    notes+=("slurmctld started")
  fi
  left=$(cancel_left_jobs "$LIMITS_CONF")
  [ "$left" = 0 ] || notes+=("cancelled $left job(s) an earlier run left")
  if ! pid_alive /run/slurmd-limits.pid slurmd; then
    clear_stale_pidfile /run/slurmd-limits.pid slurmd
    slurmd -f "$LIMITS_CONF" -N lim1 9>&-
    notes+=("slurmd lim1 started")
  fi
  for ((i = 0; i < 120; i++)); do
    limits_usable && break
    limits scontrol update nodename=lim1 state=resume >/dev/null 2>&1 || true
    sleep 0.5
  done
  limits_usable || die "the limits cluster's node lim1 is not up after 60 s: $(limits sinfo -N 2>&1 | tr '\n' ' ')"
  PART_NOTE=$(
    IFS=,
    echo "${notes[*]}; MaxArraySize=$(limits scontrol show config | awk '/^MaxArraySize/ { print $3 }'), MaxSubmitJobs=$LIMITS_MAX_SUBMIT"
  )
}

# ----------------------------------------------------------------------------------------------
# 6. Base images, from debootstrap root file systems cached as tarballs
umount_under() { # unmount whatever a killed debootstrap left mounted below $1
  local m
  for m in $(awk -v d="$1" 'index($2, d "/") == 1 { print $2 }' /proc/mounts | sort -r); do
    umount -l "$m" || true
  done
}
# build_rootfs NAME INCLUDE(comma list or empty): -> $CACHE/rootfs/NAME.tar
build_rootfs() {
  local name=$1 include=$2 tar=$CACHE/rootfs/$1.tar root
  if [ -s "$tar" ]; then
    PART_NOTE="reused $tar"
    return 0
  fi
  mkdir -p "$CACHE/rootfs" "$STATE/build"
  root=$STATE/build/$name
  umount_under "$root"
  rm -rf "$root"
  local args=(--variant=minbase)
  [ -z "$include" ] || args+=("--include=$include")
  debootstrap "${args[@]}" bookworm "$root" "$MIRROR" >"$LOGS/debootstrap-$name.log" 2>&1 || {
    tail -n 30 "$LOGS/debootstrap-$name.log"
    umount_under "$root"
    return 1
  }
  umount_under "$root"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/debootstrap
  tar -C "$root" --numeric-owner -cf "$tar.tmp" .
  mv "$tar.tmp" "$tar"
  rm -rf "$root"
  PART_NOTE="debootstrapped $tar ($(du -m "$tar" | cut -f1) MB)"
}
# The test base image: python3 (the verifiers'), tmux and asciinema (terminus-2's: it installs
# them with apt-get in every trial of an image without them, 7 s each), as task images have.
# Its name changes with what it holds, so that a machine provisioned before builds it again.
PY_ROOTFS=debian-bookworm-2
bg_rootfs_python() {
  if image_is "$BASE_IMAGE" "$PY_ROOTFS" && [ -s "$CACHE/rootfs/$PY_ROOTFS.tar" ]; then
    PART_NOTE="reused"
    return 0
  fi
  build_rootfs "$PY_ROOTFS" python3,python3-venv,tmux,asciinema,procps,ca-certificates
}
bg_rootfs_nopython() {
  if image_is "$NOPY_IMAGE" debian-nopython-bookworm && [ -s "$CACHE/rootfs/debian-nopython-bookworm.tar" ]; then
    PART_NOTE="reused"
    return 0
  fi
  build_rootfs debian-nopython-bookworm ""
}
# image_is IMAGE ROOTFS: IMAGE is there, imported from the root file system ROOTFS.
image_is() {
  [ "$(docker image inspect -f '{{index .Config.Labels "harbor-hpc-ci.rootfs"}}' "$1" 2>/dev/null)" = "$2" ]
}
import_image() { # IMAGE ROOTFS: from $CACHE/rootfs/ROOTFS.tar, labelled with its name
  if image_is "$1" "$2"; then
    echo "$1 reused"
    return 0
  fi
  docker import --change 'CMD ["/bin/bash"]' --change "LABEL harbor-hpc-ci.rootfs=$2" \
    "$CACHE/rootfs/$2.tar" "$1" >/dev/null
  echo "$1 imported"
}
part_images() {
  local a b
  a=$(import_image "$BASE_IMAGE" "$PY_ROOTFS")
  b=$(import_image "$NOPY_IMAGE" debian-nopython-bookworm)
  if [[ $a == *imported ]]; then
    docker run --rm "$BASE_IMAGE" python3 -c 'import sys, venv; assert sys.version_info[:2] == (3, 11)' ||
      die "$BASE_IMAGE has no working python3"
    docker run --rm "$BASE_IMAGE" asciinema --version >/dev/null || die "$BASE_IMAGE has no asciinema"
  fi
  if [[ $b == *imported ]] && docker run --rm "$NOPY_IMAGE" sh -c 'command -v python3' >/dev/null 2>&1; then
    die "$NOPY_IMAGE has a python3"
  fi
  PART_NOTE="$a, $b"
}

# ----------------------------------------------------------------------------------------------
# 7. Wheels for containers (pip inside a container cannot pass the TLS proxy)
bg_wheels() {
  local marker=$WHEELS/.complete want
  want="py3.11 manylinux2014_x86_64: ${WHEEL_PKGS[*]}"
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
    PART_NOTE="reused $WHEELS"
    return 0
  fi
  local py=python3
  mkdir -p "$WHEELS"
  # Outside any project folder, so a .python-version there does not matter.
  (cd / && PIP_FIND_LINKS="" "$py" -m pip download -q -d "$WHEELS" --only-binary=:all: \
    --python-version 3.11 --platform manylinux2014_x86_64 "${WHEEL_PKGS[@]}")
  echo "$want" >"$marker"
  PART_NOTE="downloaded $(find "$WHEELS" -name '*.whl' | wc -l) wheels"
}

# 7b. TRL's Harbor integration (issue 56), which harbor_hpc.trl subclasses: trl 1.16 alone,
# without its dependencies (torch, transformers...: trl.experimental.harbor imports none of
# them), in a folder of its own on the test user's PYTHONPATH (the env file): not in the
# project's venv, which `uv sync` would take it out of.
TRL_VERSION=1.16.0
TRL_SITE=$STATE/trl
bg_trl() {
  local marker=$TRL_SITE/.complete
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$TRL_VERSION" ]; then
    PART_NOTE="reused $TRL_SITE"
    return 0
  fi
  rm -rf "$TRL_SITE"
  (cd / && PIP_FIND_LINKS="" python3 -m pip install -q --no-deps --no-compile \
    --target "$TRL_SITE" "trl==$TRL_VERSION")
  chmod -R o+rX "$TRL_SITE"
  echo "$TRL_VERSION" >"$marker"
  PART_NOTE="trl $TRL_VERSION in $TRL_SITE"
}

# ----------------------------------------------------------------------------------------------
# 7c. enroot 4.1.2 (and pyxis 0.24.0), NVIDIA's runtime of clusters without Apptainer (issue 57):
# no package registry here has them; their released sources and build script are in the
# workspace's shared/vendor beside the checkout (HARBOR_HPC_CI_VENDOR names another). Off PATH:
# the enroot stage of .ci/run puts it there, the other stages run Apptainer.
part_enroot() {
  local vendor=${HARBOR_HPC_CI_VENDOR:-$(dirname "$REPO_DIR")/shared/vendor}
  if [ -x "$ENROOT_PREFIX/bin/enroot" ] && "$ENROOT_PREFIX/bin/enroot" version 2>/dev/null | grep -qx 4.1.2; then
    PART_NOTE="reused $ENROOT_PREFIX"
    return 0
  fi
  [ -f "$vendor/build.sh" ] || die "no enroot sources: $vendor/build.sh is missing (set HARBOR_HPC_CI_VENDOR)"
  (cd / && bash "$vendor/build.sh" "$ENROOT_PREFIX") >"$LOGS/enroot-build.log" 2>&1 ||
    die "building enroot failed: $(tail -n 5 "$LOGS/enroot-build.log")"
  PART_NOTE="$(tail -n 1 "$LOGS/enroot-build.log")"
}

# ----------------------------------------------------------------------------------------------
# 7d. pyxis in the one-node cluster (issue 57), as on GPU clusters that run jobs in enroot
# containers (`srun --container-image=IMAGE.sqsh`): loaded by plugstack.conf (Debian's includes
# plugstack.conf.d) into srun, sbatch, slurmd and each job step; enroot.conf as such a site sets
# it, the users' containers in folders of their own. The other clusters load no plug-in.
PYXIS_CONF=/etc/slurm/plugstack.conf.d/pyxis.conf
part_pyxis() {
  local line="required $ENROOT_PREFIX/lib/slurm/spank_pyxis.so runtime_path=/run/pyxis" pid i
  local notes=()
  [ -f "$ENROOT_PREFIX/lib/slurm/spank_pyxis.so" ] || die "no pyxis in $ENROOT_PREFIX (part 7c)"
  install -d -m 1777 /var/tmp/enroot-site
  cat >"$ENROOT_PREFIX/etc/enroot/enroot.conf.d/50-site.conf" <<'EOF'
ENROOT_RUNTIME_PATH /var/tmp/enroot-site/runtime-$(id -u)
ENROOT_CACHE_PATH /var/tmp/enroot-site/cache-$(id -u)
ENROOT_DATA_PATH /var/tmp/enroot-site/data-$(id -u)
EOF
  mkdir -p /etc/slurm/plugstack.conf.d
  grep -qsxF 'include /etc/slurm/plugstack.conf.d/*.conf' /etc/slurm/plugstack.conf ||
    echo 'include /etc/slurm/plugstack.conf.d/*.conf' >>/etc/slurm/plugstack.conf
  pid=$(cat /run/slurmd.pid 2>/dev/null || true)
  if [ "$(cat "$PYXIS_CONF" 2>/dev/null)" != "$line" ] ||
    ! tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -q "^PATH=$ENROOT_PREFIX/bin:"; then
    echo "$line" >"$PYXIS_CONF"
    stop_pid /run/slurmd.pid slurmd || true
    start_slurmd
    for ((i = 0; i < 120; i++)); do
      case $(slurm_node_state) in idle | mix | alloc | comp) break ;; esac
      sleep 0.5
    done
    notes+=("loaded, slurmd restarted")
  else
    notes+=("reused")
  fi
  PART_NOTE="${notes[*]} ($PYXIS_CONF)"
}

# ----------------------------------------------------------------------------------------------
# 8. The env file for the tests
part_env() {
  local tmp
  tmp=$(mktemp "$STATE/env.XXXXXX")
  cat >"$tmp" <<EOF
# Written by harbor-hpc's .ci/provision.sh: what the integration tests need.
export HARBOR_HPC_TEST_REGISTRY=localhost:5000
export HARBOR_HPC_TEST_AUTH_REGISTRY=localhost:5001
export HARBOR_HPC_TEST_AUTH_USER=$AUTH_USER
export HARBOR_HPC_TEST_AUTH_PASSWORD=$AUTH_PASSWORD
export HARBOR_HPC_TEST_BASE_IMAGE=$BASE_IMAGE
export HARBOR_HPC_TEST_NOPY_IMAGE=$NOPY_IMAGE
export HARBOR_HPC_TEST_WHEELS=$WHEELS
export HARBOR_HPC_TEST_USER=$TEST_USER
export HARBOR_HPC_TEST_OTHER_USER=$OTHER_USER
export HARBOR_HPC_TEST_NOSUB_USER=$NOSUB_USER
export HARBOR_HPC_TEST_SLURM_PARTITION=debug
export HARBOR_HPC_TEST_EGRESS_HOST=$EGRESS_HOST
export HARBOR_HPC_TEST_MULTI_SLURM_CONF=$MULTI_CONF
export HARBOR_HPC_TEST_LIMITS_SLURM_CONF=$LIMITS_CONF
export HARBOR_HPC_TEST_SHARED_DIR=$SHARED_DIR
export HARBOR_HPC_TEST_MULTI_NODE_TMP=$MULTI_TMP
export HARBOR_HPC_TEST_NODE_TOOL=$NODE_TOOL
export HARBOR_HPC_TEST_NONETNS=$NONETNS
export HARBOR_HPC_TEST_ENROOT_BIN=$ENROOT_PREFIX/bin
export PYTHONPATH=$TRL_SITE
export TRL_EXPERIMENTAL_SILENCE=1
EOF
  chmod 644 "$tmp"
  if cmp -s "$tmp" "$ENV_FILE"; then
    rm -f "$tmp"
    PART_NOTE="unchanged $ENV_FILE"
  else
    mv "$tmp" "$ENV_FILE"
    PART_NOTE="wrote $ENV_FILE"
  fi
}

# ----------------------------------------------------------------------------------------------
log "mirror: $MIRROR; logs: $LOGS"
# Independent of the packages: start at once.
bg_start 5a-apptainer-fetch part_apptainer_fetch
bg_start 7-wheels bg_wheels
bg_start 7b-trl bg_trl
timed "1 apt packages" part_apt
# debootstrap is installed now: build both root file systems while the rest goes on.
bg_start 6a-rootfs-python bg_rootfs_python
bg_start 6b-rootfs-nopython bg_rootfs_nopython
timed "2 docker engine" part_docker
timed "3 registries" part_registries
timed "4 munge+slurm" part_slurm
bg_wait 5a-apptainer-fetch
timed "5b apptainer install" part_apptainer_install
timed "5c test users" part_users
timed "5d egress test host" part_egress_host
timed "5e multi-node slurm" part_multinode
timed "5f slurm with low limits" part_limits
timed "5g enroot" part_enroot
timed "5h pyxis" part_pyxis
bg_wait 6a-rootfs-python
bg_wait 6b-rootfs-nopython
timed "6c base images" part_images
bg_wait 7-wheels
bg_wait 7b-trl
timed "8 env file" part_env
log "$(printf '%-22s %6ss' "total" "$(elapsed "$T_START")")"

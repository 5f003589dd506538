#!/bin/bash
# harbor-hpc's in-container command server for images without python3 (bash only).
#
# Same channel as apptainer_server.py (the container's stdin/stdout, held only by
# the host process), a simpler protocol: the host writes each script to
# $HH_DIR/req/<id>.sh and sends "X <id> <timeout_ms|->"; the script's stdout and
# stderr go to $HH_DIR/out/<id>.out and .err, which the host reads through the
# bind mount, and the server answers "R <id> <exit code> <-|t>" when it ends.
# "K <id>" kills a script's process group, "Q" quits. Slower than the python
# server (one more bash per script, files instead of pipes), never different.
HH_DIR=${1:?usage: apptainer_server.sh HH_DIR WORKDIR [IMAGE_ENV_FILE]}
WORKDIR=${2:-/}
umask 022 # Docker's, whatever the user's (see apptainer_server.py)
mkdir -p "$WORKDIR" && cd "$WORKDIR" || echo "harbor-hpc server: cannot use workdir $WORKDIR" >&2

# As apptainer_server.py: descriptors on the tmpfs mounts for the host's memory watchdog, and
# the environment a Docker container has (the image's ENV, no Apptainer variables or prompt).
# Docker's /dev, a tmpfs of 64 MB (see apptainer_server.py), where the image has a mount.
mount -o remount,size=65536k /dev >/dev/null 2>&1
# enroot's lock file, bound into the root it starts: no Docker container has it.
if grep -q ' /.lock ' /proc/self/mountinfo 2>/dev/null && umount /.lock 2>/dev/null; then
    rm -f /.lock
fi
exec 61</dev/shm 62</dev
for name in $(compgen -e); do
    case $name in APPTAINER_* | SINGULARITY_* | PS1 | PROMPT_COMMAND | LANG | TERM | SHELL | USER) unset "$name" ;; esac
done
case ":$LD_LIBRARY_PATH:" in
*:/.singularity.d/libs:*)
    libs=":$LD_LIBRARY_PATH:"
    libs=${libs//:\/.singularity.d\/libs:/:}
    libs=${libs#:}
    libs=${libs%:}
    if [ -n "$libs" ]; then export LD_LIBRARY_PATH=$libs; else unset LD_LIBRARY_PATH; fi
    ;;
esac
if [ -n "${3:-}" ] && [ -r "$3" ]; then
    while IFS= read -r -d '' item; do export "$item"; done <"$3"
fi
# Once more with that environment from the start: /proc/PID/environ (what a task reads of this
# process) is what it was started with; bash passes on only what it exports now.
if [ "${4:-}" != clean ]; then exec "$BASH" "$0" "$HH_DIR" "$WORKDIR" "${3:-}" clean; fi

# Keep the channel on fds 3/4 (not inherited by scripts), and run each script
# as a job of its own so that a kill reaches its whole process group.
exec 3<&0 4>&1 </dev/null >/dev/null
set -m

# The container's first process (Apptainer's --no-init), as a Docker container's init: the
# kernel drops a signal sent to it from inside the container unless it handles that signal, and
# bash handles these; a trap that does nothing keeps a task's `kill -TERM 1` from ending it
# (and, unlike an ignored signal, is not inherited by the scripts).
trap : INT TERM HUP QUIT USR1 USR2 ALRM

declare -A pids
run_job() {
    local watcher=
    if [ "$2" != - ]; then
        # At the deadline the watcher answers for the job, then kills the job's whole
        # process group (itself and this function included).
        (
            sleep "$(($2 / 1000)).$(printf '%03d' $(($2 % 1000)))" 4>&-
            printf 'R %s 137 t\n' "$1" >&4
            kill -KILL 0
        ) &
        watcher=$!
    fi
    # The script's shell notes its pid and, as it exits, its status: where a `kill -9 -1` of
    # the script's has ended this function (every process but the container's first and the
    # killer), the loop below answers for the job from them.
    # shellcheck disable=SC2016
    bash -c '__hh_out=$1; shift; echo $$ >"$__hh_out.pid"
        trap '\''echo $? >"$__hh_out.status"'\'' EXIT; . "$0"' \
        "$HH_DIR/req/$1.sh" "$HH_DIR/out/$1" >"$HH_DIR/out/$1.out" 2>"$HH_DIR/out/$1.err" </dev/null 4>&-
    local status=$?
    [ -n "$watcher" ] && kill "$watcher" 2>/dev/null
    printf 'R %s %s -\n' "$1" "$status" >&4
}

# Jobs whose run_job was killed (not by us: a script's `kill -9 -1`) answered nothing: once the
# script's shell is gone too, answer with the status it noted (137: none, it was killed itself).
declare -A killed
answer_orphans() {
    local id pid
    for id in "${!pids[@]}"; do
        if [ -z "${killed[$id]}" ]; then
            kill -0 "${pids[$id]}" 2>/dev/null && continue
            wait "${pids[$id]}"
            if [ $? -le 128 ]; then # it ended as it should, and answered
                unset "pids[$id]"
                continue
            fi
            killed[$id]=1
        fi
        pid=$(cat "$HH_DIR/out/$id.pid" 2>/dev/null)
        [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && continue
        printf 'R %s %s -\n' "$id" "$(cat "$HH_DIR/out/$id.status" 2>/dev/null || echo 137)" >&4
        unset "pids[$id]" "killed[$id]"
    done
}

printf 'H sh %s\n' "$(id -u)" >&4
line=
while true; do
    # Once a second, the jobs no one answered; a read that timed out mid-line keeps what it
    # read (bash saves it), and the rest of the line follows.
    IFS= read -t 1 -r part <&3
    case $? in
    0) ;;
    1) break ;; # the channel closed
    *)
        line+=$part
        answer_orphans
        continue
        ;;
    esac
    IFS=' ' read -r tag id timeout_ms <<<"$line$part"
    line=
    case $tag in
    X)
        run_job "$id" "$timeout_ms" 3<&- &
        pids[$id]=$!
        ;;
    K) [ -n "${pids[$id]}" ] && kill -KILL -- "-${pids[$id]}" 2>/dev/null ;;
    Q) break ;;
    esac
done
kill -KILL -- "${pids[@]/#/-}" 2>/dev/null

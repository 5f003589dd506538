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
exec 61</dev/shm 62</dev
for name in $(compgen -e); do
    case $name in APPTAINER_* | SINGULARITY_* | PS1 | PROMPT_COMMAND | LANG) unset "$name" ;; esac
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

# Keep the channel on fds 3/4 (not inherited by scripts), and run each script
# as a job of its own so that a kill reaches its whole process group.
exec 3<&0 4>&1 </dev/null >/dev/null
set -m

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
    bash "$HH_DIR/req/$1.sh" >"$HH_DIR/out/$1.out" 2>"$HH_DIR/out/$1.err" </dev/null 4>&-
    local status=$?
    [ -n "$watcher" ] && kill "$watcher" 2>/dev/null
    printf 'R %s %s -\n' "$1" "$status" >&4
}

printf 'H sh %s\n' "$(id -u)" >&4
while IFS=' ' read -r tag id timeout_ms <&3; do
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

"""The shell side of the sbatch script: quoting values into it, and its fixed bash parts.

``sh_quote`` makes one bash word of any user value (printable ASCII in single
quotes, anything else as ``$'...'`` with ``\\xHH`` escapes), so each value is
one line and reaches the program byte for byte. ``dq_with_tokens`` turns a
planner value holding node tokens (``@DLSCHED_NODE_<n>@``) and port tokens
(``@DLSCHED_PORT_<k>@``) into a double-quoted word naming the allocation's
node ``n`` and the job's rendezvous port ``k`` at run time (and ``@DLSCHED_DIR@`` the attempt
directory's absolute path, ``DIR_TOKEN``).

The constants below are the script's fixed functions (see ``render``): the
success rule both launch styles share, the two ways of hearing of the
processes' exits, the port picker, the log indexer and the script's end.
``render`` fills in the job's parts; nothing here depends on a job.
"""

from __future__ import annotations

import re
import shlex

NODE_TOKEN = "@DLSCHED_NODE_{}@"
PORT_TOKEN = "@DLSCHED_PORT_{}@"
#: The attempt directory's absolute path (the script makes ``DLSCHED_DIR`` absolute first thing).
DIR_TOKEN = "@DLSCHED_DIR@"
_TOKEN_RE = re.compile(r"@DLSCHED_(?:(NODE|PORT)_(\d+)|DIR)@")
_ARRAY = {"NODE": "DLSCHED_NODES", "PORT": "DLSCHED_PORTS"}
_PRINTABLE = re.compile(r"^[\x20-\x7e]*\Z")


def sh_quote(value: str) -> str:
    """One shell word that bash reads back as exactly ``value``, on one line."""
    if _PRINTABLE.match(value):
        return shlex.quote(value)
    out = []
    for b in value.encode("utf-8", "surrogatepass"):
        c = chr(b)
        if c in "\\'":
            out.append("\\" + c)
        elif 0x20 <= b <= 0x7E:
            out.append(c)
        else:
            out.append(f"\\x{b:02x}")
    return "$'" + "".join(out) + "'"


def dq_with_tokens(value: str) -> str:
    """A planner value with node and port tokens -> a double-quoted word naming the nodes
    (``${DLSCHED_NODES[n]}``) and the ports (``${DLSCHED_PORTS[k]}``) at run time."""
    parts = []
    pos = 0
    for m in _TOKEN_RE.finditer(value):
        parts.append(_dq_literal(value[pos:m.start()]))
        parts.append("${" + _ARRAY[m.group(1)] + "[" + m.group(2) + "]}" if m.group(1) else "${DLSCHED_DIR}")
        pos = m.end()
    parts.append(_dq_literal(value[pos:]))
    return '"' + "".join(parts) + '"'


def _dq_literal(s: str) -> str:
    if not _PRINTABLE.match(s):
        raise ValueError("planner values are printable ASCII")
    return re.sub(r'([\\$`"])', r"\\\1", s)


#: The file in the attempt directory the driver writes before a stop's SIGTERM to the steps: the
#: stop is dlsched's, its grace and SIGKILL the driver's (``dlsched_term`` then signals nothing).
STOP_MARK = "stopping"

#: The file in the attempt directory where the script records each process's end (``exits``
#: parses it): a first line ``labels <label> ...`` (written when the job starts; an MPI job's
#: second line, ``hosts <label> ...``, names the replicas that only host ranks), then one
#: ``end <label> <status> exit|stop|halt`` line per process in the order the script heard of them:
#: ``exit`` when it ended before the job was decided (the first such non-zero one decided a
#: failure), ``stop`` when it ended after, stopped by the success rule or with the step, ``halt``
#: when it ended after dlsched's stop reached the job (the ``STOP_MARK`` is there).
EXITS = "exits"

#: The success rule both launch styles share: ``dlsched_decide LABEL STATUS DECIDES``
#: hears of each process's exit once; the first failure ends the job with its code, the
#: deciding processes' success ends it with 0 (``DLSCHED_DECIDES`` is filled by then).
#: ``dlsched_record LABEL STATUS`` appends the process's end to ``EXITS`` first.
SUCCESS_RULE = r"""
# the success rule: the first failure ends the job; the deciding processes' success ends it too
dlsched_left=${#DLSCHED_DECIDES[@]}
dlsched_rc=0
dlsched_done=0
dlsched_record() {
  local how=exit
  if [ -e "$DLSCHED_DIR/@STOP_MARK@" ]; then how=halt; elif [ "$dlsched_done" != 0 ]; then how=stop; fi
  printf 'end %s %s %s\n' "$1" "$2" "$how" >>"$DLSCHED_DIR/exits"
}
dlsched_decide() {
  [ "$dlsched_done" = 0 ] || return 0
  if [ "$2" != 0 ]; then
    echo "dlsched: $1 exited with code $2; stopping the rest" >&2
    dlsched_rc=$2
    dlsched_done=1
  elif [ -n "$3" ]; then
    dlsched_left=$((dlsched_left - 1))
    [ "$dlsched_left" -gt 0 ] || dlsched_done=1
  fi
}
# stopping the rest (dlsched_term SRUN_PID...): SIGTERM to every step's tasks through Slurm (an srun
# sent SIGTERM itself SIGKILLs its tasks at once), then, once DLSCHED_GRACE is over, SIGTERM to the
# sruns still running, which SIGKILL their tasks; nothing while dlsched stops the job
dlsched_timer=""
dlsched_term() {
  local grace=$DLSCHED_GRACE
  [ ! -e "$DLSCHED_DIR/@STOP_MARK@" ] || return 0  # dlsched's stop: its SIGTERM went out, its SIGKILL follows
  [ -n "${SLURM_JOB_ID:-}" ] && scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || grace=0
  [ "$#" -gt 0 ] || return 0
  ( sleep "$grace"; kill -TERM "$@" 2>/dev/null ) &
  dlsched_timer=$!
}
""".replace("@STOP_MARK@", STOP_MARK)

#: Steps in background subshells: their exits, from ``wait -n``. A process that ended while bash
#: waited for another is no job any more, and ``wait -n`` with its pid fails ("no such job", the
#: ``-p`` variable unset): its status comes from a plain ``wait`` on that pid (bash keeps it).
WAIT_LOOP = r"""while [ "${#DLSCHED_NAME[@]}" -gt 0 ]; do
  dlsched_pid=""
  wait -n -p dlsched_pid "${!DLSCHED_NAME[@]}" 2>/dev/null
  dlsched_status=$?
  if [ -z "${dlsched_pid:-}" ]; then  # "no such job": one ended while bash waited for another; by its pid
    dlsched_pid=""
    for dlsched_p in "${!DLSCHED_NAME[@]}"; do
      kill -0 "$dlsched_p" 2>/dev/null || { dlsched_pid=$dlsched_p; break; }
    done
    [ -n "$dlsched_pid" ] || break
    wait "$dlsched_pid"
    dlsched_status=$?
  fi
  [ -n "${DLSCHED_NAME[$dlsched_pid]:-}" ] || continue
  dlsched_label=${DLSCHED_NAME[$dlsched_pid]}
  unset "DLSCHED_NAME[$dlsched_pid]"
  printf '%s\n' "$dlsched_status" >"$DLSCHED_DIR/$dlsched_label.exit"
  dlsched_record "$dlsched_label" "$dlsched_status"
  [ "$dlsched_done" = 0 ] || continue
  dlsched_decide "$dlsched_label" "$dlsched_status" "${DLSCHED_DECIDES[$dlsched_pid]:-}"
  [ "$dlsched_done" = 0 ] || dlsched_term "${!DLSCHED_NAME[@]}"
done
[ -z "$dlsched_timer" ] || kill "$dlsched_timer" 2>/dev/null
"""

#: PS-Worker's one multi-prog step: its tasks' exits, from the exit files their wrappers write.
TASKS_LOOP = r"""dlsched_srun_status=""
declare -A DLSCHED_SEEN=()
dlsched_check() {{
  local label status
  for label in "${{DLSCHED_TASKS[@]}}"; do
    [ -z "${{DLSCHED_SEEN[$label]:-}}" ] && [ -e "$DLSCHED_DIR/$label.exit" ] || continue
    DLSCHED_SEEN[$label]=1
    read -r status <"$DLSCHED_DIR/$label.exit" || status=1
    dlsched_record "$label" "$status"
    dlsched_decide "$label" "$status" "${{DLSCHED_DECIDES[$label]:-}}"
  done
}}
while :; do
  dlsched_check
  [ "$dlsched_done" = 0 ] && [ -z "$dlsched_srun_status" ] || break
  sleep {interval} &
  dlsched_sleep=$!
  dlsched_pid=""
  wait -n -p dlsched_pid "$DLSCHED_SRUN" "$dlsched_sleep"
  dlsched_status=$?
  if [ "$dlsched_pid" = "$DLSCHED_SRUN" ]; then
    dlsched_srun_status=$dlsched_status
    kill "$dlsched_sleep" 2>/dev/null
  fi
done
if [ -z "$dlsched_srun_status" ]; then
  dlsched_term "$DLSCHED_SRUN"
  wait "$DLSCHED_SRUN"
  dlsched_srun_status=$?
  kill "$dlsched_timer" 2>/dev/null
fi
if [ "$dlsched_done" = 0 ]; then  # the step ended with no task's word on it (srun could not launch)
  echo "dlsched: the step ended with status $dlsched_srun_status before the tasks decided" >&2
  dlsched_rc=$dlsched_srun_status
  [ "$dlsched_rc" != 0 ] || dlsched_rc=1
fi
for dlsched_label in "${{DLSCHED_TASKS[@]}}"; do  # the tasks heard of only now: stopped with the step
  [ -z "${{DLSCHED_SEEN[$dlsched_label]:-}}" ] || continue
  [ -e "$DLSCHED_DIR/$dlsched_label.exit" ] || printf '%s\n' "$dlsched_srun_status" >"$DLSCHED_DIR/$dlsched_label.exit"
  read -r dlsched_status <"$DLSCHED_DIR/$dlsched_label.exit" || dlsched_status=$dlsched_srun_status
  dlsched_record "$dlsched_label" "$dlsched_status"
done
"""

#: The rendezvous ports (``DLSCHED_PORTS``), picked at run time by the batch script (on the
#: allocation's first node): ``dlsched_port NODE`` takes the next port of the job's block (it starts at
#: ``lo + (SLURM_JOB_ID * stride) % span``, so concurrent jobs start ``stride`` ports apart) that nothing
#: listens on at node ``NODE`` (bash's /dev/tcp, bounded by ``timeout``): on this node, a connect to
#: 127.0.0.1, where a connect that hangs is a listener with a full queue (taken); on another node, a connect
#: to its name, where one that hangs is a firewall's drop (free, or every port would be). Ports taken are
#: never given twice.
PORT_PICKER = r"""# rendezvous ports: the job's block from its Slurm job id, each port one nothing listens on where it will
DLSCHED_PORTS=()
dlsched_port_next=$(( (${{SLURM_JOB_ID:-0}} * {stride}) % {span} ))
dlsched_port() {{
  local p tries=0
  while [ "$tries" -lt {span} ]; do
    p=$(( {lo} + dlsched_port_next ))
    dlsched_port_next=$(( (dlsched_port_next + 1) % {span} ))
    tries=$((tries + 1))
    if [ "$1" = 0 ]; then
      timeout 2 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$0"' "$p" 2>/dev/null
      case $? in 0|124) continue;; esac
    else
      timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "${{DLSCHED_NODES[$1]}}" "$p" 2>/dev/null && continue
    fi
    DLSCHED_PORTS+=("$p")
    return 0
  done
  echo "dlsched: no free port in {lo}-{hi} on ${{DLSCHED_NODES[$1]}}" >&2
  return 1
}}"""

#: MPI: ``dlsched_merge STREAM`` copies whole lines from every rank's ``STREAM`` file that mpirun
#: writes (``mpi/<job>/rank.<r>/STREAM``) to its stdout as they come, keeping each file's partial
#: last line until its newline arrives; once ``mpi.done`` exists (mpirun ended) one last pass, and
#: a final line without a newline gets one. One merger per stream is the only writer of it, so
#: ranks never share a line. A file stays open between passes while descriptors last (the soft
#: ``ulimit -n`` is raised to the hard one; those already open and 32 more are left alone); past
#: that, a file is read by offset: one ``stat`` per pass for all such files, and for one that grew,
#: the new bytes (``tail -c`` | ``head -c``); the offset moves by the bytes read, so a read that
#: could not run is made again next pass. A job with more ranks than descriptors loses no output.
MPI_MERGE = r"""# MPI: each rank's output, from its own files, to the launcher's log a whole line at a time
dlsched_merge() {
  local f line last=0 n s got LC_ALL=C
  local -A fd=() part=() off=() size=()
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || :
  local spare open=0
  spare=$(ulimit -n)
  [ "$spare" != unlimited ] || spare=1048576
  spare=$(( spare - 32 - $(ls /proc/$BASHPID/fd 2>/dev/null | wc -l) ))
  while :; do
    [ ! -e "$DLSCHED_DIR/mpi.done" ] || last=1
    size=()
    if [ "${#off[@]}" -gt 0 ]; then
      while read -r s f; do
        size[$f]=$s
      done < <(printf '%s\0' "${!off[@]}" | xargs -0 stat -c '%s %n' -- 2>/dev/null)
    fi
    for f in "$DLSCHED_DIR"/mpi/*/rank.*/"$1"; do
      [ -f "$f" ] || continue
      if [ -z "${fd[$f]:-}" ] && [ -z "${off[$f]:-}" ]; then
        if [ "$open" -lt "$spare" ] && { exec {n}<"$f"; } 2>/dev/null; then
          fd[$f]=$n
          open=$((open + 1))
        else
          off[$f]=0  # no descriptor for it: read by offset
          size[$f]=$(stat -c %s -- "$f" 2>/dev/null) || size[$f]=0
        fi
      fi
      line=""
      if [ -n "${fd[$f]:-}" ]; then
        while IFS= read -r -u "${fd[$f]}" line; do
          printf '%s\n' "${part[$f]:-}$line"
          part[$f]=""
        done
      elif s=${size[$f]:-0} && [ "$s" -gt "${off[$f]}" ]; then
        got=0
        while IFS= read -r line; do
          got=$(( got + ${#line} + 1 ))
          printf '%s\n' "${part[$f]:-}$line"
          part[$f]=""
        done < <(tail -c "+$(( ${off[$f]} + 1 ))" -- "$f" 2>/dev/null | head -c "$(( s - ${off[$f]} ))" 2>/dev/null)
        off[$f]=$(( ${off[$f]} + got + ${#line} ))
      fi
      part[$f]+=$line
    done
    [ "$last" = 0 ] || break
    sleep 0.1
  done
  for f in "${!part[@]}"; do
    [ -z "${part[$f]}" ] || printf '%s\n' "${part[$f]}"
  done
}"""

SCRIPT_END = r"""kill "$DLSCHED_INDEXER" 2>/dev/null
dlsched_index once
exit "$dlsched_rc"
"""

#: The log index: every ``INDEX_INTERVAL`` seconds, the size of each log file that grew,
#: with the time it was seen (``<unix seconds.micros> <size> <name>``): what dates a line.
INDEXER = r"""# the log index: when each log file reached each size (dates lines for since_time)
dlsched_index() {{
  local LC_ALL=C
  local -A seen=()
  local sizes s f t
  while :; do
    sizes=$(cd -- "$DLSCHED_DIR" && stat -c '%s %n' -- *.stdout *.stderr 2>/dev/null)
    t=${{EPOCHREALTIME:-$(date +%s.%N)}}
    while read -r s f; do
      [ -n "$f" ] && [ "${{seen[$f]:-0}}" != "$s" ] || continue
      seen[$f]=$s
      printf '%s %s %s\n' "$t" "$s" "$f"
    done <<<"$sizes"
    [ "${{1:-}}" != once ] || return 0
    sleep {interval}
  done >>"$DLSCHED_DIR/{index}"
}}
dlsched_index </dev/null &
DLSCHED_INDEXER=$!"""

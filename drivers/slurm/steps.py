"""The sbatch script's steps: how each process of the plan is started, and how its end is heard.

``render.emit`` writes the header and prologue; this module writes what runs
(see ``render``'s docstring for the whole script):

- ``srun_steps`` (every mode but PS-Worker): one ``srun`` step per process in
  a background subshell, the success rule waiting for them one by one
  (``wait -n``). The MPI launcher runs in the batch script itself
  (``mpi_launcher``).
- ``multi_prog`` (PS-Worker): every task in one ``srun --multi-prog`` step of
  per-task wrappers that write their own exit files.

Both record each process's end in the attempt's ``exits`` file (``shell.SUCCESS_RULE``'s
``dlsched_record``; read back by ``exits``), so the driver reports each replica's truth.

MPI output. Ranks on one node share mpirun's output pipe, and Open MPI
forwards whatever each rank wrote, so two ranks writing partial lines
interleave within a line ("rankrank 0 of 2"). The launcher runs ``mpirun
--output-filename <attempt dir>/mpi:nocopy``: Open MPI writes each rank's
stdout and stderr to files of their own (``mpi/<job>/rank.<r>/stdout``) and
nothing to its own output; ``shell.MPI_MERGE`` (one process per stream, the
only writer of the launcher's log besides mpirun's own messages) copies whole
lines from those files into ``launcher-0.stdout`` / ``.stderr`` as they come,
and, once mpirun has ended, the last of them (a final line without a newline
gets one). So a line in the launcher's log is always one rank's whole line.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dlsched.errors import InvalidArgument
from dlsched.spec_rules import ENV_NAME_RE
from drivers.common import planner
from drivers.common.base import JobSpec, LogStream, RunMode
from drivers.slurm import shell
from drivers.slurm.shell import sh_quote

if TYPE_CHECKING:
    from drivers.slurm.render import Layout

#: PS-Worker: the name of the one ``--multi-prog`` step, and how often the script reads the tasks' exit files.
TASKS_STEP = "dlsched-tasks"
TASK_CHECK_INTERVAL = 0.5
#: MPI: the directory (in the attempt directory) mpirun writes each rank's output to, and the
#: backend flags the planner puts in the mpirun command (``mpirun_args``); the token becomes the
#: directory's absolute path with Open MPI's ``nocopy``. ``--noprefix``: mpirun is run by its
#: absolute path, which Open MPI takes for ``--prefix`` (its lib/ and bin/ put before the
#: user's LD_LIBRARY_PATH and PATH in every rank), as the local driver runs it.
MPI_OUTPUT_DIR = "mpi"
MPI_OUTPUT_TOKEN = "@DLSCHED_MPI_OUTPUT@"
MPI_ARGS = ("--noprefix", "--output-filename", MPI_OUTPUT_TOKEN)


@dataclass(frozen=True)
class StepFiles:
    """Where one process's output goes."""

    role: str
    index: int
    stdout: str
    stderr: str

    def log_path(self, stream: LogStream) -> str:
        return self.stdout if stream is LogStream.STDOUT else self.stderr


def labels(plan: planner.JobPlan) -> list[str]:
    """``<role>-<index>`` of every process the script starts (MPI workers are hosts only)."""
    return [f"{p.role}-{p.slot_index}" for p in plan.processes if not p.placeholder]


def srun_steps(lay: Layout, steps: list[StepFiles]) -> list[str]:
    """Every mode but PS-Worker: an ``srun`` step per process (the MPI launcher runs in
    the batch script itself), each in a background subshell; the success rule waits
    for them one by one (``wait -n``) and writes their exit files."""
    spec, plan, adir = lay.job.spec, lay.plan, lay.dir
    decisive = plan.success.decisive_roles
    h: list[str] = []
    for p in plan.processes:
        if p.placeholder:
            continue
        label = f"{p.role}-{p.slot_index}"
        files = StepFiles(p.role, p.slot_index, f"{adir}/{label}.stdout", f"{adir}/{label}.stderr")
        steps.append(files)
        h.append(f"# {label}: rank {p.rank}")
        h.append("(")
        h += exports(spec, p, "  ", user=False)
        argv = " ".join(sh_quote(a) for a in p.argv)
        if spec.run_mode is RunMode.MPI and p.role == "launcher":
            h += mpi_launcher(p, exports(spec, p, "  ", user=True))
        else:
            node = lay.node_of[(p.role, p.replica_index)]
            opts = [f"--job-name={label}", "--nodes=1", "--ntasks=1", f"--relative={node}",
                    f"--cpus-per-task={lay.cpus_per_task}", "--overlap", "--export=ALL", "--kill-on-bad-exit=1"]
            if p.working_dir:
                # srun runs the step in /tmp when --chdir fails (slurmstepd's fallback): the
                # directory is checked first, as the launcher and wrapper paths' `cd` does; then
                # --chdir names it absolute (a relative one would be taken from there, twice).
                opts.append('--chdir="$PWD"')
                h.append(f"  cd -- {sh_quote(p.working_dir)} || exit 126")
            assign = " ".join(user_assignments(spec, p))
            if ":" in p.argv or "=" in p.argv[0]:
                # srun splits its command line at a lone ":" into heterogeneous components,
                # after "--" too: the rest would be read as srun's options and a second
                # program (and env would take a program named a=b for a variable). Such an
                # argv reaches the step in the environment instead.
                h += argv_by_env(p.argv, "  ")
                argv = " ".join(sh_quote(a) for a in ARGV_PROGRAM)
            # The user's variables reach the program only (``env -- NAME=VALUE ... argv`` in the
            # step): srun read SLURM_*/SRUN_* ones as its own options (SLURM_JOB_ID: another
            # job's allocation) and was looked up on the user's PATH. Through env always: a
            # program that cannot start exits 127 (not found) or 126 (not executable), as on
            # every backend (slurmstepd's execve gave its errno, 2 or 13).
            h.append(f"  exec srun {' '.join(opts)} -- {ENV_PROGRAM} -- {f'{assign} ' if assign else ''}{argv}")
        h.append(f') >"$DLSCHED_DIR/{label}.stdout" 2>"$DLSCHED_DIR/{label}.stderr" </dev/null &')
        h.append(f"DLSCHED_NAME[$!]={label}")
        if p.role in decisive:
            h.append("DLSCHED_DECIDES[$!]=1")
    h += (shell.SUCCESS_RULE + shell.WAIT_LOOP).splitlines()
    return h


#: A step whose argv srun would misread: the fixed program it runs instead, which takes the
#: argv back from ``ARGV_ENV`` (``shlex.join``-ed) as MPI's ranks do theirs.
ARGV_ENV = "DLSCHED_ARGV"
ARGV_PROGRAM = ("/bin/sh", "-c", planner.MPI_RANK_SCRIPT.replace(planner.MPI_ARGV_ENV, ARGV_ENV))


def argv_by_env(argv: Sequence[str], indent: str) -> list[str]:
    joined = shlex.join(argv)
    if len(joined.encode()) > planner.MPI_ARGV_MAX_BYTES:  # one environment string's limit
        raise InvalidArgument.for_field(
            "spec.replica_groups", f"a command line with a lone ':' is at most {planner.MPI_ARGV_MAX_BYTES} "
                                   "bytes on Slurm (it reaches the step in the environment)")
    return [f"{indent}export {ARGV_ENV}={sh_quote(joined)}"]


#: What runs a step's program with the user's variables (coreutils' env, on every node).
ENV_PROGRAM = "/usr/bin/env"


def mpi_launcher(p: planner.ProcessLaunch, user_exports: list[str]) -> list[str]:
    """The launcher's subshell body: the mergers and ``mpirun``'s path (both before the user's
    variables are exported: a PATH of the user's must not change the commands they run; the
    mergers stop on the done mark its EXIT trap also writes), then ``mpirun``
    writing each rank's output to its own files (``MPI_ARGS``: ``--output-filename DIR:nocopy``,
    an absolute path: mpirun runs in the working directory), waited for once (SIGTERM ignored
    here: Slurm signals mpirun itself, with every process of the batch step); its status once
    the mergers are done."""
    cd = f"cd -- {sh_quote(p.working_dir)} || exit 126; " if p.working_dir else ""
    argv = " ".join('"$dlsched_mpirun_bin"' if i == 0 and a == planner.MPIRUN
                    else f'"$DLSCHED_DIR/{MPI_OUTPUT_DIR}:nocopy"' if a == MPI_OUTPUT_TOKEN
                    else shell.dq_with_tokens(a) if shell.DIR_TOKEN in a else sh_quote(a)
                    for i, a in enumerate(p.argv))
    return [
        # the mergers end on this mark, whichever way this subshell ends
        f"  trap ': >\"$DLSCHED_DIR/{MPI_OUTPUT_DIR}.done\"' EXIT",
        "  dlsched_merge stdout &",
        "  dlsched_merge stderr >&2 &",
        # mpirun as the cluster's PATH finds it, not the user's
        "  dlsched_mpirun_bin=$(command -v mpirun) || dlsched_mpirun_bin=mpirun",
        *user_exports,
        f"  ( {cd}exec -- {argv} ) &",
        "  dlsched_mpirun=$!",
        # SIGTERM reaches mpirun as it reaches every process of the batch step (Slurm signals the
        # step's processes); ignored here from now on (mpirun, started, keeps its own): a trap cuts
        # the wait short, and bash 5.2 loses the status of a child waited for again after that (-1)
        "  trap '' TERM",
        '  wait "$dlsched_mpirun"',
        "  dlsched_status=$?",
        f'  : >"$DLSCHED_DIR/{MPI_OUTPUT_DIR}.done"',
        "  wait",
        '  exit "$dlsched_status"',
    ]


def exports(spec: JobSpec, p: planner.ProcessLaunch, indent: str, user: bool | None = None) -> list[str]:
    """``export`` lines of one process: the user's values quoted, the planner's with node names
    (``user``: only the user's, or only the planner's)."""
    user_env = _group_env(spec, p.role)
    out = []
    for k, v in p.env.items():
        if not ENV_NAME_RE.match(k):
            raise InvalidArgument.for_field("spec.replica_groups.env", f"bad variable name {k!r}")
        if user is not None and (k in user_env) != user:
            continue
        val = sh_quote(v) if k in user_env or k == planner.MPI_ARGV_ENV else shell.dq_with_tokens(v)  # user data
        out.append(f"{indent}export {k}={val}")
    return out


def user_assignments(spec: JobSpec, p: planner.ProcessLaunch) -> list[str]:
    """The user's variables of one process as ``NAME=VALUE`` words (quoted) for ``env``."""
    user_env = _group_env(spec, p.role)
    out = []
    for k, v in p.env.items():
        if k in user_env:
            if not ENV_NAME_RE.match(k):
                raise InvalidArgument.for_field("spec.replica_groups.env", f"bad variable name {k!r}")
            out.append(sh_quote(f"{k}={v}"))
    return out


def multi_prog(lay: Layout, steps: list[StepFiles]) -> list[str]:
    """PS-Worker: every task in one ``srun --multi-prog`` step (one step launch for
    the whole job, where a step per task costs slurmctld one launch each).

    The batch script writes, per task ``t``, a wrapper ``task-<t>.sh`` (a quoted
    heredoc: nothing in it expands while it is written) that exports the task's
    variables (``TF_CONFIG`` names the nodes and ports through ``DLSCHED_NODE_LIST``
    and ``DLSCHED_PORT_LIST``, exported as strings: arrays do not export), sends its
    output to ``<role>-<index>.*``, runs the quoted argv and writes ``<role>-<index>.exit``. The multi-prog file
    names only the wrappers, so srun's own parsing of it (which keeps quotes
    literally) never sees a user value; ``SLURM_HOSTFILE`` with
    ``--distribution=arbitrary`` puts task ``t`` on its node. The success rule
    watches the exit files (every ``TASK_CHECK_INTERVAL`` s, and at once when
    the step ends): the first failure, or every deciding task's success, stops
    the step. A task stopped that way gets srun's exit status in its exit file."""
    spec, plan, adir, node_of = lay.job.spec, lay.plan, lay.dir, lay.node_of
    procs = [p for p in plan.processes if not p.placeholder]
    h = [
        f"# {len(procs)} task(s) in one step: srun --multi-prog runs task t's wrapper {adir}/task-t.sh",
        'export DLSCHED_DIR DLSCHED_NODE_LIST="${DLSCHED_NODES[*]}" DLSCHED_PORT_LIST="${DLSCHED_PORTS[*]}"',
        "{",
    ]
    for p in procs:
        h.append(f'  printf \'%s\\n\' "${{DLSCHED_NODES[{node_of[(p.role, p.replica_index)]}]}}"')
    h.append('} >"$DLSCHED_DIR/tasks.hosts"')
    names = []
    for t, p in enumerate(procs):
        label = f"{p.role}-{p.slot_index}"
        names.append(label)
        steps.append(StepFiles(p.role, p.slot_index, f"{adir}/{label}.stdout", f"{adir}/{label}.stderr"))
        body = [f"# {label}: rank {p.rank}", 'read -r -a DLSCHED_NODES <<<"$DLSCHED_NODE_LIST"',
                'read -r -a DLSCHED_PORTS <<<"$DLSCHED_PORT_LIST"']
        argv = " ".join(sh_quote(a) for a in p.argv)
        cd = f"cd -- {sh_quote(p.working_dir)} || exit 126; " if p.working_dir else ""
        # The variables in the program's subshell only: the wrapper's own commands (mv) keep
        # the step's PATH (a user's PATH without coreutils left the task's end unheard of).
        # The wrapper outlives a SIGTERM (ignored from before the program starts, which gets the
        # default back: the step's signal reaches the program itself) and waits for the program:
        # had it died of it, a program that takes its time or ignores the signal was orphaned, out
        # of the step's reach (SIGKILL included). Ignored, not trapped: a trap cuts the wait short,
        # and bash 5.2 loses the status of a child waited for again after that (-1).
        body += ["trap '' TERM", "(", "  trap - TERM", *exports(spec, p, "  "), f"  {cd}exec -- {argv}",
                 f') >"$DLSCHED_DIR/{label}.stdout" 2>"$DLSCHED_DIR/{label}.stderr" </dev/null &',
                 "dlsched_child=$!",
                 'wait "$dlsched_child"',
                 "dlsched_status=$?",
                 f'printf \'%s\\n\' "$dlsched_status" >"$DLSCHED_DIR/{label}.exit.new"',
                 f'mv -f -- "$DLSCHED_DIR/{label}.exit.new" "$DLSCHED_DIR/{label}.exit"',
                 'exit "$dlsched_status"']
        end = f"DLSCHED_TASK_{t}_END"
        # Every value is quoted onto one line (sh_quote), so no line can end the heredoc early;
        # checked all the same, line by line, since a user value that did would run in the script.
        if any(line == end for b in body for line in b.split("\n")):
            raise ValueError("a wrapper line equals its heredoc delimiter")
        h.append(f"cat >\"$DLSCHED_DIR/task-{t}.sh\" <<'{end}'")
        h += body
        h.append(end)
    h.append(f"printf '%s\\n' '* bash {adir}/task-%t.sh' >\"$DLSCHED_DIR/tasks.conf\"")
    opts = ["--job-name=" + TASKS_STEP, f"--ntasks={len(procs)}", "--distribution=arbitrary",
            f"--cpus-per-task={lay.cpus_per_task}", "--overlap", "--export=ALL"]
    h.append(f'SLURM_HOSTFILE="$DLSCHED_DIR/tasks.hosts" srun {" ".join(opts)} '
             f'--multi-prog {adir}/tasks.conf </dev/null &')
    h.append("DLSCHED_SRUN=$!")
    h.append("DLSCHED_TASKS=(" + " ".join(names) + ")")
    h += [f"DLSCHED_DECIDES[{lb}]=1" for lb, p in zip(names, procs, strict=True)
          if p.role in plan.success.decisive_roles]
    h += (shell.SUCCESS_RULE + shell.TASKS_LOOP.format(interval=TASK_CHECK_INTERVAL)).splitlines()
    return h


def _group_env(spec: JobSpec, role: str) -> Mapping[str, str]:
    for g in spec.replica_groups:
        if g.role == role:
            return g.env
    return {}

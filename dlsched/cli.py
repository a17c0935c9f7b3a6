"""The ``dlsched`` command line.

``dlsched [--server H:P] [--cluster-manager H:P] [-o table|json|yaml] COMMAND``

Jobs: ``submit``, ``get``, ``list``, ``logs``, ``stop``, ``delete``,
``watch``, ``usage``. Clusters: ``cluster add|get|list|update|remove|watch``.
The local stack: ``up``. Every command talks to the services through
``dlsched.client``; errors print ``error: CODE REASON: message`` (plus the
field violations) on stderr and exit 1, Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from dlsched import __version__, errors
from dlsched import _cli_format as fmt
from dlsched.client import (
    DEFAULT_CLUSTER_MANAGER,
    DEFAULT_SERVER,
    ClusterManagerClient,
    DlschedRpcError,
    JobManagerClient,
    is_terminal,
    job_name,
    load_job_file,
    parse_duration,
)
from dlsched.v1 import cluster_pb2, job_pb2

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130

_CLUSTER_TYPES = {
    "local": job_pb2.CLUSTER_TYPE_LOCAL,
    "slurm": job_pb2.CLUSTER_TYPE_SLURM,
    "kubernetes": job_pb2.CLUSTER_TYPE_KUBERNETES,
    "k8s": job_pb2.CLUSTER_TYPE_KUBERNETES,
    "ray": job_pb2.CLUSTER_TYPE_RAY,
}


class CliError(errors.InvalidArgument):
    """A bad command line the parser could not catch (e.g. two secrets on stdin)."""

    reason = "INVALID_COMMAND_LINE"


# --------------------------------------------------------------------------- helpers


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"want KEY=VALUE, got {text!r}")
    return key, value


def _parse_since(text: str) -> datetime:
    """``10m``, ``1h30m``, ``90s`` (ago) or an RFC 3339 time."""
    try:
        return datetime.now(UTC) - timedelta(seconds=parse_duration(text))
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"want a duration (10m, 1h) or an RFC 3339 time, got {text!r}") from None
    return dt if dt.tzinfo else dt.astimezone()


def _parse_replica(text: str) -> tuple[str, int | None]:
    role, sep, index = text.partition("/")
    if not role or (sep and not index.isdigit()):
        raise argparse.ArgumentTypeError(f"want ROLE or ROLE/INDEX, got {text!r}")
    return role, int(index) if sep else None


class _Secrets:
    """Reads secret files; ``-`` means stdin, allowed once."""

    def __init__(self) -> None:
        self.stdin_used = False

    def read(self, path: str, flag: str) -> str:
        if path == "-":
            if self.stdin_used:
                raise CliError.for_field(flag, "only one secret may come from stdin")
            self.stdin_used = True
            return sys.stdin.read()
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise CliError.for_field(flag, f"cannot read {path}: {e.strerror or e}") from None


def _credentials(args: argparse.Namespace, ctype: int) -> cluster_pb2.ClusterCredentials | None:
    sec = _Secrets()
    if args.ssh_user or args.ssh_key_file or args.ssh_host_key_file:
        if not (args.ssh_user and args.ssh_key_file):
            raise CliError.for_field("--ssh-key-file", "SSH needs --ssh-user and --ssh-key-file")
        ssh = cluster_pb2.SshCredentials(username=args.ssh_user,
                                         private_key=sec.read(args.ssh_key_file, "--ssh-key-file"))
        if args.ssh_host_key_file:
            text = sec.read(args.ssh_host_key_file, "--ssh-host-key-file")
            ssh.known_host_keys.extend(
                ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#"))
        return cluster_pb2.ClusterCredentials(ssh=ssh)
    if args.kubeconfig or (args.token_file and ctype == job_pb2.CLUSTER_TYPE_KUBERNETES):
        k = cluster_pb2.KubernetesCredentials()
        if args.kubeconfig:
            k.kubeconfig = sec.read(args.kubeconfig, "--kubeconfig")
        if args.token_file:
            k.token = sec.read(args.token_file, "--token-file").strip()
        if args.ca_cert_file:
            k.ca_cert = sec.read(args.ca_cert_file, "--ca-cert-file")
        return cluster_pb2.ClusterCredentials(kubernetes=k)
    if args.token_file:
        return cluster_pb2.ClusterCredentials(
            token=cluster_pb2.TokenCredentials(token=sec.read(args.token_file, "--token-file").strip()))
    return None


def _out(args: argparse.Namespace) -> str:
    return str(getattr(args, "output", "table"))


# --------------------------------------------------------------------------- job commands


async def cmd_submit(args: argparse.Namespace) -> int:
    job_id, spec = load_job_file(args.file)
    if args.id:
        job_id = args.id
    async with JobManagerClient(args.server) as jm:
        resp = await jm.submit_job(spec, job_id=job_id, request_id=args.request_id or "",
                                   dry_run=args.dry_run)
        if args.dry_run:
            if _out(args) != "table":
                fmt.dump(fmt.to_dict(resp), _out(args))
                return 0
            dr = resp.dry_run
            print(f"dry run: {resp.job.name or '(server-picked id)'} would run on {dr.cluster or '-'}")
            if dr.candidates:
                fmt.candidates_table(dr.candidates)
            print(f"native spec ({dr.native_spec.media_type or 'unknown type'}):")
            content = dr.native_spec.content
            sys.stdout.write(content if content.endswith("\n") else content + "\n")
            return 0
        job = resp.job
        if not args.follow:
            if _out(args) != "table":
                fmt.dump(fmt.to_dict(job), _out(args))
            else:
                print(f"{job.name} submitted ({fmt.job_state(job.state)})")
            return 0
        print(f"{job.name} submitted ({fmt.job_state(job.state)}); following its logs",
              file=sys.stderr, flush=True)
        final = await _follow(jm, job)
        return _report_final(final, args)


async def _follow(jm: JobManagerClient, job: job_pb2.Job) -> job_pb2.Job:
    """Streams the job's logs until it ends, then returns the terminal job."""
    prefix = fmt.total_slots(job.spec) > 1
    try:
        await _print_logs(jm, job.name, prefix=prefix, follow=True)
    except DlschedRpcError as e:
        if e.code not in ("UNIMPLEMENTED", "UNAVAILABLE", "FAILED_PRECONDITION"):
            raise
        print(f"warning: log stream ended: {e}", file=sys.stderr)
    return await jm.wait_for_job(job.name)


def _report_final(job: job_pb2.Job, args: argparse.Namespace) -> int:
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(job), _out(args))
    else:
        line = f"{job.name} {fmt.job_state(job.state)}"
        if job.HasField("exit_code"):
            line += f" exit_code={job.exit_code}"
        if job.reason:
            line += f" reason={job.reason}"
        if job.message and job.state != job_pb2.JOB_STATE_SUCCEEDED:
            line += f": {job.message}"
        print(line, flush=True)
    return 0 if job.state == job_pb2.JOB_STATE_SUCCEEDED else EXIT_ERROR


async def _print_logs(jm: JobManagerClient, name: str, *, prefix: bool, follow: bool,
                      tail: int = 0, since: datetime | None = None, role: str = "",
                      index: int | None = None, streams: Sequence[str] = (),
                      timestamps: bool = False, output: str = "table") -> None:
    async for e in jm.stream_job_logs(name, follow=follow, tail_lines=tail, since=since,
                                      role=role, replica_index=index, streams=streams):
        if output != "table":
            fmt.json_line(fmt.to_dict(e))
            continue
        out: TextIO = sys.stderr if e.stream == job_pb2.LOG_STREAM_STDERR else sys.stdout
        head = ""
        if timestamps and (e.time.seconds or e.time.nanos):
            head += e.time.ToDatetime(tzinfo=UTC).isoformat(timespec="milliseconds") + " "
        if prefix:
            head += f"[{e.role}/{e.replica_index}] "
        out.write(f"{head}{e.text}\n")
        out.flush()


async def cmd_logs(args: argparse.Namespace) -> int:
    role, index = args.replica if args.replica else ("", None)
    async with JobManagerClient(args.server) as jm:
        job = await jm.get_job(args.job)
        prefix = fmt.total_slots(job.spec) > 1 and index is None
        await _print_logs(jm, job.name, prefix=prefix, follow=args.follow, tail=args.tail,
                          since=args.since, role=role, index=index, streams=args.stream or (),
                          timestamps=args.timestamps, output=_out(args))
    return 0


async def cmd_get(args: argparse.Namespace) -> int:
    async with JobManagerClient(args.server) as jm:
        job = await jm.get_job(args.job)
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(job), _out(args))
    else:
        fmt.job_detail(job)
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with JobManagerClient(args.server) as jm:
        jobs = await jm.list_all_jobs(args.filter or "", args.page_size)
    if _out(args) != "table":
        fmt.dump({"jobs": [fmt.to_dict(j) for j in jobs]}, _out(args))
    else:
        fmt.jobs_table(jobs)
    return 0


async def cmd_stop(args: argparse.Namespace) -> int:
    async with JobManagerClient(args.server) as jm:
        job = await jm.stop_job(args.job, request_id=args.request_id or "")
        if args.wait and not is_terminal(job.state):
            job = await jm.wait_for_job(job.name, timeout=args.timeout)
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(job), _out(args))
    else:
        print(f"{job.name} {fmt.job_state(job.state)}")
    return 0


async def cmd_delete(args: argparse.Namespace) -> int:
    async with JobManagerClient(args.server) as jm:
        job = await jm.delete_job(args.job, allow_missing=args.allow_missing)
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(job) if job is not None else {}, _out(args))
    elif job is None:
        print(f"{job_name(args.job)} did not exist")
    else:
        print(f"{job.name} deleted")
    return 0


async def cmd_usage(args: argparse.Namespace) -> int:
    async with JobManagerClient(args.server) as jm:
        usage = await jm.get_job_usage(args.job)
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(usage), _out(args))
    else:
        fmt.usage_table(usage)
    return 0


async def _watch(stream_factory: Any, render: Any, args: argparse.Namespace) -> int:
    """Runs a watch forever: re-lists on WATCH_TOKEN_EXPIRED, resumes on UNAVAILABLE."""
    token = ""
    connected = False
    delay = 0.5
    while True:
        try:
            async for ev in stream_factory(args.filter or "", token):
                connected = True
                delay = 0.5
                token = ev.resume_token or token
                render(ev)
        except DlschedRpcError as e:
            if e.reason == "WATCH_TOKEN_EXPIRED":
                print("watch: resume token expired; listing again", file=sys.stderr)
                token = ""
                continue
            if e.code != "UNAVAILABLE" or not connected:
                raise
            print(f"watch: {e.message}; reconnecting", file=sys.stderr)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


def _event_name(t: int) -> str:
    return fmt.enum_short(job_pb2.WatchEventType, t)


async def cmd_watch(args: argparse.Namespace) -> int:
    def render(ev: Any) -> None:
        if _out(args) != "table":
            fmt.json_line(fmt.to_dict(ev))
        elif ev.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
            print("-- snapshot complete --", flush=True)
        else:
            j = ev.job
            print(f"{_event_name(ev.type):<9} {j.name}  {fmt.job_state(j.state)}"
                  f"{'  ' + j.reason if j.reason else ''}", flush=True)

    async with JobManagerClient(args.server) as jm:
        return await _watch(jm.watch_jobs, render, args)


# --------------------------------------------------------------------------- cluster commands


async def cmd_cluster_add(args: argparse.Namespace) -> int:
    ctype = _CLUSTER_TYPES[args.type]
    c = cluster_pb2.Cluster(type=ctype, address=args.address or "",
                            driver_address=args.driver, labels=dict(args.label or []),
                            options=dict(args.option or []))
    creds = _credentials(args, ctype)
    if creds is not None:
        c.credentials.CopyFrom(creds)
    async with ClusterManagerClient(args.cluster_manager) as cm:
        got = await cm.create_cluster(args.name, c, request_id=args.request_id or "")
        if args.wait:
            got = await cm.wait_cluster_state(got.name, timeout=args.timeout)
    _print_cluster(got, args)
    return 0


async def cmd_cluster_update(args: argparse.Namespace) -> int:
    c = cluster_pb2.Cluster(name=args.name)
    mask: list[str] = []
    if args.address is not None:
        c.address = args.address
        mask.append("address")
    if args.driver is not None:
        c.driver_address = args.driver
        mask.append("driver_address")
    if args.label is not None:
        c.labels.update(dict(args.label))
        mask.append("labels")
    if args.option is not None:
        c.options.update(dict(args.option))
        mask.append("options")
    async with ClusterManagerClient(args.cluster_manager) as cm:
        creds = None
        if args.ssh_user or args.ssh_key_file or args.token_file or args.kubeconfig:
            current = await cm.get_cluster(args.name)
            creds = _credentials(args, current.type)
        if creds is not None:
            c.credentials.CopyFrom(creds)
            mask.append("credentials")
        if not mask:
            raise CliError("nothing to update: give --address, --driver, --label, --option "
                           "or credentials")
        got = await cm.update_cluster(c, mask, etag=args.etag or "")
    _print_cluster(got, args)
    return 0


def _print_cluster(c: cluster_pb2.Cluster, args: argparse.Namespace) -> None:
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(c), _out(args))
    else:
        fmt.cluster_detail(c)


async def cmd_cluster_get(args: argparse.Namespace) -> int:
    async with ClusterManagerClient(args.cluster_manager) as cm:
        c = await cm.get_cluster(args.name)
    _print_cluster(c, args)
    return 0


async def cmd_cluster_list(args: argparse.Namespace) -> int:
    async with ClusterManagerClient(args.cluster_manager) as cm:
        cs = await cm.list_all_clusters(args.filter or "")
    if _out(args) != "table":
        fmt.dump({"clusters": [fmt.to_dict(c) for c in cs]}, _out(args))
    else:
        fmt.clusters_table(cs)
    return 0


async def cmd_cluster_remove(args: argparse.Namespace) -> int:
    async with ClusterManagerClient(args.cluster_manager) as cm:
        c = await cm.delete_cluster(args.name, allow_missing=args.allow_missing)
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(c) if c is not None else {}, _out(args))
    else:
        print(f"{c.name} removed" if c is not None else f"{args.name} did not exist")
    return 0


async def cmd_cluster_watch(args: argparse.Namespace) -> int:
    def render(ev: Any) -> None:
        if _out(args) != "table":
            fmt.json_line(fmt.to_dict(ev))
        elif ev.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
            print("-- snapshot complete --", flush=True)
        else:
            c = ev.cluster
            print(f"{_event_name(ev.type):<9} {c.name}  "
                  f"{fmt.enum_short(cluster_pb2.ClusterState, c.state)}"
                  f"{'  ' + c.state_message if c.state_message else ''}", flush=True)

    async with ClusterManagerClient(args.cluster_manager) as cm:
        return await _watch(cm.watch_clusters, render, args)


def cmd_up(args: argparse.Namespace) -> int:
    from dlsched import stack

    return stack.main(data_dir=args.data_dir, port=args.port, host=args.host,
                      ready_timeout=args.ready_timeout)


# --------------------------------------------------------------------------- parser


def _common(sub: bool) -> argparse.ArgumentParser:
    """Global options; subcommands accept them too (without overriding defaults)."""
    p = argparse.ArgumentParser(add_help=False)
    d: dict[str, Any] = {"default": argparse.SUPPRESS} if sub else {}
    p.add_argument("--server", metavar="HOST:PORT",
                   help=f"JobManager address (env DLSCHED_SERVER; default {DEFAULT_SERVER})",
                   **(d or {"default": os.environ.get("DLSCHED_SERVER") or DEFAULT_SERVER}))
    p.add_argument("--cluster-manager", metavar="HOST:PORT",
                   help="ClusterManager address (env DLSCHED_CLUSTER_MANAGER; default "
                   f"{DEFAULT_CLUSTER_MANAGER})",
                   **(d or {"default": os.environ.get("DLSCHED_CLUSTER_MANAGER")
                            or DEFAULT_CLUSTER_MANAGER}))
    p.add_argument("-o", "--output", choices=fmt.FORMATS, help="output format (default table)",
                   **(d or {"default": "table"}))
    return p


def _cred_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("credentials (read from files, '-' for stdin; never on the command line)")
    g.add_argument("--ssh-user", metavar="USER", help="SSH user (Slurm)")
    g.add_argument("--ssh-key-file", metavar="FILE", help="SSH private key file (Slurm)")
    g.add_argument("--ssh-host-key-file", metavar="FILE",
                   help="pinned host keys, known_hosts lines (Slurm)")
    g.add_argument("--token-file", metavar="FILE", help="bearer token file (Ray, Kubernetes)")
    g.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig file (Kubernetes)")
    g.add_argument("--ca-cert-file", metavar="FILE", help="CA bundle of the API server (Kubernetes)")


def build_parser() -> argparse.ArgumentParser:
    common = _common(sub=True)
    parser = argparse.ArgumentParser(
        prog="dlsched", parents=[_common(sub=False)],
        description="Run deep-learning jobs on local, Slurm, Kubernetes and Ray clusters.")
    parser.add_argument("--version", action="version", version=f"dlsched {__version__}")
    cmds = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Any, help: str, sp: Any = cmds) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sp.add_parser(name, help=help, description=help,
                                                   parents=[common])
        p.set_defaults(func=func)
        return p

    p = add("up", cmd_up, "run the whole local stack (etcd, services, local cluster) in the foreground")
    p.add_argument("--data-dir", default="./.dlsched", help="state and logs (default ./.dlsched)")
    p.add_argument("--port", type=int, default=50051,
                   help="JobManager port; ClusterManager gets PORT+1 (default 50051)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--ready-timeout", type=float, default=60.0, help=argparse.SUPPRESS)

    p = add("submit", cmd_submit, "submit a job file (YAML)")
    p.add_argument("file", metavar="FILE", help="job file, '-' for stdin")
    p.add_argument("-f", "--follow", action="store_true",
                   help="stream the logs until the job ends; exit 0 only if it SUCCEEDED")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and plan only: show the chosen cluster and native spec")
    p.add_argument("--request-id", metavar="ID", help="idempotency key: a retry runs nothing twice")
    p.add_argument("--id", metavar="JOB_ID", help="job id (overrides the file's jobId)")

    p = add("get", cmd_get, "show a job")
    p.add_argument("job", metavar="JOB", help="job id or name (jobs/ID)")

    p = add("list", cmd_list, "list jobs, newest first")
    p.add_argument("--filter", metavar="F", help="e.g. state=RUNNING AND labels.team=vision")
    p.add_argument("--page-size", type=int, default=0, help=argparse.SUPPRESS)

    p = add("logs", cmd_logs, "print a job's logs")
    p.add_argument("job", metavar="JOB")
    p.add_argument("-f", "--follow", action="store_true", help="keep streaming until the job ends")
    p.add_argument("--tail", type=int, default=0, metavar="N",
                   help="only the last N lines of each replica stream")
    p.add_argument("--replica", type=_parse_replica, metavar="ROLE[/INDEX]",
                   help="only this role, or one replica of it")
    p.add_argument("--since", type=_parse_since, metavar="10m|RFC3339",
                   help="only lines written since then")
    p.add_argument("--stream", action="append", choices=("stdout", "stderr"),
                   help="only this stream (repeatable)")
    p.add_argument("--timestamps", action="store_true", help="prefix each line with its time")

    p = add("stop", cmd_stop, "stop a job (SIGTERM, then SIGKILL after a grace period)")
    p.add_argument("job", metavar="JOB")
    p.add_argument("--request-id", metavar="ID")
    p.add_argument("--wait", action="store_true", help="wait until the job has stopped")
    p.add_argument("--timeout", type=float, default=60.0, help="with --wait, seconds (default 60)")

    p = add("delete", cmd_delete, "delete a job (stops it first if it runs)")
    p.add_argument("job", metavar="JOB")
    p.add_argument("--allow-missing", action="store_true", help="succeed if it does not exist")

    p = add("watch", cmd_watch, "stream job changes (the current jobs first)")
    p.add_argument("--filter", metavar="F")

    p = add("usage", cmd_usage, "show a job's resource usage now")
    p.add_argument("job", metavar="JOB")

    pc = cmds.add_parser("cluster", help="manage clusters", parents=[common],
                         description="Register and inspect backend clusters.")
    csub = pc.add_subparsers(dest="cluster_command", metavar="COMMAND", required=True)

    p = add("add", cmd_cluster_add, "register a cluster", csub)
    p.add_argument("name", metavar="NAME", help="cluster id (lower case, digits, '-')")
    p.add_argument("--type", required=True, choices=("local", "slurm", "kubernetes", "ray"))
    p.add_argument("--driver", required=True, metavar="HOST:PORT",
                   help="address of the cluster's driver service")
    p.add_argument("--address", metavar="A",
                   help="login node host[:port] (Slurm), API server URL (Kubernetes), "
                        "dashboard URL (Ray)")
    p.add_argument("--label", action="append", type=_key_value, metavar="KEY=VALUE")
    p.add_argument("--option", action="append", type=_key_value, metavar="KEY=VALUE",
                   help="backend option, e.g. partition=gpu, namespace=ml")
    p.add_argument("--request-id", metavar="ID")
    p.add_argument("--wait", action="store_true", help="wait until the cluster is READY")
    p.add_argument("--timeout", type=float, default=60.0, help="with --wait, seconds (default 60)")
    _cred_flags(p)

    p = add("update", cmd_cluster_update, "change a cluster's address, driver, labels, options "
                                          "or credentials", csub)
    p.add_argument("name", metavar="NAME")
    p.add_argument("--driver", metavar="HOST:PORT")
    p.add_argument("--address", metavar="A")
    p.add_argument("--label", action="append", type=_key_value, metavar="KEY=VALUE",
                   help="replaces all labels")
    p.add_argument("--option", action="append", type=_key_value, metavar="KEY=VALUE",
                   help="replaces all options")
    p.add_argument("--etag", help="update only if the cluster's etag still matches")
    _cred_flags(p)

    p = add("get", cmd_cluster_get, "show a cluster", csub)
    p.add_argument("name", metavar="NAME")

    p = add("list", cmd_cluster_list, "list clusters", csub)
    p.add_argument("--filter", metavar="F", help="e.g. type=SLURM AND state=READY")

    p = add("remove", cmd_cluster_remove, "remove a cluster (its jobs are not touched)", csub)
    p.add_argument("name", metavar="NAME")
    p.add_argument("--allow-missing", action="store_true")

    p = add("watch", cmd_cluster_watch, "stream cluster changes", csub)
    p.add_argument("--filter", metavar="F")

    return parser


# --------------------------------------------------------------------------- main


def print_error(exc: BaseException, err: TextIO | None = None) -> None:
    err = err or sys.stderr
    if isinstance(exc, DlschedRpcError):
        err.write(f"error: {exc.code} {exc.reason}: {exc.message}\n")
        for v in exc.field_violations:
            err.write(f"  field {v.field}: {v.description}\n")
        for subject, desc in exc.precondition_violations:
            err.write(f"  {subject}: {desc}\n")
        if exc.code == "UNAVAILABLE":
            err.write("  (is the server running? start the local stack with `dlsched up`, "
                      "or set --server / DLSCHED_SERVER)\n")
    elif isinstance(exc, errors.DlschedError):
        err.write(f"error: {exc.code} {exc.reason}: {exc.message}\n")
        for v in getattr(exc, "violations", ()):
            if isinstance(v, errors.FieldViolation):
                err.write(f"  field {v.field}: {v.description}\n")
    elif isinstance(exc, TimeoutError):
        err.write("error: DEADLINE_EXCEEDED TIMEOUT: timed out\n")
    else:
        err.write(f"error: INTERNAL CLIENT_ERROR: {type(exc).__name__}: {exc}\n")
        if os.environ.get("DLSCHED_DEBUG"):
            traceback.print_exception(exc, file=err)
    err.flush()


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.func is cmd_up:
            return int(cmd_up(args))
        return int(asyncio.run(args.func(args)))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`dlsched logs JOB | head`); say nothing.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - avoid a second error at exit
        except OSError:
            pass
        return 0
    except Exception as exc:  # noqa: BLE001 - errors are printed, never a traceback
        print_error(exc)
        return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> None:
    code = run(argv)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()


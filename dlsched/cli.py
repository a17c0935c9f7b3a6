"""The ``dlsched`` command line.

``dlsched [--context NAME] [--server H:P] [--cluster-manager H:P] [--token-file F]
[--ca-file F] [--insecure] [-o table|json|yaml] COMMAND``

Jobs: ``submit``, ``get``, ``list``, ``logs``, ``stop``, ``delete``,
``watch``, ``usage``. Clusters: ``cluster add|get|list|update|remove|watch``.
Access: ``whoami``, ``token create|list|revoke``, ``rolebinding
add|list|remove``. Client config: ``config use-context|get-contexts|set-context``.
The local stack: ``up``. Where to connect and with which credentials is
resolved once, in ``run``, by ``dlsched.profile.resolve`` (flags > environment
> context > defaults) and handed to every ``dlsched.client`` client; errors
print ``error: CODE REASON: message`` (plus the field violations and a hint)
on stderr and exit 1, Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO, cast

from dlsched import __version__, errors
from dlsched import _cli_format as fmt
from dlsched import profile as profiles
from dlsched.client import (
    DEFAULT_CLUSTER_MANAGER,
    DEFAULT_SERVER,
    AccessClient,
    ClusterManagerClient,
    DlschedRpcError,
    JobManagerClient,
    is_terminal,
    job_name,
    load_job_file,
    parse_duration,
)
from dlsched.kit.parse import decimal
from dlsched.v1 import cluster_pb2, job_pb2

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130

#: ``--type`` choices: every backend of the API's ClusterType enum, by its lower-case name.
_CLUSTER_TYPES = {
    name.removeprefix("CLUSTER_TYPE_").lower(): number
    for name, number in job_pb2.ClusterType.items() if number != job_pb2.CLUSTER_TYPE_UNSPECIFIED
}
_CLUSTER_TYPE_ALIASES = {"k8s": "kubernetes"}


class CliError(errors.InvalidArgument):
    """A bad command line the parser could not catch (e.g. two secrets on stdin)."""

    reason = "INVALID_COMMAND_LINE"


# --------------------------------------------------------------------------- helpers


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"want KEY=VALUE, got {text!r}")
    return key, value


_INT32_MAX = 2**31 - 1


def _count(text: str) -> int:
    """A non-negative count that fits the API's int32 (``--tail``)."""
    if not decimal(text) or int(text) > _INT32_MAX:
        raise argparse.ArgumentTypeError(f"want a whole number from 0 to {_INT32_MAX}, got {text!r}")
    return int(text)


def _parse_since(text: str) -> datetime:
    """``10m``, ``1h30m``, ``90s`` (ago) or an RFC 3339 time."""
    try:
        return datetime.now(UTC) - timedelta(seconds=parse_duration(text))
    except OverflowError:
        raise argparse.ArgumentTypeError(f"{text!r} reaches past the calendar") from None
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"want a duration (10m, 1h) or an RFC 3339 time, got {text!r}") from None
    return dt if dt.tzinfo else dt.astimezone()


def _parse_expires(text: str) -> datetime:
    """``30d``, ``12h`` (from now) or an RFC 3339 time, in the future."""
    try:
        dt = datetime.now(UTC) + timedelta(seconds=parse_duration(text))
    except OverflowError:
        raise argparse.ArgumentTypeError(f"{text!r} reaches past the calendar") from None
    except ValueError:
        try:
            dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"want a duration (30d, 12h) or an RFC 3339 time, got {text!r}") from None
        dt = dt if dt.tzinfo else dt.astimezone()
    if dt <= datetime.now(UTC):
        raise argparse.ArgumentTypeError(f"{text!r} is not in the future")
    return dt


def _parse_replica(text: str) -> tuple[str, int | None]:
    role, sep, index = text.partition("/")
    if not role or (sep and (not decimal(index) or int(index) > _INT32_MAX)):
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
        except UnicodeDecodeError:
            raise CliError.for_field(flag, f"{path} is not UTF-8 text") from None


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


# --------------------------------------------------------------------------- connection


def _positive_seconds(text: str) -> float:
    """A number of seconds above 0 and finite (``nan`` and ``-5`` were taken, then timed out at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0: {text!r}")
    return value


def resolve_profile(args: argparse.Namespace) -> profiles.Profile:
    """Where to connect and with which credentials: flags, then the
    environment, then the context (``dlsched.profile.resolve``); the files it
    names must be readable."""
    prof = profiles.resolve(server=args.server, cluster_manager=args.cluster_manager,
                            token_file=args.auth_token_file, ca_file=args.ca_file,
                            insecure=args.insecure, context=args.context)
    checks = (
        ("--ca-file", prof.tls.ca_file, "the CA file",
         "--ca-file, DLSCHED_CA_FILE / DLSCHED_TLS_CA_FILE or the context's ca-file"),
        ("--token-file", prof.token_file, "the token file",
         "--token-file, DLSCHED_TOKEN_FILE or the context's token-file"),
    )
    for flag, path, what, where in checks:
        if path and not (prof.tls.insecure and flag == "--ca-file") and not os.access(path, os.R_OK):
            reason = "does not exist" if not os.path.exists(path) else "is not readable"
            raise CliError.for_field(flag, f"{what} {path} {reason} (from {where})")
    ca = prof.tls.ca_file
    if ca and not prof.tls.insecure and not _has_pem_certificate(ca):
        raise CliError.for_field("--ca-file", f"the CA file {ca} holds no PEM certificate "
                                 "(-----BEGIN CERTIFICATE-----)")
    return prof


def _has_pem_certificate(path: str) -> bool:
    """Whether the file holds a PEM certificate that parses (gRPC's refusal of one that does
    not is log lines from its C core and an UNAVAILABLE that blames the server)."""
    import ssl

    try:
        with open(path, "rb") as f:
            if b"-----BEGIN CERTIFICATE-----" not in f.read(1 << 20):
                return False
        ssl.create_default_context(cafile=path)  # OpenSSL's reading of it, as gRPC's (no warnings)
        return True
    except (OSError, ValueError, ssl.SSLError):
        return False


def _jm(args: argparse.Namespace) -> JobManagerClient:
    return JobManagerClient(profile=args.profile)


def _cm(args: argparse.Namespace) -> ClusterManagerClient:
    return ClusterManagerClient(profile=args.profile)


def _access(args: argparse.Namespace) -> AccessClient:
    return AccessClient(profile=args.profile)


# --------------------------------------------------------------------------- job commands


async def cmd_submit(args: argparse.Namespace) -> int:
    job_id, spec = load_job_file(args.file)
    if args.id:
        job_id = args.id
    if args.project:
        spec.project = args.project
    async with _jm(args) as jm:
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
            if not dr.HasField("native_spec"):
                print("native spec: not available (the cluster's driver cannot render it now; "
                      "a job submitted now waits for it)")
                return 0
            print(f"native spec ({dr.native_spec.media_type or 'unknown type'}):")
            content = dr.native_spec.content
            sys.stdout.write(content if content.endswith("\n") else content + "\n")
            return 0
        job = resp.job
        if not args.follow:
            if _out(args) != "table":
                fmt.dump(fmt.to_dict(job), _out(args))
            else:
                print(f"{job.name} submitted ({fmt.job_state(job.state)}, project {job.project or '-'})")
            return 0
        print(f"{job.name} submitted ({fmt.job_state(job.state)}, project {job.project or '-'});"
              " following its logs", file=sys.stderr, flush=True)
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
    def reconnecting(e: DlschedRpcError) -> None:
        # The SDK calls again from the last line printed: nothing lost or repeated.
        print(f"logs: {e.message}; reconnecting", file=sys.stderr, flush=True)

    async for e in jm.stream_job_logs(name, follow=follow, tail_lines=tail, since=since,
                                      role=role, replica_index=index, streams=streams,
                                      on_reconnect=reconnecting):
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
    async with _jm(args) as jm:
        job = await jm.get_job(args.job)
        prefix = fmt.total_slots(job.spec) > 1 and index is None
        await _print_logs(jm, job.name, prefix=prefix, follow=args.follow, tail=args.tail,
                          since=args.since, role=role, index=index, streams=args.stream or (),
                          timestamps=args.timestamps, output=_out(args))
    return 0


async def cmd_get(args: argparse.Namespace) -> int:
    async with _jm(args) as jm:
        job = await jm.get_job(args.job)
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(job), _out(args))
    else:
        fmt.job_detail(job)
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with _jm(args) as jm:
        jobs = await jm.list_all_jobs(args.filter or "", args.page_size)
    if _out(args) != "table":
        fmt.dump({"jobs": [fmt.to_dict(j) for j in jobs]}, _out(args))
    else:
        fmt.jobs_table(jobs)
    return 0


async def cmd_stop(args: argparse.Namespace) -> int:
    async with _jm(args) as jm:
        job = await jm.stop_job(args.job, request_id=args.request_id or "")
        if args.wait and not is_terminal(job.state):
            job = await jm.wait_for_job(job.name, timeout=args.timeout)
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(job), _out(args))
    else:
        print(f"{job.name} {fmt.job_state(job.state)}")
    return 0


async def cmd_delete(args: argparse.Namespace) -> int:
    async with _jm(args) as jm:
        job = await jm.delete_job(args.job, allow_missing=args.allow_missing, etag=args.etag or "")
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(job) if job is not None else {}, _out(args))
    elif job is None:
        print(f"{job_name(args.job)} did not exist")
    else:
        print(f"{job.name} deleted")
    return 0


async def cmd_usage(args: argparse.Namespace) -> int:
    async with _jm(args) as jm:
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
        if ev.type == job_pb2.WATCH_EVENT_TYPE_HEARTBEAT:
            return  # a quiet watch's keep-alive: _watch keeps its token, nothing is shown
        if _out(args) != "table":
            fmt.json_line(fmt.to_dict(ev))
        elif ev.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
            print("-- snapshot complete --", flush=True)
        else:
            j = ev.job
            print(f"{_event_name(ev.type):<9} {j.name}  {fmt.job_state(j.state)}"
                  f"{'  ' + j.reason if j.reason else ''}", flush=True)

    async with _jm(args) as jm:
        return await _watch(lambda f, t: jm.watch_jobs(f, t, heartbeats=True), render, args)


# --------------------------------------------------------------------------- cluster commands


async def cmd_cluster_add(args: argparse.Namespace) -> int:
    ctype = _CLUSTER_TYPES[_CLUSTER_TYPE_ALIASES.get(args.type, args.type)]
    c = cluster_pb2.Cluster(type=cast(job_pb2.ClusterType, ctype), address=args.address or "",
                            driver_address=args.driver, labels=dict(args.label or []),
                            options=dict(args.option or []))
    creds = _credentials(args, ctype)
    if creds is not None:
        c.credentials.CopyFrom(creds)
    async with _cm(args) as cm:
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
    async with _cm(args) as cm:
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
    async with _cm(args) as cm:
        c = await cm.get_cluster(args.name)
    _print_cluster(c, args)
    return 0


async def cmd_cluster_list(args: argparse.Namespace) -> int:
    async with _cm(args) as cm:
        cs = await cm.list_all_clusters(args.filter or "")
    if _out(args) != "table":
        fmt.dump({"clusters": [fmt.to_dict(c) for c in cs]}, _out(args))
    else:
        fmt.clusters_table(cs)
    return 0


async def cmd_cluster_remove(args: argparse.Namespace) -> int:
    async with _cm(args) as cm:
        c = await cm.delete_cluster(args.name, allow_missing=args.allow_missing, etag=args.etag or "")
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(c) if c is not None else {}, _out(args))
    else:
        print(f"{c.name} removed" if c is not None else f"{args.name} did not exist")
    return 0


async def cmd_cluster_watch(args: argparse.Namespace) -> int:
    def render(ev: Any) -> None:
        if ev.type == job_pb2.WATCH_EVENT_TYPE_HEARTBEAT:
            return  # a quiet watch's keep-alive: _watch keeps its token, nothing is shown
        if _out(args) != "table":
            fmt.json_line(fmt.to_dict(ev))
        elif ev.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
            print("-- snapshot complete --", flush=True)
        else:
            c = ev.cluster
            print(f"{_event_name(ev.type):<9} {c.name}  "
                  f"{fmt.enum_short(cluster_pb2.ClusterState, c.state)}"
                  f"{'  ' + c.state_message if c.state_message else ''}", flush=True)

    async with _cm(args) as cm:
        return await _watch(lambda f, t: cm.watch_clusters(f, t, heartbeats=True), render, args)


# --------------------------------------------------------------------------- access


async def cmd_whoami(args: argparse.Namespace) -> int:
    async with _access(args) as ac:
        me = await ac.get_caller()
    if _out(args) != "table":
        fmt.dump(fmt.caller_dict(me.principal, me.admin, me.roles), _out(args))
    else:
        fmt.caller_detail(me.principal, me.admin, list(me.roles))
    return 0


async def cmd_token_create(args: argparse.Namespace) -> int:
    async with _access(args) as ac:
        tok, secret = await ac.create_api_token(args.service_account,
                                                description=args.description or "",
                                                expire_time=args.expires)
    if _out(args) != "table":
        fmt.dump({"apiToken": fmt.to_dict(tok), "secret": secret}, _out(args))
    else:
        # Only the secret on stdout, so `dlsched token create ci > ci.token` keeps it.
        sys.stdout.write(secret + "\n")
        sys.stdout.flush()
    expires = args.expires.isoformat(timespec="seconds") if args.expires else "never"
    print(f"{tok.name} created for sa:{tok.service_account} (expires {expires}). The secret is "
          "on stdout and is shown only this once: store it now (a file readable only by you). "
          f"Grant it a role: dlsched rolebinding add sa:{tok.service_account} --project P "
          "--role member", file=sys.stderr, flush=True)
    return 0


async def cmd_token_list(args: argparse.Namespace) -> int:
    async with _access(args) as ac:
        tokens = await ac.list_api_tokens(service_account=args.service_account or "")
    if _out(args) != "table":
        fmt.dump({"apiTokens": [fmt.to_dict(t) for t in tokens]}, _out(args))
    else:
        fmt.api_tokens_table(tokens)
    return 0


async def cmd_token_revoke(args: argparse.Namespace) -> int:
    name = args.name if "/" in args.name else f"apiTokens/{args.name}"
    async with _access(args) as ac:
        await ac.delete_api_token(name)
    print(f"{name} revoked")
    return 0


_ROLES = ("viewer", "member", "admin")


async def cmd_rolebinding_add(args: argparse.Namespace) -> int:
    project = args.project
    if project is None:
        if args.role != "admin":
            raise CliError.for_field("--project", "required (admin is bound to project '*')")
        project = "*"
    async with _access(args) as ac:
        rb = await ac.create_role_binding(args.principal, project, args.role)
    if _out(args) != "table":
        fmt.dump(fmt.to_dict(rb), _out(args))
    else:
        print(f"{rb.name}: {rb.principal} is {fmt.role(rb.role).lower()} in project {rb.project}")
    return 0


async def cmd_rolebinding_list(args: argparse.Namespace) -> int:
    async with _access(args) as ac:
        rbs = await ac.list_role_bindings(principal=args.principal or "", project=args.project or "")
    if _out(args) != "table":
        fmt.dump({"roleBindings": [fmt.to_dict(b) for b in rbs]}, _out(args))
    else:
        fmt.role_bindings_table(rbs)
    return 0


async def cmd_rolebinding_remove(args: argparse.Namespace) -> int:
    name = args.name if "/" in args.name else f"roleBindings/{args.name}"
    async with _access(args) as ac:
        await ac.delete_role_binding(name)
    print(f"{name} removed")
    return 0


# --------------------------------------------------------------------------- client config


def cmd_config_get_contexts(args: argparse.Namespace) -> int:
    path = profiles.config_path()
    current, contexts = profiles.get_contexts(path)
    if _out(args) != "table":
        fmt.dump({"config": str(path), "currentContext": current, "contexts": contexts}, _out(args))
    elif not contexts:
        print(f"no contexts in {path}; `dlsched up` or `dlsched config set-context` adds one",
              file=sys.stderr)
    else:
        fmt.contexts_table(current, contexts)
    return 0


def cmd_config_use_context(args: argparse.Namespace) -> int:
    path = profiles.use_context(args.name)
    print(f"current context: {args.name} ({path})")
    return 0


def cmd_config_set_context(args: argparse.Namespace) -> int:
    if args.ctx_token_file and args.ctx_token_command:
        raise CliError.for_field("--token-command", "give --token-file or --token-command, not both")
    path = profiles.config_path()
    _, contexts = profiles.get_contexts(path)
    ctx = dict(contexts.get(args.name, {}))

    def absolute(f: str) -> str:
        return os.path.abspath(os.path.expanduser(f))

    given = {"server": args.ctx_server, "cluster-manager": args.ctx_cluster_manager,
             "ca-file": absolute(args.ctx_ca_file) if args.ctx_ca_file else None,
             "token-file": absolute(args.ctx_token_file) if args.ctx_token_file else None,
             "token-command": args.ctx_token_command, "insecure": args.ctx_insecure}
    if args.ctx_token_file:
        ctx.pop("token-command", None)
    if args.ctx_token_command:
        ctx.pop("token-file", None)
    ctx.update({k: v for k, v in given.items() if v is not None})
    if ctx.get("insecure") is False:
        ctx.pop("insecure")
    profiles.save_context(args.name, ctx, path=path, make_current=args.current)
    current, _ = profiles.get_contexts(path)
    print(f"context {args.name} saved in {path}{' (current)' if current == args.name else ''}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from dlsched import stack

    return stack.main(data_dir=args.data_dir, port=args.port, host=args.host,
                      ready_timeout=args.ready_timeout)


# --------------------------------------------------------------------------- parser


def _common(sub: bool, *, token_file: bool = True) -> argparse.ArgumentParser:
    """Global options; subcommands accept them too (without overriding
    defaults). On ``cluster add|update``, ``--token-file`` after the command
    is the cluster's credential (``token_file=False``): there the caller's
    token file goes before the command."""
    p = argparse.ArgumentParser(add_help=False)
    d: dict[str, Any] = {"default": argparse.SUPPRESS} if sub else {"default": None}
    p.add_argument("--context", metavar="NAME",
                   help="context of the config file to use (env DLSCHED_CONTEXT; default its "
                        "current-context)", **d)
    p.add_argument("--server", metavar="HOST:PORT",
                   help="JobManager address (env DLSCHED_SERVER; else the context's; default "
                        f"{DEFAULT_SERVER})", **d)
    p.add_argument("--cluster-manager", metavar="HOST:PORT",
                   help="ClusterManager address (env DLSCHED_CLUSTER_MANAGER; else the "
                        f"context's; default {DEFAULT_CLUSTER_MANAGER})", **d)
    if token_file:
        p.add_argument("--token-file", dest="auth_token_file", metavar="FILE",
                       help="file holding the bearer token to call with (env DLSCHED_TOKEN_FILE "
                            "or DLSCHED_TOKEN; else the context's token-file or token-command)",
                       **d)
    p.add_argument("--ca-file", metavar="FILE",
                   help="CA bundle the servers' certificates are verified against (env "
                        "DLSCHED_CA_FILE; else the context's; default the system CAs)", **d)
    p.add_argument("--insecure", action="store_const", const=True,
                   help="plaintext gRPC, no TLS: only inside a mesh (env DLSCHED_INSECURE=1)", **d)
    p.add_argument("-o", "--output", choices=fmt.FORMATS, help="output format (default table)",
                   default=argparse.SUPPRESS if sub else "table")
    return p


def _output_only() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-o", "--output", choices=fmt.FORMATS, default=argparse.SUPPRESS,
                   help="output format (default table)")
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
    common_cluster_creds = _common(sub=True, token_file=False)
    parser = argparse.ArgumentParser(
        prog="dlsched", parents=[_common(sub=False)],
        description="Run deep-learning jobs on local, Slurm, Kubernetes and Ray clusters.")
    parser.add_argument("--version", action="version", version=f"dlsched {__version__}")
    cmds = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Any, help: str, sp: Any = cmds,
            parent: argparse.ArgumentParser = common) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sp.add_parser(name, help=help, description=help,
                                                   parents=[parent])
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
    p.add_argument("--project", metavar="P",
                   help="the job's project (overrides the file's; default: the one project you "
                        "may submit to, or 'default' for an admin)")

    p = add("get", cmd_get, "show a job")
    p.add_argument("job", metavar="JOB", help="job id or name (jobs/ID)")

    p = add("list", cmd_list, "list jobs, newest first")
    p.add_argument("--filter", metavar="F", help="e.g. state=RUNNING AND labels.team=vision")
    p.add_argument("--page-size", type=int, default=0, help=argparse.SUPPRESS)

    p = add("logs", cmd_logs, "print a job's logs")
    p.add_argument("job", metavar="JOB")
    p.add_argument("-f", "--follow", action="store_true", help="keep streaming until the job ends")
    p.add_argument("--tail", type=_count, default=0, metavar="N",
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
    p.add_argument("--timeout", type=_positive_seconds, default=60.0, help="with --wait, seconds (default 60)")

    p = add("delete", cmd_delete, "delete a job (stops it first if it runs)")
    p.add_argument("job", metavar="JOB")
    p.add_argument("--allow-missing", action="store_true", help="succeed if it does not exist")
    p.add_argument("--etag", help="delete only if the job's etag still matches")

    p = add("watch", cmd_watch, "stream job changes (the current jobs first)")
    p.add_argument("--filter", metavar="F")

    p = add("usage", cmd_usage, "show a job's resource usage now")
    p.add_argument("job", metavar="JOB")

    pc = cmds.add_parser("cluster", help="manage clusters", parents=[common],
                         description="Register and inspect backend clusters.")
    csub = pc.add_subparsers(dest="cluster_command", metavar="COMMAND", required=True)

    p = add("add", cmd_cluster_add, "register a cluster", csub, common_cluster_creds)
    p.add_argument("name", metavar="NAME", help="cluster id (lower case, digits, '-')")
    p.add_argument("--type", required=True, choices=(*_CLUSTER_TYPES, *_CLUSTER_TYPE_ALIASES))
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
    p.add_argument("--timeout", type=_positive_seconds, default=60.0, help="with --wait, seconds (default 60)")
    _cred_flags(p)

    p = add("update", cmd_cluster_update, "change a cluster's address, driver, labels, options "
                                          "or credentials", csub, common_cluster_creds)
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
    p.add_argument("--etag", help="remove only if the cluster's etag still matches")

    p = add("watch", cmd_cluster_watch, "stream cluster changes", csub)
    p.add_argument("--filter", metavar="F")

    add("whoami", cmd_whoami, "show who the server takes you for: principal, admin, roles")

    pt = cmds.add_parser("token", help="manage API tokens of service accounts (admins)",
                         parents=[common], description="API tokens for programs and CI.")
    tsub = pt.add_subparsers(dest="token_command", metavar="COMMAND", required=True)
    p = add("create", cmd_token_create, "create an API token; prints its secret once, on stdout",
            tsub)
    p.add_argument("service_account", metavar="SERVICE_ACCOUNT",
                   help="the token's service account (principal sa:SERVICE_ACCOUNT)")
    p.add_argument("--description", metavar="D", help="free text for people")
    p.add_argument("--expires", type=_parse_expires, metavar="30d|RFC3339",
                   help="when the token stops working (default never)")
    p = add("list", cmd_token_list, "list API tokens (never their secrets)", tsub)
    p.add_argument("--service-account", metavar="SA", help="only this service account's")
    p = add("revoke", cmd_token_revoke, "revoke an API token", tsub)
    p.add_argument("name", metavar="NAME", help="apiTokens/ID or ID")

    pr = cmds.add_parser("rolebinding", help="manage role bindings (admins)", parents=[common],
                         description="Who may do what in which project.")
    rsub = pr.add_subparsers(dest="rolebinding_command", metavar="COMMAND", required=True)
    p = add("add", cmd_rolebinding_add, "give a principal a role in a project", rsub)
    p.add_argument("principal", metavar="PRINCIPAL",
                   help="user:SUBJECT, group:GROUP or sa:SERVICE_ACCOUNT")
    p.add_argument("--project", metavar="P", help="project, or '*' for every project "
                   "(admin: '*', the default)")
    p.add_argument("--role", required=True, choices=_ROLES)
    p = add("list", cmd_rolebinding_list, "list role bindings", rsub)
    p.add_argument("--principal", metavar="X", help="only this principal's")
    p.add_argument("--project", metavar="P", help="only this project's")
    p = add("remove", cmd_rolebinding_remove, "remove a role binding", rsub)
    p.add_argument("name", metavar="NAME", help="roleBindings/ID or ID")

    out_only = _output_only()
    pg = cmds.add_parser("config", help="manage the client config file (contexts)",
                         description="Contexts: where the CLI connects and with which "
                                     "credentials ($DLSCHED_CONFIG or "
                                     "~/.config/dlsched/config.yaml).")
    gsub = pg.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    add("get-contexts", cmd_config_get_contexts, "list the contexts", gsub, out_only)
    p = add("use-context", cmd_config_use_context, "make a context the current one", gsub, out_only)
    p.add_argument("name", metavar="NAME")
    p = add("set-context", cmd_config_set_context,
            "add a context or change some of its settings", gsub, out_only)
    p.add_argument("name", metavar="NAME")
    p.add_argument("--server", dest="ctx_server", metavar="HOST:PORT", help="JobManager address")
    p.add_argument("--cluster-manager", dest="ctx_cluster_manager", metavar="HOST:PORT",
                   help="ClusterManager address")
    p.add_argument("--ca-file", dest="ctx_ca_file", metavar="FILE",
                   help="CA bundle to verify the servers (default the system CAs)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token-file", dest="ctx_token_file", metavar="FILE",
                     help="file holding the bearer token")
    tok.add_argument("--token-command", dest="ctx_token_command", metavar="CMD",
                     help="command printing the bearer token (e.g. an identity provider's CLI)")
    p.add_argument("--insecure", dest="ctx_insecure", action=argparse.BooleanOptionalAction,
                   default=None, help="plaintext gRPC (only inside a mesh)")
    p.add_argument("--current", action="store_true", help="also make it the current context")

    return parser


# --------------------------------------------------------------------------- main


_TLS_FAILURES = ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed", "Ssl handshake failed",
                 "SSL_ERROR", "WRONG_VERSION_NUMBER", "tsi_", "Handshake failed")


def _hint(exc: DlschedRpcError) -> str | None:
    if exc.code == "UNAVAILABLE":
        if any(t in exc.message for t in _TLS_FAILURES):
            return ("TLS handshake failed: the server's certificate does not verify against the "
                    "CA file, or the server does not speak TLS; check --ca-file, "
                    "DLSCHED_CA_FILE or the context's ca-file (`dlsched config get-contexts`)")
        return ("is the server running? start the local stack with `dlsched up`, or set "
                "--server / DLSCHED_SERVER / --context")
    if exc.code == "UNAUTHENTICATED":
        return ("check your token: --token-file, DLSCHED_TOKEN / DLSCHED_TOKEN_FILE or the "
                "context's token-file or token-command (`dlsched config get-contexts`)")
    if exc.code == "PERMISSION_DENIED":
        return "`dlsched whoami` shows who you are to the server and your roles"
    return None


def print_error(exc: BaseException, err: TextIO | None = None) -> None:
    err = err or sys.stderr
    if isinstance(exc, DlschedRpcError):
        err.write(f"error: {exc.code} {exc.reason}: {exc.message}\n")
        for v in exc.field_violations:
            err.write(f"  field {v.field}: {v.description}\n")
        for subject, desc in exc.precondition_violations:
            err.write(f"  {subject}: {desc}\n")
        hint = _hint(exc)
        if hint:
            err.write(f"  ({hint})\n")
    elif isinstance(exc, errors.DlschedError):
        err.write(f"error: {exc.code} {exc.reason}: {exc.message}\n")
        for v in getattr(exc, "violations", ()):
            if isinstance(v, errors.FieldViolation):
                err.write(f"  field {v.field}: {v.description}\n")
    elif isinstance(exc, TimeoutError):
        err.write("error: DEADLINE_EXCEEDED TIMEOUT: timed out\n")
    elif isinstance(exc, subprocess.CalledProcessError | subprocess.TimeoutExpired):
        # The context's token-command failed.
        detail = (exc.stderr or "").strip().splitlines()[-1:] if isinstance(exc.stderr, str) else []
        err.write(f"error: UNAUTHENTICATED TOKEN_COMMAND_FAILED: the token command {exc.cmd!r} "
                  f"failed{': ' + detail[0] if detail else ''}\n")
    else:
        err.write(f"error: INTERNAL CLIENT_ERROR: {type(exc).__name__}: {exc}\n")
        if os.environ.get("DLSCHED_DEBUG"):
            traceback.print_exception(exc, file=err)
    err.flush()


_OFFLINE = ("cmd_up", "cmd_config_get_contexts", "cmd_config_use_context", "cmd_config_set_context")


def run(argv: Sequence[str] | None = None) -> int:
    fmt.guard_terminal()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.func.__name__ in _OFFLINE:
            return int(args.func(args))
        args.profile = resolve_profile(args)
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


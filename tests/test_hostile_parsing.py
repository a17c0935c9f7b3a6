"""Hostile text never crashes a parse or costs unbounded work (hostile-input corpus).

``str.isdigit`` is True for '²', '٣' and other Unicode digits, which ``int`` refuses with a
ValueError: every parse of client input, backend output or a file a job can write checks with
``dlsched.kit.parse.decimal`` (ASCII digits) instead. Each case here raised ValueError before.
"""

from __future__ import annotations

import pytest

from cluster_manager.domain.validation import check_driver_address
from cluster_manager.hub import ResumeToken
from dlsched.errors import InvalidArgument
from dlsched.kit import tokens
from dlsched.kit.parse import decimal
from drivers.kubernetes import naming
from drivers.slurm import exits, render, states
from drivers.slurm.logs import parse_header

DIGITS = ["²", "٣", "１", "𝟗", "12²"]


def test_decimal_is_ascii_digits_only() -> None:
    assert decimal("0") and decimal("0123456789")
    assert not any(decimal(s) for s in ["", " 1", "1 ", "-1", "+1", "1.0", "1_0", *DIGITS])


@pytest.mark.parametrize("d", DIGITS)
def test_unicode_digits_are_refused_not_crashed_on(d: str) -> None:
    # a WatchClusters resume token a client sends
    with pytest.raises(InvalidArgument):
        ResumeToken.decode(tokens.encode(f"c1:{d}"))
    # a cluster's driver address a client registers
    assert check_driver_address(f"driver:{d}", "cluster.driver_address")
    # a Slurm comment: any job of the SSH user (a hostile one too) can set its own
    assert render.parse_comment(f"dlsched-job-1.{d}") is None
    assert render.parse_comment(f"dlsched-job-1.{d}.0123abcd") is None
    # the exit code column of squeue/sacct, and the exits file the job's processes can write
    assert states.exit_code(f"{d}:0") is None or isinstance(states.exit_code(f"{d}:0"), int)
    ex = exits.parse(f"labels a-0\nend a-0 {d} exit\n")
    assert ex is not None and ex.ends == ()
    assert exits.split_label(f"a-{d}") is None
    # a log frame header (the remote follower's), and a Kubernetes object's attempt label
    assert parse_header(f"{d} 1 2 3 f\n".encode()) is None
    assert naming.attempt_of({"metadata": {"labels": {naming.LABEL_ATTEMPT: d}}}) == 0


def test_an_observation_of_any_values_converts_within_the_wire_types() -> None:
    """What a backend reports is what jobs chose (a local job's status file, a Slurm listing):
    out-of-range numbers, non-finite times and unbounded or invalid text are clamped in the one
    conversion every driver uses; it never raises (it would end the cluster's stream)."""
    from drivers.common import base
    from drivers.common import convert as dconvert

    obs = base.JobObservation(
        job_id="j", backend_job_id="1", found=True, state=base.JobState.RUNNING,
        reason="r" * 100_000, message="m\udcff" * 100_000, exit_code=2**40, attempt=2**35,
        backend_restarts=-(2**40), start_time=float("nan"), end_time=1e300, uid="u",
        replicas=(base.ReplicaStatus(role="main", index=2**33, state=base.ReplicaState.RUNNING,
                                     host="h" * 5000, exit_code=-(2**50), message="\udc80"),))
    pb = dconvert.observation_pb(obs)
    again = type(pb).FromString(pb.SerializeToString())
    assert again.exit_code == 2**31 - 1 and again.attempt == 2**31 - 1 and again.backend_restarts == -(2**31)
    assert len(again.reason) == dconvert.MAX_REASON_CHARS and len(again.message) <= dconvert.MAX_MESSAGE_CHARS
    assert not again.HasField("start_time") and not again.HasField("end_time")
    r = again.replicas[0]
    assert r.index == 2**31 - 1 and r.exit_code == -(2**31) and len(r.host) == dconvert.MAX_HOST_CHARS


def test_a_log_cursor_that_is_a_nesting_bomb_or_too_many_streams_is_invalid_argument() -> None:
    """StreamJobLogs' resume_cursor comes from the client: a deep nesting (RecursionError in
    json) or more streams than any job has is INVALID_ARGUMENT on the field, not INTERNAL."""
    import base64
    import json
    import zlib

    from job_manager.domain.log_cursor import MAX_CURSOR_STREAMS, LogCursor

    def cursor(data: bytes) -> str:
        return base64.urlsafe_b64encode(zlib.compress(data, 9)).decode().rstrip("=")

    rows = [["main", i, 1, 1, 0, 0] for i in range(MAX_CURSOR_STREAMS + 1)]
    for data in (b"[" * 200_000 + b"]" * 200_000,
                 json.dumps({"v": 1, "u": "u", "a": "1", "s": rows}).encode()):
        with pytest.raises(InvalidArgument) as ei:
            LogCursor.decode(cursor(data))
        assert [v.field for v in ei.value.violations] == ["resume_cursor"]


@pytest.mark.parametrize("rev", ["1_000", " 5", "5 ", "+5", "-5", "²", "9" * 40, ""])
def test_a_watch_jobs_resume_token_is_a_revision_this_server_wrote(rev: str) -> None:
    from job_manager.watch import decode_token, encode_token

    assert decode_token(encode_token(1234)) == 1234
    with pytest.raises(InvalidArgument):
        decode_token(tokens.encode(f"j1:{rev}"))


def test_a_slurm_log_without_newlines_or_an_index_full_of_names_stays_bounded() -> None:
    """What a job writes to its own log files and log index: a line that never ends goes out in
    pieces of MAX_LINE_CHARS (the unfinished part held stays below it), index lines past their
    length and names past any job's files are dropped, and a file named with non-ASCII digits
    is no log file."""
    from drivers.common.base import LogQuery
    from drivers.common.convert import MAX_LINE_CHARS
    from drivers.slurm import logs as slogs

    cur = slogs.LogCursor(LogQuery(follow=True))
    chunk = b"z" * (MAX_LINE_CHARS * 3 + 5)
    got = cur.feed([slogs.Frame("main-0.stdout", 0, len(chunk), None, chunk)])
    assert [len(e.text) for e in got] == [MAX_LINE_CHARS] * 3
    assert len(cur.files["main-0.stdout"].partial) == 5
    more = cur.feed([slogs.Frame("main-0.stdout", len(chunk), len(chunk) + 2, None, b"y\n")])
    assert [e.text for e in more] == ["zzzzzy"]
    # The same long line, whole in one read or over several, gives the same pieces, cut
    # between characters.
    line = ("€" * 50_000 + "end").encode() + b"\n"
    whole = slogs.LogCursor(LogQuery(follow=True))
    a = [e.text for e in whole.feed([slogs.Frame("main-0.stdout", 0, len(line), None, line)])]
    split = slogs.LogCursor(LogQuery(follow=True))
    b = []
    for at, end in ((0, 70_001), (70_001, 100_000), (100_000, len(line))):
        b += [e.text for e in split.feed([slogs.Frame("main-0.stdout", at, len(line), None, line[at:end])])]
    assert a == b and len(a) == 3 and "".join(a) == line.decode()[:-1] and "\ufffd" not in "".join(a)
    index = b"".join(b"1.5 %d w-%d.stdout\n" % (i + 1, i) for i in range(slogs._MAX_FILES + 50))
    cur.feed([slogs.Frame(slogs.LOG_INDEX, 0, len(index), None, index + b"9" * 100_000)])
    assert len(cur.files) <= slogs._MAX_FILES and len(cur.index_partial) <= slogs._MAX_INDEX_LINE
    assert slogs.FILE_RE.match("main-\uff11.stdout") is None and slogs.FILE_RE.match("main-1.stdout")


def test_a_ray_manifest_a_job_wrote_over_is_read_line_by_line_and_bounded() -> None:
    from drivers.ray import layout

    text = "\n".join(["[" * 100_000 + "]" * 100_000, '{"role":"a","index":1e400}',
                      '{"role":"a","index":0,"exit":1e400}', '{"role":"a","index":0,"node_id":"n"}',
                      '{"role":"a","index":0,"exit":3}', "torn {"])
    m = layout.parse_manifest(text)
    assert [(p.role, p.index, p.node_id) for p in m.placed] == [("a", 0, "n")] and m.exits == {("a", 0): (3, False)}


@pytest.mark.parametrize("sup", ["x", [1, 2], {"pid": "1", "start_ticks": 5}, {"pid": True, "start_ticks": 5},
                                 {"pid": -1, "start_ticks": 5}, {"pid": 2 ** 40, "start_ticks": 5},
                                 {"pid": 7, "start_ticks": 1.5}, {"pid": 7}, None])
def test_a_local_status_files_supervisor_is_taken_only_as_two_integers(sup: object) -> None:
    """A local job can write over its status file: the supervisor it names (signalled on a
    stop) is a positive pid and start time as integers, or none."""
    from drivers.local import attempt

    assert attempt.supervisor_of({"supervisor": sup}) is None
    assert attempt.supervisor_of({"supervisor": {"pid": 7, "start_ticks": 5}}) == (7, 5)
    attempt.wake_supervisor(attempt.supervisor_of({"supervisor": sup}))  # nothing to signal, no error

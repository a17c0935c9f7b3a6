"""The Slurm poller's pacing, on a recorded fake login node: one squeue per round whatever the
number of tracked jobs, at most one follow-up, and no round added by wakes or ``fresh()``.

Intervals are short here (``floor`` lowered); the same rules against the real Slurm, through
the driver process, are in test_slurm_remote.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from dlsched.errors import DlschedError, Unavailable
from drivers.slurm import poller
from drivers.slurm.poller import Poller

INTERVAL = 0.15
FIELDS = len(poller.SQUEUE_FIELDS)


def squeue_line(jid: str, state: str = "PENDING") -> str:
    values = [jid, state, "0", "N/A", "N/A", "", "Priority", "0", f"dlsched-j{jid}.1".ljust(poller.COMMENT_WIDTH)]
    assert len(values) == FIELDS
    return "|".join(values) + "|"


class FakeLogin:
    """Answers squeue with the jobs in ``queue`` and scontrol with those in ``gone``;
    records (start time, command) of every call."""

    def __init__(self) -> None:
        self.queue: set[str] = set()
        self.gone: set[str] = set()
        self.calls: list[tuple[float, str]] = []
        self.fail = False
        #: set it to have ``round_starts`` filled with the poller's own start time of every
        #: round's squeue. The pacing rule is about these; a call's time also carries how long
        #: a busy host took from the round's start to the call (the 1,000 tracked ids, say).
        self.poller: Poller | None = None
        self.round_starts: list[float] = []

    async def run(self, command: str) -> tuple[int, str, str]:
        command = command.removeprefix("o=$(")
        self.calls.append((time.monotonic(), command.split()[0]))
        if self.poller is not None and command.startswith("squeue"):
            assert self.poller.last_start is not None
            self.round_starts.append(self.poller.last_start)
        await asyncio.sleep(0.01)
        if self.fail:
            raise Unavailable("ssh down", reason="BACKEND_UNAVAILABLE")
        if command.startswith("squeue"):
            return 0, "".join(squeue_line(j) + "\n" for j in sorted(self.queue)), ""
        if command.startswith("sacct"):
            asked = command.split("--jobs=", 1)[1].split()[0].split(",")
            d = command.split("--delimiter=", 1)[1].split()[0]
            return 0, "".join(d.join([j, "COMPLETED", "0:0", "Unknown", "Unknown", "n1", "x", f"dlsched-j{j}.1\n"])
                              for j in asked if j in self.gone), ""
        return 0, "".join(f"JobId={j} JobName=x JobState=COMPLETED ExitCode=0:0\n" for j in self.gone), ""

    def starts(self) -> list[float]:
        return [t for t, c in self.calls if c == "squeue"]


async def until(cond: Callable[[], bool], what: str, within: float = 30) -> None:
    """Until ``cond()`` (a busy host may be slow to get there: no test waits a fixed time for it)."""
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def make(login: FakeLogin, tracked: set[str], rounds: list[tuple[dict[str, poller.SlurmJob], str | None]],
         interval: float = INTERVAL) -> Poller:
    return Poller(login.run, "u", interval, lambda: tracked,
                  lambda jobs, err, complete: rounds.append((jobs, err)), floor=INTERVAL / 2)



async def test_the_interval_has_a_floor_that_keeps_the_poller_at_one_rpc_a_second() -> None:
    # A round is squeue (2 controller RPCs: jobs, partitions) and at most one scontrol (1);
    # sites may allow a user about 2 RPCs/s in all.
    assert 2 / poller.MIN_INTERVAL <= 1.0
    p = Poller(FakeLogin().run, "u", 0.3, lambda: (), lambda *a: None)
    assert p.interval == poller.MIN_INTERVAL


async def test_one_squeue_per_round_for_a_thousand_jobs_and_wakes_add_no_rounds() -> None:
    login = FakeLogin()
    tracked = {str(i) for i in range(1000)}
    login.queue = set(tracked)
    rounds: list[tuple[dict[str, poller.SlurmJob], str | None]] = []
    p = login.poller = make(login, tracked, rounds)
    starts = login.round_starts
    p.start()
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 6 * INTERVAL:  # a burst of launches: a wake every 2 ms
            p.wake()
            await asyncio.sleep(0.002)
        span = time.monotonic() - t0
    finally:
        await p.stop()
    assert [c for _, c in login.calls] == ["squeue"] * len(starts)  # nothing missing: no follow-up
    assert len(starts) >= 2 and len(starts) <= span / INTERVAL + 1
    assert min(b - a for a, b in zip(starts, starts[1:], strict=False)) >= INTERVAL
    assert len(rounds[-1][0]) == 1000 and p.last_round_commands == 1


async def test_jobs_that_left_the_queue_cost_one_follow_up_per_round() -> None:
    login = FakeLogin()
    tracked = {str(i) for i in range(200)}
    login.queue = {str(i) for i in range(100)}
    login.gone = {str(i) for i in range(100, 200)}
    rounds: list[tuple[dict[str, poller.SlurmJob], str | None]] = []
    p = make(login, tracked, rounds)
    p.start()
    try:
        await until(lambda: len(rounds) >= 2, "no second round")
    finally:
        await p.stop()
    names = [c for _, c in login.calls]
    assert names[:4] == ["squeue", "scontrol", "squeue", "scontrol"]
    assert names.count("scontrol") == names.count("squeue") or names[-1] == "squeue"
    assert p.last_round_commands in (1, 2)
    assert set(rounds[0][0]) == tracked  # every tracked job answered for, by the two calls


async def test_with_accounting_the_follow_up_is_sacct_for_just_the_missing_jobs() -> None:
    login = FakeLogin()
    tracked = {str(i) for i in range(10)}
    login.queue = {str(i) for i in range(6)}
    login.gone = {"6", "7", "8", "9", "99"}
    rounds: list[tuple[dict[str, poller.SlurmJob], str | None]] = []
    p = Poller(login.run, "u", INTERVAL, lambda: tracked, lambda jobs, err, complete: rounds.append((jobs, err)),
               floor=INTERVAL / 2, accounting=lambda: True)
    p.start()
    try:
        await until(lambda: len(rounds) >= 1, "no round")
    finally:
        await p.stop()
    assert [c for _, c in login.calls][:2] == ["squeue", "sacct"]
    assert set(rounds[0][0]) == tracked and rounds[0][0]["7"].state == "COMPLETED"
    assert poller.sacct_command(["9", "10", "x;rm"]).count("--jobs=10,9 ") == 1  # ids only, sorted


async def test_an_idle_poller_issues_nothing_and_a_wake_polls_at_once() -> None:
    login = FakeLogin()
    tracked: set[str] = set()
    rounds: list[tuple[dict[str, poller.SlurmJob], str | None]] = []
    # An interval far longer than the test: a round can only come from the wake.
    p = make(login, tracked, rounds, interval=600)
    p.start()
    try:
        await asyncio.sleep(3 * INTERVAL)
        assert login.calls == []
        tracked.add("7")
        login.queue.add("7")
        p.wake()
        p.wake()
        await until(lambda: bool(rounds), "a wake did not start a round")
        await asyncio.sleep(3 * INTERVAL)
        assert len(login.starts()) == 1  # both wakes: one round
    finally:
        await p.stop()


async def test_fresh_waits_for_the_next_round_and_follows_up_its_ids() -> None:
    login = FakeLogin()
    tracked = {"1"}
    login.queue = {"1"}
    login.gone = {"9"}
    p = login.poller = make(login, tracked, [])
    starts = login.round_starts
    p.start()
    try:
        await until(lambda: p.last_round is not None, "no first round")
        t = time.monotonic()
        jobs, also = await asyncio.gather(p.fresh(["9"]), p.fresh())
        assert jobs is not None and set(jobs) == {"1", "9"} and also == jobs
        assert len(starts) == 2 and starts[1] >= t and starts[1] - starts[0] >= INTERVAL
    finally:
        await p.stop()
    assert await p.fresh() is None  # stopped: nobody waits forever


async def test_a_failed_round_reports_the_error_and_polling_goes_on() -> None:
    login = FakeLogin()
    tracked = {"1"}
    login.queue = {"1"}
    login.fail = True
    rounds: list[tuple[dict[str, poller.SlurmJob], str | None]] = []
    p = make(login, tracked, rounds)
    p.start()
    try:
        await until(lambda: len(rounds) >= 1, "no round")
        login.fail = False
        assert rounds[0] == ({}, "BACKEND_UNAVAILABLE: ssh down")
        await until(lambda: rounds[-1][1] is None, "polling did not go on after a failed round")
        assert set(rounds[-1][0]) == {"1"}
    finally:
        await p.stop()


def test_both_commands_list_jobs_in_hidden_partitions_too() -> None:
    assert " --all " in poller.squeue_command("u")  # else such a job looks gone every round
    assert " --all " in poller.scontrol_command()


def test_a_revoked_federation_sibling_never_hides_the_live_job() -> None:
    live, revoked = squeue_line("5", "RUNNING"), squeue_line("5", "REVOKED")
    for text in (f"{live}\n{revoked}\n", f"{revoked}\n{live}\n"):
        assert poller.parse_squeue(text)["5"].state == "RUNNING"


def test_call_names_are_bounded_and_never_an_argument():
    from drivers.slurm.ssh import CALL_NAMES, call_name

    assert call_name("mkdir -p -- /s && exec sbatch --parsable") == "sbatch"
    assert call_name("sstat -j 5; echo '--- steps'; squeue --steps --jobs=5") == "sstat"
    assert call_name("rm -rf -- '/d/squeue;sbatch' /x") == "rm"  # quoted: an argument, not a command
    assert call_name("scancel 12") == "scancel"
    assert call_name("evil-$(x) 'unbalanced") == "other"
    assert call_name("whatever --flag") == "other"
    assert "other" not in CALL_NAMES


def test_a_forged_line_in_a_comment_changes_nothing_about_another_job() -> None:
    """A job sets its own comment to ``x\\n101|COMPLETED|...|dlsched-victim.1.abc``: no answer
    then reports job 101, nor takes a key out of the comment's text."""
    forged = "x\n101|COMPLETED|0|N/A|N/A||None|0|dlsched-victim.1.abc"
    evil = "|".join(["2", "PENDING", "0", "N/A", "N/A", "", "JobHeldUser", "0",
                     forged.ljust(poller.COMMENT_WIDTH)]) + "|\n"
    assert set(poller.parse_squeue(evil)) == {"2"}
    with pytest.raises(DlschedError):  # a record out of shape: nothing in the answer is believed
        poller.parse_squeue("2|PENDING|0|N/A|N/A||JobHeldUser|0|x\n" + squeue_line("101", "COMPLETED") + "\n")
    # scontrol: a comment's ` JobState=FAILED` is no key; a forged line for a listed job refuses the answer
    line = ("JobId=2 JobName=w JobState=PENDING Reason=JobHeldUser ExitCode=0:0 NodeList= "
            "Comment=x JobState=FAILED ExitCode=3:0  StdErr=/x\n")
    j = poller.parse_scontrol_jobs(line)["2"]
    assert (j.state, j.exit_status, j.comment) == ("PENDING", 0, "x")
    real = "JobId=101 JobName=v JobState=RUNNING ExitCode=0:0 Comment=dlsched-victim.1.abc\n"
    with pytest.raises(DlschedError):
        poller.parse_scontrol_jobs(real + line.replace("Comment=x", "Comment=x\nJobId=101 JobState=FAILED"))
    # sacct: with the poller's delimiter, a comment's lines continue it
    d = poller.new_delimiter()
    assert d != poller.new_delimiter() and d in poller.sacct_command(["1"], d)
    text = d.join(["2", "PENDING", "0:0", "Unknown", "Unknown", "", "None", forged]) + "\n"
    jobs = poller.parse_sacct(text, d)
    assert set(jobs) == {"2"} and jobs["2"].comment == forged

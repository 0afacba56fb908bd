"""The agent worker's queue: only the newest task waits, an export order goes first, a stop ends the wait."""

from __future__ import annotations

import threading

from nestling.edge.agent_jobs import AgentJobs, ExportJob, TrainJob
from nestling.messages import Task
from nestling.wire.export_messages import ExportOrder


def job(round_index: int, session: str = "s1") -> TrainJob:
    task = Task(round_index, "board", {}, {}, "plain", task_id=f"r{round_index}-{session}")
    return TrainJob(task, session, received=float(round_index))


def test_a_newer_round_supersedes_a_queued_task_and_an_older_one_does_not() -> None:
    jobs = AgentJobs(threading.Event())
    jobs.offer_task(job(3))
    jobs.offer_task(job(2))  # a late task of a closed round
    jobs.offer_task(job(4))
    assert jobs.take() == job(4)
    jobs.offer_task(job(5))
    jobs.offer_task(job(1, session="s2"))  # a restarted server counts rounds afresh: its task wins
    assert jobs.take() == job(1, session="s2")


def test_an_export_order_is_taken_before_a_queued_task() -> None:
    jobs = AgentJobs(threading.Event())
    order = ExportOrder("board", 9, "export-r9-board", "full", spec={}, weights={})
    jobs.offer_task(job(9))
    jobs.offer_export(ExportJob(order, "s1"))
    assert jobs.take() == ExportJob(order, "s1")
    assert jobs.take() == job(9)


def test_a_stop_ends_a_waiting_take_and_leaves_queued_jobs_untaken() -> None:
    stopping = threading.Event()
    jobs = AgentJobs(stopping)
    taken: list[object] = []
    worker = threading.Thread(target=lambda: taken.append(jobs.take()))
    worker.start()
    stopping.set()
    jobs.wake()
    worker.join(2.0)
    assert not worker.is_alive() and taken == [None]
    jobs.offer_task(job(1))
    assert jobs.take() is None

"""`stop_jobs_of_departed`: only people the hub answers 404 for lose their jobs.

The hub's API is a stand-in here (its real answers, a deletion through the hub's API, are in
tests/app/test_jobs_api.py); the jobs are a stand-in backend that records what was stopped."""

import asyncio

from tornado.httpclient import HTTPClientError

from gpulab.hub.service.reconciler import stop_jobs_of_departed


class Directory:
    def __init__(self, listed, lookup, reads_all=True):
        self.listed, self.lookup, self.asked = listed, lookup, []
        self.reads_all = reads_all

    async def reads_every_user(self):
        return self.reads_all

    async def users(self):
        if isinstance(self.listed, Exception):
            raise self.listed
        return [{"name": n, "groups": [], "admin": False} for n in self.listed]

    async def gone(self, name):
        self.asked.append(name)
        answer = self.lookup[name]
        if isinstance(answer, Exception):
            raise answer
        return answer


class Jobs:
    unavailable = None

    def __init__(self, owners):
        self.owners, self.stopped = owners, []

    def active_owners(self):
        return list(self.owners)

    async def stop(self, user, name, actor=None, reason=None):
        self.stopped.append((user, name, reason))


def test_only_a_404_from_the_hub_stops_a_persons_jobs():
    jobs = Jobs([("ann", "a"), ("dora", "d1"), ("dora", "d2"), ("new", "n")])
    # dora was deleted; "new" signed up after the list was read: the lookup finds them
    hub = Directory(["ann"], {"dora": True, "new": False})
    assert asyncio.run(stop_jobs_of_departed(jobs, hub)) == [("dora", "d1"), ("dora", "d2")]
    assert jobs.stopped == [("dora", "d1", "stopped: dora's account was deleted"),
                            ("dora", "d2", "stopped: dora's account was deleted")]
    assert sorted(hub.asked) == ["dora", "new"]  # once each, listed people not at all


def test_a_hub_that_cannot_answer_stops_nothing():
    jobs = Jobs([("dora", "d1")])
    for hub in (Directory(HTTPClientError(503), {}),
                Directory([], {"dora": HTTPClientError(500)}),
                Directory([], {"dora": ConnectionRefusedError()}),
                # a role that sees only some people: the hub's 404 may mean "not yours"
                Directory([], {"dora": True}, reads_all=False)):
        assert asyncio.run(stop_jobs_of_departed(jobs, hub)) is None
    assert jobs.stopped == []


def test_no_job_no_question_to_the_hub():
    hub = Directory(HTTPClientError(503), {})
    assert asyncio.run(stop_jobs_of_departed(Jobs([]), hub)) == []

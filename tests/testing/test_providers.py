"""``FakeProvider.of_run``: a run's keys, from lists that grow and get replaced."""

from __future__ import annotations

from stopline.testing import FakeProvider


def test_a_runs_keys_are_those_under_its_id_even_with_slashes_in_ids() -> None:
    provider = FakeProvider("p")
    provider.effects.extend(["a/1", "a/b/2", "ab/3", "a"])
    assert provider.of_run("effects", "a") == ["a/1", "a/b/2"]
    assert provider.of_run("effects", "a/b") == ["a/b/2"]  # a run id may hold "/"
    assert provider.of_run("effects", "ab") == ["ab/3"]
    assert provider.of_run("effects", "b") == []
    assert provider.of_run("requests", "a") == []  # each list its own


def test_a_runs_keys_follow_the_list_as_it_grows_shrinks_or_is_replaced() -> None:
    provider = FakeProvider("p")
    provider.requests.append("a/1")
    assert provider.of_run("requests", "a") == ["a/1"]
    provider.requests.extend(["b/1", "a/1"])  # a request seen twice
    assert provider.of_run("requests", "a") == ["a/1", "a/1"]
    provider.requests = ["a/2"]  # replaced (a provider loading its truth from a file)
    assert provider.of_run("requests", "a") == ["a/2"]
    provider.requests.clear()
    assert provider.of_run("requests", "a") == []

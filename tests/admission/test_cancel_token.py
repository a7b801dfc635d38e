"""CancelToken: one flag, one-shot hooks, no lost or doubled hook under a race."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrox_batch.cancel import CancelToken


def test_a_hook_runs_when_the_token_is_cancelled():
    token = CancelToken()
    calls: list[str] = []
    token.on_cancel(lambda: calls.append("a"))
    assert calls == [] and not token.is_cancelled()
    token.cancel()
    assert calls == ["a"] and token.is_cancelled()


def test_a_hook_registered_after_cancel_runs_immediately():
    token = CancelToken()
    token.cancel()
    calls: list[int] = []
    token.on_cancel(lambda: calls.append(1))
    assert calls == [1]


def test_a_hook_runs_once_however_often_the_token_is_cancelled():
    token = CancelToken()
    calls: list[int] = []
    token.on_cancel(lambda: calls.append(1))
    token.cancel()
    token.cancel()
    token.cancel()
    assert calls == [1]


def test_hooks_run_in_registration_order_on_the_cancelling_thread():
    token = CancelToken()
    seen: list[tuple[int, str]] = []
    for i in range(3):
        token.on_cancel(lambda i=i: seen.append((i, threading.current_thread().name)))
    worker = threading.Thread(target=token.cancel, name="canceller")
    worker.start()
    worker.join()
    assert seen == [(0, "canceller"), (1, "canceller"), (2, "canceller")]


def test_a_hook_may_use_the_token_without_deadlocking():
    token = CancelToken()
    nested: list[bool] = []
    token.on_cancel(lambda: nested.append(token.is_cancelled()))
    token.on_cancel(lambda: token.on_cancel(lambda: nested.append(True)))
    token.cancel()
    assert nested == [True, True]


def test_a_non_callable_hook_is_refused():
    with pytest.raises(TypeError, match="callable"):
        CancelToken().on_cancel(42)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(hooks_before=st.integers(0, 3), racing=st.integers(1, 6))
def test_a_hook_registered_while_another_thread_cancels_runs_exactly_once(hooks_before, racing):
    token = CancelToken()
    counts = [0] * (hooks_before + racing)
    lock = threading.Lock()

    def hook(i: int):
        def run() -> None:
            with lock:
                counts[i] += 1

        return run

    for i in range(hooks_before):
        token.on_cancel(hook(i))
    barrier = threading.Barrier(racing + 2)

    def register(i: int) -> None:
        barrier.wait()
        token.on_cancel(hook(i))

    def cancel() -> None:
        barrier.wait()
        token.cancel()

    threads = [threading.Thread(target=register, args=(hooks_before + j,)) for j in range(racing)]
    threads += [threading.Thread(target=cancel), threading.Thread(target=cancel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == [1] * len(counts)
    token.cancel()
    assert counts == [1] * len(counts)

"""The model server asked once before a batch, against a real OpenAI-compatible server on
loopback (the scripted one), a port nobody listens on, and one that never answers."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.steps.submit.model_server import check_model_server
from tests.support.scripted_llm import ScriptedLLM

TOKENS = {"collect_rollout_details": True}


@pytest.fixture
def llm() -> Iterator[ScriptedLLM]:
    with ScriptedLLM(["first reply", "second reply"]) as server:
        yield server


def test_a_server_that_serves_the_model_with_tokens_passes_and_keeps_its_script(
    llm: ScriptedLLM,
) -> None:
    kwargs = {"api_base": llm.url, **TOKENS}
    assert check_model_server(f"openai/{llm.model}", kwargs, {}) == llm.url
    assert len(llm.checks) == 1 and llm.exchanges == []  # the agent's turns are untouched
    asked = llm.checks[0]
    assert asked["logprobs"] is True and asked["return_token_ids"] is True
    assert asked["max_tokens"] == 1


def test_nothing_is_asked_without_a_server_of_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_BASE_URL", "OPENAI_API_BASE"):
        monkeypatch.delenv(name, raising=False)
    assert check_model_server("anthropic/claude", {}, {}) is None
    assert check_model_server(None, {"api_base": "http://127.0.0.1:9/v1"}, {}) is None


def test_the_base_url_from_the_environment_as_litellm_reads_it(
    llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", llm.url + "/")
    assert check_model_server(f"openai/{llm.model}", {}, {}) == llm.url


def test_a_server_that_is_not_there_is_named_at_once() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
    began = time.monotonic()
    with pytest.raises(
        InputError, match=r"at http://127\.0\.0\.1:\d+/v1 does not answer"
    ) as raised:
        check_model_server("openai/policy", {"api_base": url}, {})
    assert time.monotonic() - began < 5
    assert raised.value.message.endswith("does not answer: Connection refused")
    assert raised.value.hint is not None and "api_base" in raised.value.hint


def test_a_server_that_never_answers_is_given_up_on_in_one_bounded_wait() -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        began = time.monotonic()
        with pytest.raises(InputError, match="did not answer GET /models within 2 s"):
            check_model_server("openai/policy", {"api_base": url}, {}, timeout_s=2)
        assert time.monotonic() - began < 6


def test_a_model_the_server_does_not_serve_is_named_with_those_it_does(llm: ScriptedLLM) -> None:
    with pytest.raises(InputError, match=r"does not serve 'policy'.*it serves: scripted") as raised:
        check_model_server("openai/policy", {"api_base": llm.url}, {})
    assert raised.value.hint == "--model openai/scripted"


def test_a_server_without_token_ids_is_refused_only_where_the_run_collects_them() -> None:
    with ScriptedLLM(["reply"], token_ids=False) as llm:
        with pytest.raises(InputError, match=r"sent no prompt_token_ids, choices\[0\]\.token_ids"):
            check_model_server(f"openai/{llm.model}", {"api_base": llm.url, **TOKENS}, {})
        without = {"api_base": llm.url, "collect_rollout_details": False}
        assert check_model_server(f"openai/{llm.model}", without, {}) == llm.url


def test_the_agents_key_is_the_one_asked_with(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with ScriptedLLM(["reply"], api_key="right") as llm:
        model, kwargs = f"openai/{llm.model}", {"api_base": llm.url}
        with pytest.raises(InputError, match=r"refused the key \(HTTP 401\)") as raised:
            check_model_server(model, kwargs, {"OPENAI_API_KEY": "wrong"})
        assert raised.value.hint is not None and "--agent-env OPENAI_API_KEY" in raised.value.hint
        assert check_model_server(model, kwargs, {"OPENAI_API_KEY": "right"}) == llm.url
        monkeypatch.setenv("OPENAI_API_KEY", "right")  # what --agent-env NAME passes on
        assert check_model_server(model, kwargs, {}) == llm.url

"""The model server an agent will call, asked once before a batch: does it answer at its URL,
does it serve the model, and does it send what the run needs (token ids and logprobs)?

Without this, every trial of a batch fails the same way, one after the other, each after
litellm's own retries (50-75 s), and a trainer reads them as failures of the agent. Asked here,
the mistake is named once, with the URL, before anything is queued.

The URL is the agent's `api_base` kwarg (terminus-2 and Harbor's LiteLLM agents take it), else
$OPENAI_BASE_URL / $OPENAI_API_BASE for `openai/` models as litellm reads them; a model with
neither goes to its provider's hosted API, which this does not ask. The key is the one the
agent gets ($OPENAI_API_KEY from `--agent-env`, or this process's environment).

The request carries CHECK_HEADER, which servers ignore; the scripted test server keeps such
requests out of the turns it counts.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from typing import Any

import requests

from harbor_hpc.core.errors import InputError
from harbor_hpc.steps.submit.options import ROLLOUT_KWARG

# One bounded wait for the whole check: a server loading its weights answers late, one that is
# not there fails at once.
CHECK_TIMEOUT_S = 30.0
CHECK_HEADER = "X-Harbor-Hpc-Check"
KEY_VARIABLE = "OPENAI_API_KEY"
BASE_VARIABLES = ("OPENAI_BASE_URL", "OPENAI_API_BASE")
FIX_URL = "start the server (or wait until it serves), or fix --agent-kwarg api_base"


def server_url(model: str | None, agent_kwargs: Mapping[str, Any]) -> str | None:
    """Where the agent's model calls go, where that is a server of the user's; else None."""
    base = agent_kwargs.get("api_base")
    if base:
        return str(base).rstrip("/")
    if model and model.startswith("openai/"):
        for name in BASE_VARIABLES:
            if os.environ.get(name):
                return os.environ[name].rstrip("/")
    return None


def served_name(model: str) -> str:
    """The name the server knows: litellm's provider prefix (`openai/`, `hosted_vllm/`) off."""
    return model.split("/", 1)[1] if "/" in model else model


def check_route(model: str | None, agent_kwargs: Mapping[str, Any]) -> None:
    """Refuse a model name that litellm (the agent's client) cannot route to the user's server:
    without a provider prefix every call fails in the agent, after its retries, in every trial,
    though the server itself may serve that very name."""
    url = server_url(model, agent_kwargs)
    if url is None or not model:
        return
    import litellm

    quiet, litellm.suppress_debug_info = litellm.suppress_debug_info, True
    try:
        litellm.get_llm_provider(model=model, api_base=url)
    except Exception as exc:  # litellm's BadRequestError, or whatever its routing raises
        said = " ".join(str(exc).split())[:160]
        raise InputError(
            f"--model {model}: litellm, the agent's model client, cannot route it to {url} "
            f"({said})",
            hint=f"name the provider: --model openai/{model} for an OpenAI-compatible server "
            "(vLLM, SGLang)",
        ) from None
    finally:
        litellm.suppress_debug_info = quiet


def check_model_server(
    model: str | None,
    agent_kwargs: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> str | None:
    """Refuse (InputError) a model server that does not answer, does not serve `model`, refuses
    the key, or sends no token ids or logprobs where the run collects them; returns the URL it
    asked, or None when there is no server of the user's to ask. `env`: the agent's variables."""
    url = server_url(model, agent_kwargs)
    if url is None or not model:
        return None
    key = env.get(KEY_VARIABLE) or os.environ.get(KEY_VARIABLE)
    headers = {CHECK_HEADER: "1", **({"Authorization": f"Bearer {key}"} if key else {})}
    deadline = time.monotonic() + timeout_s
    name = served_name(model)

    def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        left = max(0.5, deadline - time.monotonic())
        try:
            response = requests.request(
                method, f"{url}{path}", json=body, headers=headers, timeout=left
            )
        except requests.Timeout:
            raise InputError(
                f"the model server at {url} did not answer {method} {path} within "
                f"{timeout_s:.0f} s",
                hint=FIX_URL,
            ) from None
        except requests.RequestException as exc:
            raise InputError(
                f"the model server at {url} does not answer: {_reason(exc)}", hint=FIX_URL
            ) from None
        if response.status_code in (401, 403):
            raise InputError(
                f"the model server at {url} refused the key (HTTP {response.status_code})",
                hint=f"give the agent its key: export {KEY_VARIABLE}=... and "
                f"--agent-env {KEY_VARIABLE}",
            )
        if response.status_code == 404 and path == "/models":
            return None  # a server without the list; the completion below still tells
        if response.status_code >= 400:
            raise InputError(
                f"the model server at {url} answered {method} {path} with HTTP "
                f"{response.status_code}: {_said(response)}",
                hint=f"check --model {model} and the server's settings",
            )
        try:
            return response.json()
        except ValueError:
            raise InputError(
                f"{url}{path} did not answer as an OpenAI-compatible server (not JSON)",
                hint=FIX_URL,
            ) from None

    listed = call("GET", "/models")
    served = [
        str(entry.get("id"))
        for entry in (listed or {}).get("data") or []
        if isinstance(entry, dict) and entry.get("id")
    ]
    if listed is not None and name not in served:
        raise InputError(
            f"the model server at {url} does not serve {name!r} (--model {model}); it serves: "
            + (", ".join(served) or "nothing"),
            hint=f"--model openai/{served[0]}" if len(served) == 1 else "fix --model",
        )
    tokens = agent_kwargs.get(ROLLOUT_KWARG) is True
    body: dict[str, Any] = {
        "model": name,
        "messages": [{"role": "user", "content": "Say OK."}],
        "max_tokens": 1,
    }
    if tokens:  # as Harbor's LiteLLM asks for them (harbor/llms/lite_llm.py)
        body |= {"logprobs": True, "return_token_ids": True}
    reply = call("POST", "/chat/completions", body)
    choices = (reply or {}).get("choices") or []
    if not choices:
        raise InputError(f"the model server at {url} sent no completion for {name!r}")
    if tokens:
        choice = choices[0]
        missing = [
            what
            for what, present in (
                ("prompt_token_ids", reply.get("prompt_token_ids") is not None),
                ("choices[0].token_ids", choice.get("token_ids") is not None),
                ("choices[0].logprobs", bool((choice.get("logprobs") or {}).get("content"))),
            )
            if not present
        ]
        if missing:
            raise InputError(
                f"the model server at {url} sent no {', '.join(missing)} when asked "
                "(logprobs, return_token_ids): the run collects them for training",
                hint="serve the model with vLLM 0.10.2 or newer (its OpenAI server returns "
                f"them); or --agent-kwarg {ROLLOUT_KWARG}=false for a run without tokens",
            )
    return url


def _reason(exc: requests.RequestException) -> str:
    """The system's words, not urllib3's retry wrapper: 'Connection refused', a DNS miss."""
    text = str(exc)
    said = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    return said.group(1).strip() if said else text


def _said(response: requests.Response) -> str:
    try:
        error = response.json().get("error")
    except ValueError:
        return response.text[:200]
    if isinstance(error, dict):
        return str(error.get("message"))[:200]
    return str(error)[:200]

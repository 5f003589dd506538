"""A scripted OpenAI-compatible chat model for tests: fixed replies with vLLM-style token data.

It answers what litellm's `openai/<model>` provider sends with `api_base=<server>.url`:
`POST /v1/chat/completions` (not streamed; Harbor's LiteLLM refuses streams anyway) and, for
manual pokes, `GET /v1/models`. The n-th request gets the n-th reply of the script (the last
one again once the script is used up); with `each_conversation` (the command line's way), a
request whose history holds n assistant replies gets reply n instead, so that every conversation
gets the whole script, in order, however many run at once. Like vLLM's OpenAI server, a request with
`"logprobs": true` gets `choices[0].logprobs.content[]` (token, logprob, bytes, top_logprobs)
and one with `"return_token_ids": true` gets `prompt_token_ids` (top level) and
`choices[0].token_ids`: what Harbor's LiteLLM reads when `collect_rollout_details=True`.
Like vLLM, it answers a request for a model it does not serve with 404 (`NotFoundError`); with
`api_key`, one without that key with 401; with `token_ids=False` it sends no token ids, as
servers other than vLLM do.
harbor-hpc's check before a batch (header `X-Harbor-Hpc-Check`) is answered like any request
but kept in `checks`, apart from the script's turns.

`faults` make it misbehave as real servers do, per conversation: a conversation whose messages
hold `[fault:NAME]` (a task's instruction) meets `faults[NAME]` once `after` replies have been
answered in it: it hangs, answers late, answers an HTTP error (500, 429, vLLM's context-length
400), closes the connection mid-response, sends a body that is not JSON, drops the token ids
and logprobs (a server restarted without them), always gives one reply, or gives a script of
its own (a policy of that conversation's, as a batch of several tasks needs).

Tokens are UTF-8 bytes, so ids are reproducible and decode back to text: the completion's ids
are the reply's bytes, the prompt's are those of `render_prompt(messages)`. Every exchange is
kept in `ScriptedLLM.exchanges` for a test to compare with what Harbor recorded.

The template renders the history as it was said, so each prompt extends the one before plus its
completion, token for token, as vLLM's do for a plain chat template. With `rewrite_history` it
renders earlier replies with their whitespace collapsed, as templates that strip reasoning or
normalise replies do: later prompts then no longer extend what came before (the drift a
rollout's `contiguous: false` reports).

    with ScriptedLLM(["first reply", {"analysis": "...", ...}]) as llm:
        ...  # point the agent at llm.url, model "openai/" + llm.model

    python -m tests.support.scripted_llm --script replies.json --port 8000
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Self, cast

from harbor_hpc.steps.submit.model_server import CHECK_HEADER

log = logging.getLogger(__name__)

Reply = str | Mapping[str, Any]


def render_prompt(messages: Sequence[Mapping[str, Any]], *, rewrite_history: bool = False) -> str:
    """The chat template: what the prompt's token ids are the bytes of."""
    parts = []
    for message in messages:
        content = message.get("content") or ""
        if not isinstance(content, str):  # a list of content parts
            content = "".join(str(part.get("text", "")) for part in content)
        role = message.get("role", "user")
        if rewrite_history and role == "assistant":
            content = " ".join(content.split())
        parts.append(f"<|{role}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


def _text(reply: Reply) -> str:
    return reply if isinstance(reply, str) else json.dumps(reply, indent=2)


def encode(text: str) -> list[int]:
    return list(text.encode())


def token_text(token_id: int) -> str:
    return chr(token_id) if token_id < 0x80 else f"bytes:\\x{token_id:02x}"


def logprob_of(position: int, token_id: int) -> float:
    """A made-up but reproducible logprob, exact in binary so JSON round-trips it."""
    return -((position + token_id) % 16 + 1) / 64


@dataclass(frozen=True)
class Fault:
    """What the server does in a conversation that names it, from its reply `after` on."""

    after: int = 0
    hang: bool = False  # never answer (until the server stops)
    delay_s: float = 0.0  # answer this late
    status: int | None = None  # answer this HTTP error (500, 429)
    context_exceeded: bool = False  # vLLM's 400 for a prompt longer than the model takes
    close: bool = False  # close the connection halfway through the answer
    malformed: bool = False  # a 200 whose body is not JSON
    no_tokens: bool = False  # answer without token ids and logprobs
    reply: Reply | None = None  # answer this, whatever the script says
    script: Sequence[Reply] = ()  # answer these in turn (the last once used up): a policy's own

    def met(self, turn: int) -> bool:
        return turn >= self.after


CONTEXT_EXCEEDED = (
    "This model's maximum context length is 4096 tokens. However, you requested 5120 tokens "
    "(4096 in the messages, 1024 in the completion). Please reduce the length of the messages "
    "or completion."
)
_FAULT_TAG = re.compile(r"\[fault:([a-z0-9_-]+)\]")


@dataclass
class Exchange:
    """One request and what was sent back."""

    request: dict[str, Any]
    reply: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    response: dict[str, Any]


class ScriptedLLM:
    """The server; a context manager that serves on 127.0.0.1 from a thread."""

    def __init__(
        self,
        script: Sequence[Reply],
        *,
        model: str = "scripted",
        port: int = 0,
        rewrite_history: bool = False,
        each_conversation: bool = False,
        token_ids: bool = True,
        api_key: str | None = None,
        faults: Mapping[str, Fault] | None = None,
    ) -> None:
        if not script:
            raise ValueError("the script needs at least one reply")
        self.replies = [_text(reply) for reply in script]
        self.model = model
        self.rewrite_history = rewrite_history
        self.each_conversation = each_conversation
        self.token_ids = token_ids
        self.api_key = api_key
        self.faults = dict(faults or {})
        self.stopping = threading.Event()
        self.exchanges: list[Exchange] = []
        self.checks: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._http = _Server(("127.0.0.1", port), _Handler)
        self._http.llm = self
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._http.server_address[1])

    @property
    def url(self) -> str:
        """The `api_base` for litellm."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()  # what hangs ends
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def fault(self, request: dict[str, Any]) -> tuple[Fault, int] | None:
        """The fault `request`'s conversation names, and its turn there, when it is met."""
        messages = request.get("messages") or []
        for message in messages:
            found = _FAULT_TAG.search(str(message.get("content") or ""))
            if found and found.group(1) in self.faults:
                fault = self.faults[found.group(1)]
                turn = sum(1 for message in messages if message.get("role") == "assistant")
                return (fault, turn) if fault.met(turn) else None
        return None

    def complete(
        self, request: dict[str, Any], *, check: bool = False, fault: Fault | None = None
    ) -> dict[str, Any]:
        """The chat completion answering `request`, recorded in `exchanges` (in `checks`, and
        answered with the script's first reply, for harbor-hpc's check)."""
        with self._lock:
            messages = request.get("messages") or []
            if check:
                self.checks.append(request)
                turn = 0
            elif self.each_conversation:
                turn = sum(1 for message in messages if message.get("role") == "assistant")
            else:
                turn = len(self.exchanges)
            reply = self.replies[min(turn, len(self.replies) - 1)]
            if fault is not None and fault.script:
                said = sum(1 for message in messages if message.get("role") == "assistant")
                reply = _text(fault.script[min(said - fault.after, len(fault.script) - 1)])
            if fault is not None and fault.reply is not None:
                reply = _text(fault.reply)
            tokens = self.token_ids and not (fault is not None and fault.no_tokens)
            prompt_ids = encode(render_prompt(messages, rewrite_history=self.rewrite_history))
            completion_ids = encode(reply)
            logprobs = [logprob_of(i, t) for i, t in enumerate(completion_ids)]
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": reply},
                "finish_reason": "stop",
                "logprobs": None,
            }
            response: dict[str, Any] = {
                "id": f"chatcmpl-scripted-{len(self.exchanges)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": request.get("model") or self.model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": len(completion_ids),
                    "total_tokens": len(prompt_ids) + len(completion_ids),
                },
            }
            if request.get("logprobs") and tokens:
                top = int(request.get("top_logprobs") or 0)
                choice["logprobs"] = {
                    "content": [_logprob_entry(i, t, top) for i, t in enumerate(completion_ids)]
                }
            if request.get("return_token_ids") and tokens:
                response["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = completion_ids
            if not check:
                self.exchanges.append(
                    Exchange(request, reply, prompt_ids, completion_ids, logprobs, response)
                )
            return response


def _logprob_entry(position: int, token_id: int, top: int) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(token), "logprob": logprob, "bytes": [token]}

    # The sampled token ranks first; made-up runners-up follow (OpenAI allows up to 20).
    logprob = logprob_of(position, token_id)
    ranked = [entry((token_id + k) % 256, logprob - k) for k in range(min(top, 20))]
    return {**entry(token_id, logprob), "top_logprobs": ranked}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    llm: ScriptedLLM


class _Handler(BaseHTTPRequestHandler):
    def _refused(self, llm: ScriptedLLM) -> bool:
        if llm.api_key is None or self.headers.get("Authorization") == f"Bearer {llm.api_key}":
            return False
        self._send(401, _error("Incorrect API key provided", 401))
        return True

    def do_GET(self) -> None:
        llm = cast(_Server, self.server).llm
        if self._refused(llm):
            return
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            model = {"id": llm.model, "object": "model", "owned_by": "scripted"}
            self._send(200, {"object": "list", "data": [model]})
        else:
            self._send(404, _error(f"no route GET {self.path}"))

    def do_POST(self) -> None:
        llm = cast(_Server, self.server).llm
        if self._refused(llm):
            return
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            self._send(404, _error(f"no route POST {self.path}"))
            return
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except json.JSONDecodeError as exc:
            self._send(400, _error(f"the body is not JSON: {exc}"))
            return
        if request.get("stream"):
            self._send(400, _error("stream=true is not supported by the scripted server"))
            return
        if request.get("model") not in (None, llm.model):  # as vLLM's OpenAI server answers
            self._send(404, _error(f"The model `{request['model']}` does not exist.", 404))
            return
        check = bool(self.headers.get(CHECK_HEADER))
        met = None if check else llm.fault(request)
        if met is None:
            self._send(200, llm.complete(request, check=check))
            return
        fault, turn = met
        if fault.hang:
            llm.stopping.wait()
            return
        if fault.delay_s and llm.stopping.wait(fault.delay_s):
            return
        if fault.status is not None:
            self._send(fault.status, _error(f"scripted fault at turn {turn}", fault.status))
        elif fault.context_exceeded:
            self._send(400, _error(CONTEXT_EXCEEDED, 400))
        elif fault.malformed:
            self._send_bytes(200, b'{"id": "chatcmpl-x", "choices": [{"index": 0, "mess')
        elif fault.close:
            body = json.dumps(llm.complete(request, fault=fault)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        else:
            self._send(200, llm.complete(request, fault=fault))

    def _send(self, status: int, body: dict[str, Any]) -> None:
        self._send_bytes(status, json.dumps(body).encode())

    def _send_bytes(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def _error(message: str, code: int | None = None) -> dict[str, Any]:
    kind = {
        404: "NotFoundError",
        401: "AuthenticationError",
        400: "BadRequestError",
        429: "RateLimitError",
        500: "InternalServerError",
    }.get(code or 0, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code}}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--script", type=Path, required=True, help="JSON list of replies")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--model", default="scripted")
    args = parser.parse_args(argv)
    script = json.loads(args.script.read_text())
    with ScriptedLLM(script, model=args.model, port=args.port, each_conversation=True) as llm:
        print(
            f"serving {len(llm.replies)} replies at {llm.url} (model openai/{llm.model})",
            flush=True,
        )
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print(f"{len(llm.exchanges)} requests answered", flush=True)


if __name__ == "__main__":
    main()

from __future__ import annotations

from typing import Any

import pytest

from harbor_hpc.images.dockerfile import (
    DEFAULT_PATH,
    Copy,
    FinalImageCopies,
    Run,
    Workdir,
    logical_lines,
    read_dockerfile,
)


def final_image_copies(text: str) -> FinalImageCopies:
    return read_dockerfile(text).final


def copies(final: FinalImageCopies) -> list[tuple[str, tuple[str, ...], str, bool, Any, Any]]:
    """What setup-sh replays of each copy."""
    return [
        (c.instruction, c.sources, c.dest, c.dest_is_dir, c.chown, c.chmod) for c in final.copies
    ]


def test_logical_lines_join_continuations_and_drop_comments() -> None:
    text = "FROM a\n# note\nRUN echo 1 \\\n  # inside\n  && echo 2\n\nCOPY x /y\n"
    assert logical_lines(text) == ["FROM a", "RUN echo 1 && echo 2", "COPY x /y"]


def test_final_stage_copies_with_workdir_env_flags_and_json_form() -> None:
    text = """\
FROM local/debian:bookworm AS builder
COPY build.sh /b/
FROM builder AS base
ARG APP=/srv/app
WORKDIR $APP
COPY --chown=1000:1000 main.py ./
ENV CONF=${APP}/conf
COPY conf $CONF
ADD --chmod=755 ["data.tar.gz", "tools/*.sh", "bin/"]
FROM base
COPY --link solo.txt renamed.txt
"""
    final = final_image_copies(text)
    assert final.problems == []
    assert copies(final) == [
        ("COPY", ("build.sh",), "/b", True, None, None),
        ("COPY", ("main.py",), "/srv/app", True, "1000:1000", None),
        ("COPY", ("conf",), "/srv/app/conf", False, None, None),
        ("ADD", ("data.tar.gz", "tools/*.sh"), "/srv/app/bin", True, None, "755"),
        # A stage FROM an earlier one keeps its WORKDIR, as in Docker.
        ("COPY", ("solo.txt",), "/srv/app/renamed.txt", False, None, None),
    ]


def test_only_the_final_stage_and_its_ancestors_count() -> None:
    text = "FROM a AS build\nCOPY src /src\nFROM b\nCOPY --from=build /out /out\nCOPY x /x\n"
    final = final_image_copies(text)
    assert [copy.sources for copy in final.copies] == [("x",)]
    assert final.problems == ["COPY --from=build"]


def test_what_cannot_be_replayed_is_named() -> None:
    text = "FROM a\nADD https://example.org/f.tgz /f\nCOPY <<EOF /x\nhi\nEOF\nCOPY $NOPE /y\n"
    problems = final_image_copies(text).problems
    assert problems[0] == "ADD https://example.org/f.tgz: a remote source"
    assert problems[1] == "COPY with a heredoc"
    assert "$NOPE has no value" in problems[2]


def test_sources_outside_context() -> None:
    text = "FROM a\nCOPY ../shared/lib.py /lib.py\nCOPY ok/../fine.txt /f\nADD x/../../up /u\n"
    assert read_dockerfile(text).outside == ["COPY ../shared/lib.py", "ADD x/../../up"]


def test_build_args_expand_the_args_that_take_them() -> None:
    text = """\
ARG BASE=debian:bookworm
FROM $BASE AS build
ARG SRC=app DEST
ARG QUOTED="a b"
COPY $SRC /opt/$DEST/
FROM build
ARG UP=ok
COPY ${UP}/x /x
"""
    plain = read_dockerfile(text)
    assert plain.args == {"BASE", "SRC", "DEST", "QUOTED", "UP"}
    assert plain.final.problems == ["COPY $SRC /opt/$DEST/: $DEST has no value in the Dockerfile"]
    assert plain.outside == []
    given = read_dockerfile(text, {"DEST": "d", "UP": "..", "UNUSED": "1"})
    assert given.final.problems == []
    assert copies(given.final)[0] == ("COPY", ("app",), "/opt/d", True, None, None)
    assert given.outside == ["COPY ../x"]  # a build arg can point a COPY out of the context


def test_absolute_sources_are_the_contexts_root() -> None:
    assert read_dockerfile("FROM a\nCOPY /app.py /x\n").outside == []


# ---- every stage in order, as the Apptainer builder replays it ------------------------------

BASE_CONFIG = {
    "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
    "Cmd": ["python3"],
    "WorkingDir": "",
    "Image": "sha256:" + "0" * 64,
}
MULTI_STAGE = """\
# syntax=docker/dockerfile:1
ARG BASE=reg.example/py:3
ARG GREETING=hi
FROM ${BASE} AS builder
ARG GREETING
ENV OUT=/out VENV="/opt/venv"
ENV PATH=$VENV/bin:$PATH
WORKDIR $OUT
RUN echo "$GREETING" > greeting && \\
    touch built
RUN ["/bin/echo", "exec form"]
FROM builder AS tested
RUN test -f built
FROM ${BASE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=builder --chown=app:app /out/ /srv/
COPY --from=0 /out/greeting .
COPY --from=reg.example/tools:1 /bin/tool /usr/local/bin/tool
USER app
WORKDIR srv
RUN cat greeting | wc -c
LABEL org.example.name="multi stage" version=1
EXPOSE 8080 53/udp
ENTRYPOINT ["/srv/entry.sh"]
HEALTHCHECK --interval=1m30s --retries=5 CMD ["/srv/ready", "--quick"]
"""


def test_stages_keep_their_instructions_in_order_with_what_docker_runs_them_with() -> None:
    bases = {"reg.example/py:3": BASE_CONFIG, "reg.example/tools:1": {}}
    dockerfile = read_dockerfile(MULTI_STAGE, {"GREETING": "hello"}, bases)
    builder, tested, final = dockerfile.stages
    assert (builder.name, builder.base, builder.parent, builder.line) == (
        "builder", "reg.example/py:3", None, 4,
    )  # fmt: skip
    assert (tested.base, tested.parent) == ("builder", 0)
    assert (final.name, final.parent) == (None, None)
    assert dockerfile.images() == ["reg.example/py:3", "reg.example/tools:1"]
    assert all(stage.problems == [] for stage in dockerfile.stages), dockerfile.stages

    workdir, shell_run, exec_run = builder.steps
    assert workdir == Workdir(8, "/out")
    assert isinstance(shell_run, Run) and isinstance(exec_run, Run)
    env = dict(shell_run.env)
    assert env["PATH"] == "/opt/venv/bin:/usr/local/bin:/usr/bin:/bin"
    assert env["GREETING"] == "hello" and env["LANG"] == "C.UTF-8" and env["OUT"] == "/out"
    assert shell_run.argv == ("/bin/sh", "-c", 'echo "$GREETING" > greeting && touch built')
    assert (shell_run.line, shell_run.workdir, shell_run.user) == (9, "/out", "")
    assert exec_run.argv == ("/bin/echo", "exec form")
    # A stage FROM another starts from its config; its ARGs stay behind.
    [inherited] = tested.steps
    assert isinstance(inherited, Run) and inherited.workdir == "/out"
    assert "GREETING" not in dict(inherited.env)

    chowned, by_index, from_image, workdir, run = final.steps
    assert chowned == Copy(
        "COPY", ("/out/",), "/srv", True, "app:app", None, "builder", 16, dest_slash=True
    )
    assert isinstance(by_index, Copy) and isinstance(from_image, Copy)
    assert (by_index.from_stage, by_index.dest, by_index.dest_slash) == ("0", "/", True)
    assert dockerfile.source_stage("0", 2) is builder
    assert dockerfile.source_stage("reg.example/tools:1", 2) is None
    assert (from_image.dest, from_image.dest_slash) == ("/usr/local/bin/tool", False)
    assert workdir == Workdir(20, "/srv")
    assert isinstance(run, Run) and run.user == "app" and run.workdir == "/srv"
    assert run.argv == ("/bin/bash", "-o", "pipefail", "-c", "cat greeting | wc -c")
    assert dict(run.env)["PATH"] == "/usr/local/bin:/usr/bin:/bin"

    assert final.config == {
        "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
        "Cmd": None,  # ENTRYPOINT without CMD drops the base's CMD
        "Entrypoint": ["/srv/entry.sh"],
        "WorkingDir": "/srv",
        "User": "app",
        "Shell": ["/bin/bash", "-o", "pipefail", "-c"],
        "Labels": {"org.example.name": "multi stage", "version": "1"},
        "ExposedPorts": {"8080/tcp": {}, "53/udp": {}},
        # As Docker records it: a compose service waited for as healthy runs it.
        "Healthcheck": {
            "Interval": 90 * 10**9,
            "Retries": 5,
            "Test": ["CMD", "/srv/ready", "--quick"],
        },
    }


@pytest.mark.parametrize(
    ("line", "recorded"),
    [
        ("HEALTHCHECK NONE", {"Test": ["NONE"]}),
        (
            "HEALTHCHECK --timeout=500ms --start-period=2s CMD curl -f localhost || exit 1",
            {"Timeout": 5 * 10**8, "StartPeriod": 2 * 10**9,
             "Test": ["CMD-SHELL", "curl -f localhost || exit 1"]},
        ),
    ],
)  # fmt: skip
def test_healthcheck_is_recorded_as_docker_records_it(line: str, recorded: dict[str, Any]) -> None:
    (stage,) = read_dockerfile(f"FROM scratch\n{line}\n").stages
    assert stage.config["Healthcheck"] == recorded


def test_shell_words_as_docker_reads_them() -> None:
    text = (
        "FROM scratch\n"
        # One line's values see the variables as they were before it, as in Docker.
        "ENV A=1 B=\"two words\" C='$A' D=\\$A E=${A:-x} F=${NONE:-x} G=${A:+set} H=${NONE:+set}\n"
        "ENV A=2 I=$A\n"
        "ENV LEGACY value with  spaces\n"
        "RUN true\n"
    )
    [stage] = read_dockerfile(text, base_configs={}).stages
    [run] = stage.steps
    assert isinstance(run, Run)
    assert dict(run.env) == {
        "A": "2", "B": "two words", "C": "$A", "D": "$A", "E": "x", "F": "x", "G": "",
        "H": "", "I": "1", "LEGACY": "value with  spaces", "PATH": DEFAULT_PATH,
    }  # fmt: skip


def test_what_the_builder_cannot_replay_is_named_with_its_line() -> None:
    text = (
        "FROM a\n"
        "RUN --mount=type=cache,target=/root/.cache pip install x\n"
        "RUN <<EOF\n"
        "echo inside a heredoc\n"
        "FROM not-an-instruction\n"
        "EOF\n"
        "ADD --checksum=sha256:00 f /f\n"
        "FETCH something\n"
        "RUN echo still read\n"
    )
    dockerfile = read_dockerfile(text, base_configs={"a": {}})
    [stage] = dockerfile.stages
    assert [str(problem) for problem in stage.problems] == [
        "line 2: RUN --mount=type=cache,target=/root/.cache",
        "line 3: RUN with a heredoc",
        "line 7: ADD --checksum",
        "line 8: FETCH: not a Dockerfile instruction",
    ]
    assert [step.line for step in stage.steps] == [9]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('FROM a\nENV A="open\n', 'line 2: ENV A="open: a double quote is never closed'),
        ("FROM a\nSHELL /bin/bash -c\n", "line 2: SHELL /bin/bash -c: SHELL takes the JSON form"),
        ("RUN true\nFROM a\n", "line 1: RUN before any FROM"),
    ],
)
def test_lines_that_do_not_parse_are_problems(text: str, problem: str) -> None:
    dockerfile = read_dockerfile(text, base_configs={"a": {}})
    found = [str(p) for p in dockerfile.problems + dockerfile.stages[0].problems]
    assert any(text.startswith(problem) for text in found), found

from __future__ import annotations

from harbor_hpc.images.dockerfile import Copy, FinalImageCopies, logical_lines, read_dockerfile


def final_image_copies(text: str) -> FinalImageCopies:
    return read_dockerfile(text).final


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
    assert final.copies == [
        Copy("COPY", ("build.sh",), "/b", True),
        Copy("COPY", ("main.py",), "/srv/app", True, chown="1000:1000"),
        Copy("COPY", ("conf",), "/srv/app/conf", False),
        Copy("ADD", ("data.tar.gz", "tools/*.sh"), "/srv/app/bin", True, chmod="755"),
        Copy("COPY", ("solo.txt",), "/renamed.txt", False),
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
    assert given.final.copies[0] == Copy("COPY", ("app",), "/opt/d", True)
    assert given.outside == ["COPY ../x"]  # a build arg can point a COPY out of the context

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from docker.utils.build import exclude_paths, tar

from harbor_hpc.images.context import FileDigests, context_files, context_hash


def make_context(root: Path, files: dict[str, str], dockerfile: str = "FROM base\n") -> Path:
    root.mkdir(parents=True)
    (root / "Dockerfile").write_text(dockerfile)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_identical_contexts_hash_alike_and_any_sent_change_differs(tmp_path: Path) -> None:
    files = {"app.py": "print(1)\n", "data/x.csv": "1,2\n"}
    a = make_context(tmp_path / "a", files)
    b = make_context(tmp_path / "b", files)
    os.utime(b / "app.py", (1, 1))  # mtimes do not count
    assert context_hash(a) == context_hash(b)

    c = make_context(tmp_path / "c", {**files, "app.py": "print(2)\n"})
    d = make_context(tmp_path / "d", {**files, "data/y.csv": "1,2\n"})
    e = make_context(tmp_path / "e", files, dockerfile="FROM other\n")
    f = make_context(tmp_path / "f", files)
    (f / "app.py").chmod(0o755)
    hashes = {context_hash(path) for path in (a, c, d, e, f)}
    assert len(hashes) == 5


def test_dockerignored_files_do_not_count(tmp_path: Path) -> None:
    ignore = {".dockerignore": "*.log\ncache/\n!cache/keep.txt\n"}
    a = make_context(tmp_path / "a", {**ignore, "app.py": "x", "run.log": "one", "cache/k": "1"})
    b = make_context(tmp_path / "b", {**ignore, "app.py": "x", "run.log": "two", "cache/k": "2"})
    assert context_hash(a) == context_hash(b)
    (b / "cache" / "keep.txt").write_text("re-included")
    assert context_hash(a) != context_hash(b)


def test_file_list_is_what_docker_py_sends(tmp_path: Path) -> None:
    context = make_context(
        tmp_path / "ctx",
        {
            ".dockerignore": "# comment\nsecret*\nbuild/\n!build/out.bin\nDockerfile\n",
            "secret.txt": "s",
            "src/main.py": "m",
            "build/tmp.o": "o",
            "build/out.bin": "b",
        },
    )
    (context / "link").symlink_to("/etc/hostname")
    with tarfile.open(fileobj=tar(str(context), exclude=_patterns(context))) as archive:
        sent = sorted(archive.getnames())
    assert context_files(context) == sent
    assert "Dockerfile" in sent and "secret.txt" not in sent and "build/tmp.o" not in sent


def test_file_list_is_docker_pys_for_any_dockerignore(tmp_path: Path) -> None:
    files = {
        "app.py": "a",
        "app.pyc": "c",
        "docs/a.md": "d",
        "docs/deep/b.md": "d",
        "docs/deep/keep.txt": "k",
        "data/raw/x.csv": "x",
        "data/raw/y.bin": "y",
        ".git/config": "g",
    }
    ignores = [
        "",
        "*.pyc\n",
        "docs\n!docs/deep/keep.txt\n",
        "**/*.md\ndata/*/y.*\n",
        "*\n!app.py\n!data\n",
        "../docs/\n./data/raw\n.git\nDockerfile\n.dockerignore\n",
    ]
    for index, ignore in enumerate(ignores):
        # Contexts alike but for .dockerignore: each one's verdicts are its own.
        context = make_context(tmp_path / f"ctx{index}", {**files, ".dockerignore": ignore})
        (context / "linked").symlink_to(context / "docs", target_is_directory=True)
        patterns = _patterns(context) if ignore else []
        assert context_files(context) == sorted(exclude_paths(str(context), patterns)), ignore


def _patterns(context: Path) -> list[str]:
    lines = (context / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_symlinks_hash_by_target_text_and_dockerfile_by_content(tmp_path: Path) -> None:
    a = make_context(tmp_path / "a", {})
    b = make_context(tmp_path / "b", {})
    (a / "data").symlink_to("/srv/one")
    (b / "data").symlink_to("/srv/two")
    assert context_hash(a) != context_hash(b)

    # Dockerfiles that are symlinks to different files outside the contexts differ.
    shared_one = tmp_path / "one.Dockerfile"
    shared_two = tmp_path / "two.Dockerfile"
    shared_one.write_text("FROM one\n")
    shared_two.write_text("FROM two\n")
    c, d = tmp_path / "c", tmp_path / "d"
    for context, target in ((c, shared_one), (d, shared_two)):
        context.mkdir()
        (context / "Dockerfile").symlink_to(Path("..") / target.name)
    assert context_hash(c) != context_hash(d)


def test_hard_linked_files_are_read_once(tmp_path: Path) -> None:
    a = make_context(tmp_path / "a", {"big.bin": "x" * 10_000})
    b = make_context(tmp_path / "b", {})
    os.link(a / "big.bin", b / "big.bin")
    digests = FileDigests()
    assert context_hash(a, digests) == context_hash(b, digests)
    assert len(digests._known) == 3  # two Dockerfiles, one shared big.bin


def test_build_args_make_another_image_and_none_keep_the_old_hash(tmp_path: Path) -> None:
    dockerfile = "ARG BASE=base\nFROM $BASE\nARG GREETING=hi\nCOPY a.txt /a.txt\n"
    context = make_context(tmp_path / "ctx", {"a.txt": "a\n"}, dockerfile)
    for name in ("Dockerfile", "a.txt"):
        (context / name).chmod(0o644)
    # What this context hashed to before build args existed: manifests name images by it.
    before = "255467683a24ee7bd20ebe6bf68e0c8f297dc3f21b657dc8dba42500fadef207"
    assert context_hash(context) == context_hash(context, build_args={}) == before
    hashes = {
        context_hash(context, build_args=args)
        for args in ({}, {"GREETING": "hello"}, {"GREETING": "hey"}, {"BASE": "hello"})
    }
    assert len(hashes) == 4

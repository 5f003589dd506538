import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.images.reference import Reference

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"localhost:5000/ns/name@{DIGEST}", Reference("localhost:5000", "ns/name", None, DIGEST)),
        (
            f"docker://reg.example.org/a/b:1.0@{DIGEST}",
            Reference("reg.example.org", "a/b", "1.0", DIGEST),
        ),
        ("reg.example.org/team/img:v2", Reference("reg.example.org", "team/img", "v2", None)),
        ("ubuntu", Reference("registry-1.docker.io", "library/ubuntu", "latest", None)),
        ("me/tool:3", Reference("registry-1.docker.io", "me/tool", "3", None)),
    ],
)
def test_reference_parse(text: str, expected: Reference) -> None:
    assert Reference.parse(text) == expected


@pytest.mark.parametrize("text", ["reg.io/a@sha256:short", "reg.io/UPPER/case:1", "docker://"])
def test_bad_references_are_input_errors(text: str) -> None:
    with pytest.raises(InputError):
        Reference.parse(text)


def test_registry_target_needs_a_host_and_names_its_images() -> None:
    with pytest.raises(InputError, match="does not start with a registry host"):
        Reference.registry_target("myteam/images")
    with pytest.raises(InputError, match="not a valid repository path"):
        Reference.registry_target("localhost:5000/My_Team")
    target = Reference.registry_target("localhost:5000/a/b/")
    assert str(target) == "localhost:5000/a/b"
    image = target.child("env-1", "f" * 64)
    assert (image.host, image.repository) == ("localhost:5000", "a/b/env-1")
    assert str(image) == f"localhost:5000/a/b/env-1:{'f' * 64}"
    assert Reference.parse(str(image)) == image
    assert str(Reference.registry_target("localhost:5000").child("x", "1")) == "localhost:5000/x:1"
    pinned = Reference.parse(f"localhost:5000/a/env-1@{DIGEST}")
    assert pinned.pinned == f"docker://localhost:5000/a/env-1@{DIGEST}"

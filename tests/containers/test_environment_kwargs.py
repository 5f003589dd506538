"""Boolean environment kwargs read one way wherever they are read: by the environment, and by
`submit`'s checks before anything is queued (`--environment-kwarg nohttps=false` is false)."""

import pytest

from harbor_hpc.containers.environment_kwargs import flag


@pytest.mark.parametrize(
    ("given", "meant"),
    [("false", False), ("0", False), ("no", False), ("", False), (" TRUE ", True),
     ("1", True), ("on", True), (True, True), (False, False), (1, True), (0, False)],
)  # fmt: skip
def test_a_flag_reads_as_the_command_line_and_json_give_it(given: object, meant: bool) -> None:
    assert flag(given) is meant

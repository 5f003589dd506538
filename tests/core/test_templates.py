"""`render_template`: values go in as given, and a template it cannot fill is named."""

from __future__ import annotations

import pytest

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.templates import render_template, template_path


def test_values_go_in_as_given() -> None:
    rendered = render_template("array_setup.sh", {"setup": "echo ${HOME} $$"}, "slurm")
    assert rendered.endswith("\necho ${HOME} $$\n")


def test_a_placeholder_without_a_value_is_named_with_its_file() -> None:
    with pytest.raises(HarborHpcError) as refused:
        render_template("ray_job.sh", {"setup": ""}, "slurm")
    path = template_path("ray_job.sh", "slurm")
    assert refused.value.message == f"{path}: cannot render it (KeyError: 'nodes')"
    assert refused.value.hint is not None and "fills in setup (" in refused.value.hint

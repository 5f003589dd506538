"""`submit` and `resubmit`: `checks` refuse what cannot run, `plan` groups, chunks and sizes the
attempts, `launch` records the run and queues its array jobs; `options` is what was asked."""

from harbor_hpc.steps.submit.launch import SubmitResult, resubmit_run, submit_run
from harbor_hpc.steps.submit.options import SubmitOptions, configured_options, parse_key_values

__all__ = [
    "SubmitOptions",
    "SubmitResult",
    "configured_options",
    "parse_key_values",
    "resubmit_run",
    "submit_run",
]

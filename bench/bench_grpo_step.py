"""One step of TRL's GRPOTrainer for real on CPU, its environments our sandboxes.

TRL 1.16's GRPOTrainer with `environment_factory=partial(harbor_hpc.trl.HarborBashEnv, ...)`:
a tiny Qwen3 made from a config (random weights, two layers) and a byte-level tokenizer made
here with Qwen3's chat template (the one trl ships, so that TRL parses tool calls as for
Qwen3), no hub. Its generation is held to a script (a logits processor: every other token
-inf): a `bash` tool call that writes 42 or 41 as the answer, the digit sampled from the
model's own logits, then an end once the tool answered. The trainer resets `--rollouts`
environments, generates, runs each tool call in its sandbox, scores with `get_reward` (the
task's verifier: 1 for 42, 0 for 41), and takes its optimizer step. Prints what the step
took, each reward, and the rollouts' record lines.

Needs torch, transformers, datasets, accelerate and trl 1.16 beside harbor-hpc (none is our
dependency): `uv pip install torch transformers datasets accelerate trl==1.16.0` in a venv
of its own, then `python bench/bench_grpo_step.py --sif IMAGE.sif [--ray-cluster-dir DIR]`.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.sample_tasks import make_task

QWEN3_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]


def tiny_tokenizer(template: str, texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=QWEN3_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([template, *texts], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
    )


SCRIPT = '<tool_call>\n{{"name": "bash", "arguments": {{"command": "echo {} > /tmp/answer"}}}}'
SCRIPT += "\n</tool_call><|im_end|>"


def scripted(model_class: type, tokenizer: Any) -> type:
    """`model_class` whose generate follows the scripts (see the module's docstring)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    answers = [tokenizer.encode(SCRIPT.format(n), add_special_tokens=False) for n in (42, 41)]
    done = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    answered = tokenizer.convert_tokens_to_ids("<tool_response>")

    class Script(LogitsProcessor):  # type: ignore[misc]
        def __init__(self, prompt_length: int, scripts: list[list[list[int]]]) -> None:
            self.prompt_length, self.scripts = prompt_length, scripts

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            k = input_ids.shape[1] - self.prompt_length
            for row, ids in enumerate(input_ids.tolist()):
                made = ids[self.prompt_length :]
                allowed = {
                    script[k]
                    for script in self.scripts[row]
                    if len(script) > k and script[:k] == made
                } or {done[0]}
                keep = scores[row, list(allowed)].clone()
                scores[row, :] = float("-inf")
                scores[row, list(allowed)] = keep
            return scores

    class Scripted(model_class):  # type: ignore[misc,valid-type,unused-ignore]
        def generate(self, input_ids: Any = None, **kwargs: Any) -> Any:
            rows = input_ids.tolist()
            scripts = [[done] if answered in row else answers for row in rows]
            processors = LogitsProcessorList([Script(input_ids.shape[1], scripts)])
            return super().generate(input_ids=input_ids, logits_processor=processors, **kwargs)

    return Scripted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sif", type=Path, required=True)
    parser.add_argument("--rollouts", type=int, default=8, help="one step's: tasks x group")
    parser.add_argument("--group", type=int, default=4, help="num_generations")
    parser.add_argument("--max-completion", type=int, default=256)
    parser.add_argument("--ray-cluster-dir", type=Path, help="on this `ray up` cluster")
    args = parser.parse_args(argv)

    import torch
    import trl
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined,unused-ignore]

    from harbor_hpc.trl import HarborBashEnv

    work = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    tasks = [
        make_task(work / "tasks", f"t{i}", image=str(args.sif))
        for i in range(max(1, args.rollouts // args.group))
    ]
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    tokenizer = tiny_tokenizer(
        template,
        [(task / "instruction.md").read_text() for task in tasks]
        + [SCRIPT.format(n) for n in (42, 41)],
    )
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = scripted(Qwen3ForCausalLM, tokenizer)(config)
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": ""}] for _ in tasks],
            "task_dir": [str(task) for task in tasks],
        }
    )
    record = work / "rewards.jsonl"
    on_ray: dict[str, Any] = (
        {"ray_cluster_dir": str(args.ray_cluster_dir), "ray_cpus": 0.1}
        if args.ray_cluster_dir
        else {}
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=GRPOConfig(
            output_dir=str(work / "out"),
            per_device_train_batch_size=args.rollouts,
            num_generations=args.group,
            max_completion_length=args.max_completion,
            max_tool_calling_iterations=2,
            max_steps=1,
            use_cpu=True,
            bf16=False,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
        ),
        train_dataset=dataset,
        environment_factory=functools.partial(
            HarborBashEnv,
            ahead=args.group - 1,
            record=str(record),
            executor="ray" if args.ray_cluster_dir else "local",
            environment_kwargs=on_ray,
        ),
    )
    began = time.perf_counter()
    trainer.train()
    took = time.perf_counter() - began
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    where = "on Ray" if args.ray_cluster_dir else "local"
    print(f"one GRPOTrainer step, {len(lines)} rollouts, sandboxes {where}: {took:.1f} s")
    for entry in trainer.state.log_history:
        print({key: value for key, value in entry.items() if "reward" in key or key == "loss"})
    for line in lines:
        print(line)
    return 0 if len(lines) == args.rollouts else 1


if __name__ == "__main__":
    sys.exit(main())

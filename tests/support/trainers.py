"""How four trainers read our export's lines, ported from their sources (no torch, no Ray).

`skyrl_generator_output`: SkyRL's Harbor integration hands each trial to its trainer as a
`TokenizedTrajectory` (prompt_token_ids, response_ids, loss_mask, reward, rollout_logprobs;
skyrl/train/generators/output_builders.py) and `_validate_generator_output` checks the batch.
A harbor-rl line is one: its prompt is what comes before the first policy token.

`nemo_rl_message_log`: NeMo RL's `NemoGym._postprocess_nemo_gym_to_nemo_rl_result`
(nemo_rl/environments/nemo_gym.py) turns a NeMo Gym line into the message log it trains on:
output items without generation_token_ids are skipped; each other one must have a prompt that
begins with every token seen so far ("Non-contiguous messages found!" otherwise), the rest of
its prompt becomes a user message and its generation an assistant message with its log-probs.

`prime_rl_training_samples`: prime-rl (PrimeIntellect-ai/prime-rl 559b44772e47) trains on one
`TrainingSample` per branch of a verifiers trace (src/prime_rl/transports/rollouts/types.py):
the whole sequence, no prompt/completion split, `mask` True on sampled tokens, `logprobs` 0.0
elsewhere, a temperature per token, and GRPO advantages (reward less its group's mean,
algo/grpo.py) spread over the sampled tokens; trainer/batch.py::prepare_sample checks them.

`slime_samples`: SLiME (THUDM/slime 624b824a898a) builds a `Sample` (slime/utils/types.py) in a
custom generate function from the prompt's tokens and `append_response_tokens` for each run of
the response: `tokens` the prompt and response, `loss_mask` and `rollout_log_probs` as long as
`response_length` (0.0 for tokens not trained on); a sample not to train on is
`remove_sample=True`, which zeroes its loss mask but keeps it in its group.
"""

from __future__ import annotations

from itertools import groupby
from statistics import fmean
from typing import Any


def skyrl_generator_output(lines: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """harbor-rl lines as SkyRL's GeneratorOutput, validated as SkyRL validates it."""
    prompts, responses, masks, rewards, logprobs = [], [], [], [], []
    for line in lines:
        first = line["mask_ids"].index(1)
        prompts.append(line["token_ids"][:first])
        responses.append(line["token_ids"][first:])
        masks.append(line["mask_ids"][first:])
        rewards.append(line["reward"])
        logprobs.append(line["logprobs"][first:])
    if not responses:
        raise ValueError("No outputs generated")
    for i, response in enumerate(responses):
        if len(response) != len(masks[i]):
            raise ValueError(f"Response ids and loss masks must have the same length for {i}")
        if len(response) != len(logprobs[i]):
            raise ValueError(f"Rollout logprobs must match response length for sample {i}")
        if not isinstance(rewards[i], float):
            raise ValueError(f"sample {i}: a response-level reward must be a float")
    return {
        "prompt_token_ids": prompts,
        "response_ids": responses,
        "loss_masks": masks,
        "rewards": rewards,
        "rollout_logprobs": logprobs,
    }


def nemo_rl_message_log(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A nemo-gym line as NeMo RL's message log: role, token_ids (and generation_logprobs)."""
    message_log: list[dict[str, Any]] = []
    seen: list[int] = []
    for item in result["response"]["output"]:
        if not item.get("generation_token_ids"):
            continue
        prompt = item["prompt_token_ids"]
        if seen != prompt[: len(seen)]:
            raise AssertionError(f"Non-contiguous messages found! Seen token IDs: {seen}")
        message_log.append({"role": "user", "token_ids": prompt[len(seen) :]})
        message_log.append(
            {
                "role": "assistant",
                "token_ids": item["generation_token_ids"],
                "generation_logprobs": item["generation_log_probs"],
            }
        )
        seen = prompt + item["generation_token_ids"]
    if not message_log:
        raise ValueError("NeMo Gym returned a result with no generation data.")
    return message_log


def prime_rl_training_samples(
    lines: list[dict[str, Any]], temperature: float = 1.0
) -> list[dict[str, Any]]:
    """harbor-rl lines as prime-rl's TrainingSamples (a task's lines are one GRPO group),
    checked as prime-rl's trainer checks a sample."""
    by_task: dict[str, list[float]] = {}
    for line in lines:
        by_task.setdefault(line["task"], []).append(line["reward"])
    samples = []
    for line in lines:
        mask = [m == 1 for m in line["mask_ids"]]
        advantage = line["reward"] - fmean(by_task[line["task"]])
        sample = {
            "token_ids": line["token_ids"],
            "mask": mask,
            "logprobs": [
                float(lp) if m else 0.0 for lp, m in zip(line["logprobs"], mask, strict=False)
            ],
            "temperatures": [temperature] * len(mask),
            "env_name": line["task"],
            "advantages": [advantage if m else 0.0 for m in mask],
        }
        lengths = {key: len(sample[key]) for key in ("token_ids", "mask", "logprobs",
                                                     "temperatures", "advantages")}  # fmt: skip
        if len(set(lengths.values())) != 1:
            raise ValueError(f"a sample's per-token fields differ in length: {lengths}")
        if not any(mask) or sample["env_name"] == "all":
            raise ValueError("a sample with no trainable token, or env_name 'all'")
        samples.append(sample)
    return samples


def slime_samples(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """harbor-rl lines as SLiME's Samples, built as a custom generate function builds one:
    the prompt, then `append_response_tokens` for each run of trained or untrained tokens."""
    tasks = list(dict.fromkeys(line["task"] for line in lines))
    samples = []
    for index, line in enumerate(lines):
        first = line["mask_ids"].index(1)
        sample: dict[str, Any] = {
            "group_index": tasks.index(line["task"]),
            "index": index,
            "tokens": list(line["token_ids"][:first]),
            "response_length": 0,
            "loss_mask": [],
            "rollout_log_probs": [],
            "reward": float(line["reward"]),
            "status": "truncated" if line["partial"] else "completed",
            "remove_sample": False,
        }
        rest = zip(line["token_ids"][first:], line["mask_ids"][first:],
                   line["logprobs"][first:], strict=True)  # fmt: skip
        for trainable, run in groupby(rest, key=lambda token: token[1] == 1):
            tokens, _, logprobs = zip(*run, strict=True)
            # Sample.append_response_tokens: log-probs only for trained tokens, 0.0 otherwise.
            sample["tokens"] += tokens
            sample["response_length"] += len(tokens)
            sample["loss_mask"] += [1 if trainable else 0] * len(tokens)
            sample["rollout_log_probs"] += (
                [float(lp) for lp in logprobs] if trainable else ([0.0] * len(tokens))
            )
        n = sample["response_length"]
        if not (len(sample["loss_mask"]) == len(sample["rollout_log_probs"]) == n >= 1):
            raise ValueError(f"sample {index}: loss_mask and log-probs must be response_length")
        if len(sample["tokens"]) != first + n:
            raise ValueError(f"sample {index}: tokens must be the prompt and the response")
        samples.append(sample)
    return samples

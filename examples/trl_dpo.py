"""Preference tuning with TRL's ``DPOTrainer`` on infinity (stage 3, everything on NVMe), with
its frozen reference model partitioned on the same tiers and never trained.

The data is real text: lines of Python's standard library; for each line (the prompt) the
chosen completion is the line that really follows it, the rejected one a line from elsewhere.
Tokenizer and tiny Llama come from ``trl_sft.py`` (trained and built here, nothing
downloaded):

    python examples/trl_dpo.py --out OUT --nvme /local_nvme [--steps 20] [--plain]
"""
import argparse
import copy
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_sft import common_args, losses, nvme_config, stdlib_lines, tiny_llama, train_tokenizer  # noqa: E402


def dpo_dataset(lines: list, seed: int = 0):
    """(prompt, chosen, rejected): a line, the line after it, and a line from elsewhere."""
    from datasets import Dataset

    rng = random.Random(seed)
    rejected = [lines[rng.randrange(len(lines))] for _ in lines[1:]]
    return Dataset.from_dict({"prompt": lines[:-1], "chosen": [" " + x for x in lines[1:]],
                              "rejected": [" " + x for x in rejected]})


def run_dpo(out: str, nvme: str, steps: int = 20, plain: bool = False, lines: int = 2000):
    """Train; return the trainer (its losses: ``losses(trainer)``)."""
    from trl import DPOConfig, DPOTrainer

    lines = stdlib_lines(lines)
    tokenizer = train_tokenizer(stdlib_lines())
    model = tiny_llama(tokenizer)
    args = DPOConfig(**common_args(out, steps, plain, per_device_train_batch_size=2), max_length=64, beta=0.1)
    kwargs = dict(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=dpo_dataset(lines),
                  processing_class=tokenizer)
    if plain:
        trainer = DPOTrainer(**kwargs)
    else:
        from infinity.integrations.transformers import with_infinity

        trainer = with_infinity(DPOTrainer)(**kwargs, infinity_config=nvme_config(nvme))
    trainer.train()
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--nvme", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plain", action="store_true", help="TRL's own trainer, without infinity")
    a = parser.parse_args()
    got = losses(run_dpo(a.out, a.nvme, a.steps, a.plain))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"losses": got}))


if __name__ == "__main__":
    main()

"""Supervised fine-tuning with TRL's ``SFTTrainer`` on infinity (stage 3, everything on NVMe).

The data is real text: lines of Python's own standard library, each paired with the line that
follows it (prompt -> completion, trained with the completion-only loss), or the lines packed
into full-length rows (``--packing``). The tokenizer is trained here with ``tokenizers`` and the
model is a tiny Llama built from a config, so nothing is downloaded:

    python examples/trl_sft.py --out OUT --nvme /local_nvme [--steps 20] [--packing] [--plain]

``--plain`` runs TRL's own trainer without infinity, for comparison; both print their losses.
Several ranks: ``torchrun --nproc_per_node 2 examples/trl_sft.py ...``.
"""
import argparse
import json
import os
import sysconfig
from pathlib import Path

import torch

MODULES = ("textwrap", "string", "fnmatch", "shlex", "difflib", "glob", "tokenize", "argparse")


def stdlib_lines(limit: int = 2000) -> list:
    """Non-empty, non-comment source lines of a few standard-library modules, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for name in MODULES:
        for line in (root / f"{name}.py").read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if 8 <= len(line) <= 60 and not line.startswith(("#", '"""', "'''")):
                lines.append(line)
    return lines[:limit]


def train_tokenizer(texts: list, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on ``texts``, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<unk>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(tokenizer, seed: int = 0, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, attention_dropout=0.0, use_cache=False,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(cfg)


def sft_dataset(lines: list, packing: bool):
    """Prompt-completion pairs (a line, the next one), or plain text rows for packing."""
    from datasets import Dataset

    if packing:
        return Dataset.from_dict({"text": lines})
    return Dataset.from_dict({"prompt": lines[:-1], "completion": [" " + x for x in lines[1:]]})


def nvme_config(nvme: str) -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                     "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
            "precision": {"dtype": "fp32"}}


def common_args(out: str, steps: int, plain: bool, **over) -> dict:
    """TrainingArguments shared by the examples (plain TRL gets torch's AdamW, as infinity's)."""
    kw = dict(output_dir=out, per_device_train_batch_size=4, max_steps=steps, learning_rate=3e-3, weight_decay=0.01,
              max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
              seed=7, data_seed=7, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
              bf16=False)  # fp32 (TRL's configs default to bf16=True)
    if plain:
        kw["optim"] = "adamw_torch"
    kw.update(over)
    return kw


def losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_sft(out: str, nvme: str, steps: int = 20, packing: bool = False, plain: bool = False, lines: int = 2000):
    """Train; return the trainer (its losses: ``losses(trainer)``)."""
    from trl import SFTConfig, SFTTrainer

    lines = stdlib_lines(lines)
    tokenizer = train_tokenizer(stdlib_lines())
    args = SFTConfig(**common_args(out, steps, plain), max_length=64, packing=packing,
                     completion_only_loss=None if packing else True)
    kwargs = dict(model=tiny_llama(tokenizer), args=args, train_dataset=sft_dataset(lines, packing),
                  processing_class=tokenizer)
    if plain:
        trainer = SFTTrainer(**kwargs)
    else:
        from infinity.integrations.transformers import with_infinity

        trainer = with_infinity(SFTTrainer)(**kwargs, infinity_config=nvme_config(nvme))
    trainer.train()
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--nvme", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--plain", action="store_true", help="TRL's own trainer, without infinity")
    a = parser.parse_args()
    got = losses(run_sft(a.out, a.nvme, a.steps, a.packing, a.plain))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"losses": got}))


if __name__ == "__main__":
    main()

"""Fine-tune a causal LM with Hugging Face's Trainer on infinity: the one-line switch.

    python examples/trainer_finetune.py --config examples/deepspeed/ds_zero3_nvme_auto.json \
        --nvme-path /local_nvme --output-dir out

``--config`` takes a DeepSpeed JSON as written for transformers/accelerate ("auto" values
are filled from the model and the TrainingArguments below) or an infinity YAML. Without
``--model`` a tiny Llama is built from a config (nothing downloads) and trained on random
tokens, so the script runs anywhere; give ``--model DIR`` (a Hugging Face directory) and
``--data FILE.txt`` for real use.
"""
import argparse
import json
import os

import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainingArguments

from infinity.integrations.transformers import InfinityTrainer


def build_model(model_dir):
    if model_dir:
        return AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                                        use_cache=False))


def token_rows(data, vocab: int, seq: int = 32, n: int = 64):
    if data:
        ids = torch.tensor(list(open(data, "rb").read()), dtype=torch.long) % vocab
    else:
        ids = torch.randint(0, vocab, (n * seq,), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": w, "labels": w.clone()} for w in ids[: len(ids) // seq * seq].view(-1, seq)]


def config_with_nvme_path(path, nvme_path):
    """The config file's contents, its DeepSpeed nvme_path keys pointed at ``nvme_path``."""
    with open(path) as f:
        data = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    for section in ("offload_param", "offload_optimizer"):
        node = data.get("zero_optimization", {}).get(section)
        if nvme_path and isinstance(node, dict) and "nvme_path" in node:
            node["nvme_path"] = nvme_path
    return data


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a DeepSpeed JSON or an infinity YAML")
    p.add_argument("--nvme-path", help="replace the DeepSpeed config's nvme_path values")
    p.add_argument("--model", help="a Hugging Face model directory (default: a tiny Llama)")
    p.add_argument("--data", help="a text file (default: random tokens)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--gradient-accumulation-steps", type=int, default=2)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--strict", action="store_true", help="refuse DeepSpeed keys that only tune DeepSpeed")
    a = p.parse_args(argv)
    model = build_model(a.model)
    args = TrainingArguments(output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=a.gradient_accumulation_steps, learning_rate=3e-4,
                             warmup_steps=1, logging_steps=1,
                             save_strategy="no", report_to=[], fp16=a.fp16, bf16=a.bf16,
                             use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = InfinityTrainer(model=model, args=args, train_dataset=token_rows(a.data, model.config.vocab_size),
                              infinity_config=config_with_nvme_path(a.config, a.nvme_path), strict=a.strict)
    trainer.train()
    trainer.save_model(os.path.join(a.output_dir, "final"))
    if trainer.is_world_process_zero():
        cfg = trainer.infinity_config(trainer.model)  # the config the run trained with
        print(json.dumps({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                          "dtype": cfg.precision.dtype, "scheduler": cfg.scheduler.type}))


if __name__ == "__main__":
    main()

"""A tiny Llama fine-tune through transformers.Trainer, plain or InfinityTrainer: shared by
tests/integration/test_hf_trainer.py (in-process and as a subprocess that gets killed) and the example."""
import json
import os
import sys

import torch

VOCAB = 96


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)
    return LlamaForCausalLM(cfg)


def dataset(n: int = 32, seq: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def training_args(out_dir: str, **over):
    from transformers import TrainingArguments

    kw = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
              learning_rate=1e-2, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="constant",
              logging_steps=1, save_strategy="no", report_to=[], seed=7, data_seed=7, use_cpu=True,
              disable_tqdm=True, dataloader_num_workers=0)
    kw.update(over)
    return TrainingArguments(**kw)


def losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main(argv):
    """``python _trainer_job.py OUT NVME MAX_STEPS [resume] [async]``: InfinityTrainer saving every
    step (``async``: without stopping, ``save_async=True``)."""
    from infinity.integrations.transformers import InfinityTrainer

    out, nvme, steps = argv[0], argv[1], int(argv[2])
    cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    args = training_args(out, max_steps=steps, save_strategy="steps", save_steps=1, save_total_limit=2)
    trainer = InfinityTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), infinity_config=cfg,
                              save_async="async" in argv[3:])
    trainer.train(resume_from_checkpoint=True if "resume" in argv[3:] else None)
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump([h for h in trainer.state.log_history if "loss" in h], f)


if __name__ == "__main__":
    main(sys.argv[1:])

"""A DeepSpeed user's Trainer script runs on infinity with its import line changed: the DeepSpeed
JSON stays in ``TrainingArguments(deepspeed=...)``, which transformers alone refuses where the
deepspeed package is not installed."""
import importlib.metadata
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from _trainer_job import dataset, tiny_llama  # noqa: E402

from infinity.errors import UsageError  # noqa: E402
from infinity.integrations.transformers import InfinityTrainer as Trainer  # noqa: E402
from infinity.integrations.transformers import TrainingArguments  # noqa: E402

ARGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=2, learning_rate=1e-3,
            lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], seed=7, use_cpu=True,
            disable_tqdm=True, dataloader_num_workers=0)


def _ds_json(tmp_path) -> str:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}))
    return str(path)


def test_plain_transformers_refuses_without_deepspeed(tmp_path):
    """Why the import line changes: transformers' own TrainingArguments needs the deepspeed package."""
    try:  # the distribution, as transformers asks for it (a folder named deepspeed on sys.path is not one)
        importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        pytest.skip("the deepspeed distribution is installed here")
    import transformers

    with pytest.raises(Exception, match="deepspeed"):
        transformers.TrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=_ds_json(tmp_path), **ARGS)


def test_deepspeed_argument_trains_on_infinity(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=_ds_json(tmp_path), **ARGS)
    assert args.deepspeed is None and args.deepspeed_plugin is None  # DeepSpeed is not started
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=dataset())
    out = trainer.train()
    assert out.global_step == 2
    cfg = trainer.optimizer.engine.cfg
    assert cfg.zero.offload_param.device == cfg.zero.offload_optimizer.device == "nvme"
    assert cfg.optimizer.lr == 1e-3 and cfg.train.micro_batch_size == 2  # the "auto" values, from the arguments


def test_config_given_twice_is_refused(tmp_path):
    with pytest.raises(UsageError, match="once"):
        TrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=_ds_json(tmp_path), infinity_config={}, **ARGS)


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "hugging-face.md"


def test_the_guide_names_the_line_and_states_what_is_logged():
    first = GUIDE.read_text().split("\n## ", 2)[1]  # the guide's first section, the Trainer
    blocks = re.findall(r"```python\n(.*?)```", first, re.S)
    line = next(b for b in blocks if "TrainingArguments" in b).splitlines()[0]
    assert line == "from infinity.integrations.transformers import InfinityTrainer as Trainer, TrainingArguments"
    exec(line, {})  # the line imports as written
    assert "`grad_norm` is logged" in first and "is not logged" not in first

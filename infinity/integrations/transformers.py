"""``InfinityTrainer``: Hugging Face's ``transformers.Trainer`` on infinity.

Switching is one line: ``InfinityTrainer(..., infinity_config=cfg)`` where ``cfg`` is an
:class:`infinity.Config`, a dict, or a path to an infinity YAML / a DeepSpeed JSON (its
``"auto"`` values resolved from the model and the ``TrainingArguments`` as transformers
resolves them: Note [auto values] in config/deepspeed.py). Covered: transformers 5.x (tested
with the versions in constraints.txt); the Trainer's private ``_prepare_for_training`` is the one seam
whose shape is version-specific, and its absence is refused at construction. Any other
Trainer subclass (TRL's ``SFTTrainer``, ``DPOTrainer``, ...) runs on infinity as
``with_infinity(TrainerClass)(..., infinity_config=cfg)``: Note [TRL on infinity] in trl.py.

A DeepSpeed user's script, which gives its JSON as ``TrainingArguments(deepspeed=...)``, changes its
import line only: ``from infinity.integrations.transformers import InfinityTrainer as Trainer,
TrainingArguments``. This ``TrainingArguments`` takes ``deepspeed=`` as infinity's config (it never
reaches transformers' DeepSpeed set-up, which needs the deepspeed package), and ``InfinityTrainer``
uses it where no ``infinity_config=`` is given.

Note [InfinityTrainer seams]: what the Trainer's DeepSpeed path does, and where it happens here.
- model: ``model_init`` runs under ``infinity.Init`` (the model is built partitioned); a
  model passed in already built stays whole until ``create_optimizer`` hands it to
  ``infinity.initialize``, which partitions it (stage 3) in place.
- optimizer: ``create_optimizer`` builds infinity's optimizer with the Trainer's two groups
  (``get_decay_parameter_names``: no weight decay on biases and norms) and the
  TrainingArguments' lr, betas, eps, weight decay and max_grad_norm (clipping happens inside
  ``optimizer.step()``, so ``_clip_grad_norm`` does nothing).
- gradient accumulation: the Trainer divides each micro-batch loss itself (or normalises by
  ``num_items_in_batch``), as with DeepSpeed's ``scale_wrt_gas=False``; infinity's optimizer
  then only averages over ranks (``grad_scale = 1 / world size``).
- scheduler: the config's ``scheduler`` section (DeepSpeed's WarmupLR/WarmupDecayLR/
  WarmupCosineLR) when it has one, else the Trainer's own ``lr_scheduler_type``.
- precision: TrainingArguments' ``fp16`` / ``bf16`` set ``precision.dtype`` where the config
  leaves it open (infinity casts the model and scales the loss; the Trainer gets a copy of its
  arguments with both off, so accelerate adds no autocast and no GradScaler); ``bf16`` over a
  config that states fp32 is plain transformers' autocast over fp32 parameters; Note [precision
  flags] in _precision.py. An fp16 step infinity skips on overflow does not step the scheduler
  (``_SkipOnOverflow``).
- batches: each micro-batch goes to ``infinity.device()``, where the engine placed the
  parameters, not to ``args.device``: the two differ where the Trainer computes on the CPU
  (``use_cpu``, or no CUDA device) while infinity computes on an accelerator (CUDA, the
  emulated device of the tests), and host ids fed to device weights raise; the loss of each
  micro-batch goes back to ``args.device``, where the Trainer sums them.
- no accelerate wrapping: no DDP (infinity reduce-scatters gradients) and no
  ``AcceleratedOptimizer`` (infinity's optimizer has no torch state_dict):
  ``_prepare_for_training`` is replaced.
- checkpoints: ``checkpoint-N/`` holds ``infinity/`` (``infinity.save_checkpoint``: every
  state on every tier, the scheduler's state as its client_state), ``trainer_state.json`` and
  the RNG states; resume loads it with ``infinity.load_checkpoint``; ``save_total_limit``
  rotates the directories as usual. ``save_async=True``: infinity's part is saved without
  stopping (``blocking=False``); the next save, and the end of ``train``, wait for it. Until it
  commits, the directory has no ``infinity/`` and does not count as complete for a resume, so
  the rotation waits for the commit too (Note [rotation after the commit]).
  ``save_model`` writes a normal Hugging Face directory (safetensors gathered unit by unit,
  config.json, the tokenizer).
- batch size found (``auto_find_batch_size``): Note [batch size retries].
- generate: under stage 3 every rank must run the same forwards, so a rank whose sequences
  end first must keep stepping until all have ended (transformers' ``synced_gpus``, which it
  turns on only for DeepSpeed ZeRO-3 or FSDP). ``synced_generate(model)`` makes ``synced_gpus``
  default to True on that model at several ranks; the Trainer applies it at initialize.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections.abc import Mapping
from typing import Any, Optional

import torch
import transformers
from accelerate.utils.memory import should_reduce_batch_size
from transformers import Trainer
from transformers.trainer_utils import rotate_checkpoints

import infinity

from .._checkpoint._safetensors_export import export_safetensors
from .._checkpoint._save import finish_pending
from .._runtime import _comm as comm
from .._runtime._log import logger
from .._runtime._schedule import make_scheduler
from .._zero._engine import engine_of
from ..config import Config, _looks_like_deepspeed, _read_file
from ..config.deepspeed import _get, hidden_size_of
from ..errors import UsageError, UsageTypeError
from ._precision import FlagMeaning, autocast_forward, check_autocast_device, flag_meaning, stated_dtype

__all__ = ["InfinityTrainer", "TrainingArguments", "synced_generate", "with_infinity"]

CHECKPOINT_TAG = "infinity"


def last_complete_checkpoint(output_dir: str) -> str:
    """The newest ``checkpoint-N`` under ``output_dir`` holding infinity's committed states and
    the Trainer's state (written last); newer partial ones are named in a warning."""
    found = sorted((int(n.split("-")[1]), n) for n in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
                   if n.startswith("checkpoint-") and n.split("-")[1].isdigit())
    partial = []
    for _, name in reversed(found):
        path = os.path.join(output_dir, name)
        if os.path.isdir(os.path.join(path, CHECKPOINT_TAG)) and os.path.exists(os.path.join(path, "trainer_state.json")):
            if partial:
                logger.warning("InfinityTrainer: %s in %s were not saved whole (the run stopped during a save); "
                               "resuming from %s", ", ".join(partial), output_dir, name)
            return path
        partial.append(name)
    raise UsageError(f"resume_from_checkpoint=True: no complete checkpoint-N under {output_dir!r}"
                     + (f" ({', '.join(partial)} were not saved whole)" if partial else "")
                     + "; train from the start or pass the checkpoint directory")


def synced_generate(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model.generate`` default to ``synced_gpus=True`` when several ranks run:
    Note [InfinityTrainer seams] (generate). An explicit ``synced_gpus=`` still wins."""
    original = type(model).generate

    @functools.wraps(original)
    def generate(*args, synced_gpus: Optional[bool] = None, **kwargs):
        if synced_gpus is None:
            synced_gpus = comm.world_size() > 1  # Note [one rank] in infinity/_runtime/_comm.py
        return original(model, *args, synced_gpus=synced_gpus, **kwargs)

    model.generate = generate
    return model


def _config_source(source: Any) -> tuple:
    """(data or Config, is DeepSpeed) from what ``infinity_config=`` accepts."""
    if source is None:
        return {}, False  # Config(): stating nothing, so the TrainingArguments' flags set the dtype
    if isinstance(source, Config):
        return source, False
    if isinstance(source, (str, os.PathLike)):
        source = _read_file(source)
    if not isinstance(source, dict):
        raise UsageError(f"infinity_config must be an infinity.Config, a dict or a path to a .yaml/.json file, "
                         f"got {type(source).__name__}")
    return source, _looks_like_deepspeed(source)


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` whose ``deepspeed=`` (a DeepSpeed JSON's path or dict, or
    any config ``infinity_config=`` takes) is kept as ``infinity_config`` for ``InfinityTrainer``
    instead of starting DeepSpeed: ``deepspeed`` is None afterwards, so neither the Trainer nor
    accelerate nor TRL takes a DeepSpeed path."""

    infinity_config: Any = dataclasses.field(default=None, metadata={"help": "infinity's config (set from deepspeed=)"})

    def __post_init__(self):
        if self.deepspeed is not None:
            if self.infinity_config is not None:
                raise UsageError("TrainingArguments: give the config once, as deepspeed= or as infinity_config=")
            self.infinity_config, self.deepspeed = self.deepspeed, None
        super().__post_init__()


class _ArgsView:
    """TrainingArguments with some attributes replaced."""

    def __init__(self, args, **replaced):
        self._args, self._replaced = args, replaced

    def __getattr__(self, name):
        replaced = self.__dict__["_replaced"]
        return replaced[name] if name in replaced else getattr(self.__dict__["_args"], name)


class _SkipOnOverflow:
    """The Trainer's scheduler, not stepped after an fp16 step infinity skipped on overflow (as
    DeepSpeed's engine and accelerate's AcceleratedScheduler do); everything else delegated."""

    def __init__(self, scheduler, optimizer):
        self.scheduler, self.optimizer = scheduler, optimizer

    def step(self, *args, **kwargs):
        if not self.optimizer.skipped:
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["scheduler"], name)


class InfinityTrainer(Trainer):
    """A ``transformers.Trainer`` whose model, optimizer, checkpoints and saved model are
    infinity's. Note [InfinityTrainer seams]."""

    def __init__(self, *args, infinity_config: Any = None, strict: bool = False, save_async: bool = False, **kwargs):
        if not hasattr(Trainer, "_prepare_for_training"):
            raise UsageError(f"InfinityTrainer covers transformers 5.x; the installed {transformers.__version__} has "
                             f"no Trainer._prepare_for_training")
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers[0] is not None or optimizers[1] is not None:
            raise UsageError("InfinityTrainer builds the optimizer (infinity's, partitioned) and the scheduler itself; "
                             "drop optimizers=(...) and give lr, betas, eps and weight decay in TrainingArguments, and "
                             "the schedule as lr_scheduler_type or the config's scheduler section")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "deepspeed", None):
            raise UsageError("InfinityTrainer: TrainingArguments.deepspeed is set, which would start DeepSpeed; give the "
                             "config to infinity instead: TrainingArguments from infinity.integrations.transformers "
                             "takes deepspeed= as infinity's config, or pass infinity_config=")
        if infinity_config is None:
            infinity_config = getattr(training_args, "infinity_config", None)
        self._infinity_source, self._is_deepspeed = _config_source(infinity_config)
        self._strict = strict
        self._save_async = save_async  # Note [asynchronous saves] in infinity/_checkpoint/_async.py
        self._precision_flags = (False, False)
        self._flag_meaning = FlagMeaning.OFF
        if training_args is not None:
            self._flag_meaning = flag_meaning(training_args.fp16, training_args.bf16,
                                              stated_dtype(self._infinity_source, self._is_deepspeed))
        if self._flag_meaning is FlagMeaning.PARAMETERS:
            # infinity casts the model and scales the loss itself (Note [precision flags] in _precision.py):
            # accelerate's autocast and GradScaler stay off, so the Trainer sees fp32 and the config gets the flag.
            self._precision_flags = (training_args.fp16, training_args.bf16)
            training_args = dataclasses.replace(training_args, fp16=False, bf16=False)
            if "args" in kwargs:
                kwargs["args"] = training_args
            else:
                args = (args[0], training_args, *args[2:])
        self._training_args_for_config = training_args
        self._infinity_cfg: Optional[Config] = None
        self._configs: dict = {}
        super().__init__(*args, **kwargs)
        if self._flag_meaning is FlagMeaning.AUTOCAST:
            check_autocast_device(self.accelerator, infinity.device().type)
            logger.info("InfinityTrainer: bf16=True over precision.dtype fp32: fp32 parameters, the forward under bf16 "
                        "autocast, as in plain transformers")
        elif self._flag_meaning is FlagMeaning.PARAMETERS:
            flag = "fp16" if self._precision_flags[0] else "bf16"
            logger.info("InfinityTrainer: %s=True sets precision.dtype %s (parameters in it, fp32 master weights, no "
                        "autocast), as under DeepSpeed", flag, flag)

    def _move_model_to_device(self, model, device) -> None:
        """The Trainer moves the whole model to the GPU in its constructor; infinity places
        each state on its tier in ``initialize`` (a model bigger than the GPU must not be moved
        whole), so nothing is moved here."""

    # ------------------------------------------------------------ config

    def infinity_config(self, model: Optional[torch.nn.Module] = None, *, quiet: bool = False) -> Config:
        """The infinity config of this run: the given one, with what the TrainingArguments own
        (lr, betas, eps, weight decay, clipping, accumulation, micro batch, fp16/bf16) taken
        from them; a DeepSpeed config's "auto" values resolved from ``model`` too. Built once
        without a model and once per hidden size, its warnings and resolved values logged
        unless ``quiet`` (``model_init``'s build, for ``Init``: the model's build logs them)."""
        key = hidden_size_of(model) if model is not None else None
        if key not in self._configs:
            self._configs[key] = self._build_config(model, quiet)
        return self._configs[key]

    def _build_config(self, model: Optional[torch.nn.Module], quiet: bool = False) -> Config:
        args = self._training_args_for_config
        fp16, bf16 = self._precision_flags
        source = self._infinity_source
        if isinstance(source, Config):
            cfg = source
        elif self._is_deepspeed:
            # a view, not dataclasses.replace: a new TrainingArguments resets accelerate's shared state
            ds_args = _ArgsView(args, fp16=fp16, bf16=bf16) if args is not None else None
            cfg = Config.from_deepspeed(source, strict=self._strict, model=model, training_args=ds_args, quiet=quiet)
        else:
            cfg = Config.from_dict(source)
        if args is None:
            return cfg
        updates = {"optimizer.lr": args.learning_rate, "optimizer.betas": [args.adam_beta1, args.adam_beta2],
                   "optimizer.eps": args.adam_epsilon, "optimizer.weight_decay": args.weight_decay,
                   "gradient_clipping": args.max_grad_norm, "gradient_accumulation_steps": args.gradient_accumulation_steps,
                   "train.micro_batch_size": args.per_device_train_batch_size, "seed": args.seed}
        if fp16 or bf16:
            updates["precision.dtype"] = "fp16" if fp16 else "bf16"
        return cfg.with_overrides(updates)

    # ------------------------------------------------------------ model and optimizer

    def call_model_init(self, trial=None):
        with infinity.Init(config=self.infinity_config(quiet=True)):  # create_optimizer's build logs the auto values
            return super().call_model_init(trial)

    def _ensure_engine(self) -> None:
        if self.optimizer is None:
            self.create_optimizer()

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        cfg = self.infinity_config(model)
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if engine_of(model) is not None:
            raise UsageError("InfinityTrainer: this model is already managed by infinity.initialize; pass the model "
                             "itself (built plainly or under infinity.Init) and let the Trainer initialize it")
        _, self.optimizer = infinity.initialize(model, config=cfg, param_groups=groups)
        # Note [InfinityTrainer seams] (gradient accumulation): the Trainer already divides by it.
        self.optimizer.grad_scale = 1.0 / self.optimizer.engine.world_size
        self._infinity_cfg = cfg
        self._count_as_prepared(model)
        if self._flag_meaning is FlagMeaning.AUTOCAST:
            autocast_forward(model, self.accelerator)
        if cfg.zero.stage == 3:
            synced_generate(model)
        logger.info("InfinityTrainer: ZeRO stage %d, optimizer %s lr=%g, %d parameter groups", cfg.zero.stage,
                    cfg.optimizer.type, cfg.optimizer.lr, len(groups))
        return self.optimizer

    def _count_as_prepared(self, model) -> None:
        """So that evaluation_loop does not prepare the model: accelerate would move it (its
        parameters are shards) or wrap it (no DDP: infinity reduces the gradients). Again at
        each try of ``auto_find_batch_size``, whose ``free_memory`` forgets it."""
        if model not in self.accelerator._models:
            self.accelerator._models.append(model)

    def _inner_training_loop(self, *args, **kwargs):
        """Note [batch size retries]: with ``auto_find_batch_size`` the Trainer runs its inner
        loop again with a smaller batch (0.9x, accelerate's ``find_executable_batch_size``)
        when a try raises an error ``should_reduce_batch_size`` recognises: CUDA's
        ``torch.OutOfMemoryError``, the emulated device's, the engine's own budget
        (Note [device budget] in infinity/_runtime/_accelerator/__init__.py). The engine is
        built once, at the first try, and kept: a forward or backward that raised has freed
        what it held (Note [aborted forward] in infinity/_zero/_engine.py), and the failed try's
        gradients are dropped here (``zero_grad``, which also ends a backward that raised), so
        the next try starts from the parameters and optimizer states the failed one found,
        and trains as a plain Trainer started at the batch size found. A try that ran out of
        memory after some optimizer steps keeps them, as the plain Trainer keeps its model's;
        a warning says how many. Each try's scheduler is a new one (``_prepare_for_training``),
        and the model is counted as prepared again."""
        try:
            return super()._inner_training_loop(*args, **kwargs)
        except Exception as e:
            if self.args.auto_find_batch_size and self.optimizer is not None and should_reduce_batch_size(e):
                self.optimizer.zero_grad()
                taken = self.state.global_step - getattr(self, "_initial_global_step", 0)  # this try's
                if taken > 0:
                    logger.warning("InfinityTrainer: out of device memory after %d optimizer step(s) at batch size %d; "
                                   "the Trainer retries with a smaller batch from the model those steps left, as the "
                                   "plain Trainer does", taken, self._train_batch_size)
            raise

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        cfg = self._infinity_cfg
        if self.lr_scheduler is None and cfg is not None and cfg.scheduler.type != "none":
            warmup = self.args.get_warmup_steps(num_training_steps)
            if self._is_deepspeed:
                self._check_schedule_steps(num_training_steps, max(1, warmup))
            self.lr_scheduler = make_scheduler(optimizer or self.optimizer, cfg, num_training_steps, warmup)
            self._created_lr_scheduler = True
        else:
            super().create_scheduler(num_training_steps, optimizer)
        # an fp16 overflow, or an inf/NaN step under precision.on_nonfinite: skip (Note [non-finite steps] in
        # _zero_optimizer.py)
        can_skip = cfg is not None and (cfg.precision.dtype == "fp16" or cfg.precision.on_nonfinite == "skip")
        if can_skip and self.optimizer is not None and not isinstance(self.lr_scheduler, _SkipOnOverflow):
            self.lr_scheduler = _SkipOnOverflow(self.lr_scheduler, self.optimizer)
        return self.lr_scheduler

    def _check_schedule_steps(self, total: int, warmup: int) -> None:
        """As transformers does: a DeepSpeed scheduler's step counts that are not "auto" must
        agree with the run's (max_steps; max(1, the TrainingArguments' warm-up))."""
        problems = []
        for key, run in (("total_num_steps", total), ("warmup_num_steps", warmup)):
            given = _get(self._infinity_source, f"scheduler.params.{key}")
            if given not in (None, "auto") and given != run:
                problems.append(f"scheduler.params.{key}={given} differs from the run's {run}")
        if problems:
            raise UsageError("; ".join(problems) + "; set them to 'auto' (or make TrainingArguments' max_steps and "
                             "warmup_steps agree)")

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Note [InfinityTrainer seams]: initialize instead of accelerate's prepare."""
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        self._count_as_prepared(self.model)
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.model
        if resume_from_checkpoint is not None:
            extra = infinity.load_checkpoint(resume_from_checkpoint, self.model, self.optimizer, tag=CHECKPOINT_TAG)
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    def _prepare_input(self, data):
        """Note [InfinityTrainer seams] (batches): tensors to ``infinity.device()`` once the
        engine owns the model; before that, where the Trainer puts them."""
        if engine_of(self.model) is None:
            return super()._prepare_input(data)
        if isinstance(data, Mapping):
            return type(data)({k: self._prepare_input(v) for k, v in data.items()})
        if isinstance(data, (tuple, list)):
            return type(data)(self._prepare_input(v) for v in data)
        if isinstance(data, torch.Tensor):
            return data.to(infinity.device())
        return data

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        if self.optimizer is not None:  # checked with the gradients: Note [non-finite steps] in _zero_optimizer.py
            self.optimizer.note_loss(loss)
        return loss.to(self.args.device)  # the Trainer sums the losses on args.device (Note [InfinityTrainer seams])

    def _clip_grad_norm(self, model):
        return None  # infinity clips inside optimizer.step() (gradient_clipping = max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm  # the norm exists only inside infinity's step: logged below, after it

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        opt = self.optimizer
        if grad_norm is None and opt is not None and not opt.skipped:
            grad_norm = opt.last_grad_norm  # this step's norm before clipping, as the Trainer logs it
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def evaluation_loop(self, *args, **kwargs):
        self._ensure_engine()  # a model built under Init has no values until initialize adopts it
        return super().evaluation_loop(*args, **kwargs)

    # ------------------------------------------------------------ checkpoints and saving

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``resume_from_checkpoint=True`` resumes from the newest checkpoint that was saved
        whole: Trainer's own choice is the highest-numbered ``checkpoint-N``, which a run killed
        in the middle of a save leaves without its infinity states."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
        out = super().train(resume_from_checkpoint, *args, **kwargs)
        if self._save_async:
            self._rotate_committed()  # the last asynchronous save is committed, then rotated
        else:
            engine = engine_of(self.model)
            if engine is not None:
                finish_pending(engine, "InfinityTrainer.train")
        return out

    def _save_checkpoint(self, model, trial) -> None:
        """Note [rotation after the commit]: the Trainer rotates at the end of each save
        (``save_total_limit``, keeping the newest directory), but an asynchronous save's newest
        directory is not complete until infinity commits in the background: with a limit of 1
        the rotation would delete the only complete checkpoint while the new one is still
        written, and a crash then would leave nothing to resume from. So with ``save_async``
        the save runs with the rotation off, and the rotation runs once that save has
        committed: at the next save, which waits for it first, and at the end of ``train``.
        A save that failed raises there before anything is deleted."""
        if not self._save_async:
            return super()._save_checkpoint(model, trial)
        self._rotate_committed(trial)
        args = self.args
        self.args = _ArgsView(args, save_total_limit=None)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args = args
        return None

    def _rotate_committed(self, trial=None) -> None:
        """Collective: wait for the save in flight, then rotate as the Trainer would have."""
        engine = engine_of(self.model)
        if engine is not None:
            finish_pending(engine, "InfinityTrainer")
        if self.args.should_save:
            rotate_checkpoints(self._get_output_dir(trial=trial), self.args.save_total_limit,
                               self.state.best_model_checkpoint, use_mtime=True)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # the weights come back with the optimizer states in _prepare_for_training
        if not os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_TAG)):
            raise UsageError(f"{resume_from_checkpoint} holds no infinity checkpoint ({CHECKPOINT_TAG}/); resume from "
                             f"a checkpoint directory InfinityTrainer saved")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # A run killed between infinity's commit and the Trainer's state left this step's directory
        # partial; the resumed run saves the same step again (the Trainer rewrites its own files).
        stale = os.path.join(output_dir, CHECKPOINT_TAG)
        if comm.rank() == 0 and os.path.isdir(stale) and not os.path.exists(os.path.join(output_dir, "trainer_state.json")):
            logger.warning("InfinityTrainer: replacing the states in %s, left by a run that stopped during this save",
                           output_dir)
            shutil.rmtree(stale)
        infinity.save_checkpoint(output_dir, self.model, self.optimizer, tag=CHECKPOINT_TAG,
                                 client_state={"lr_scheduler": self.lr_scheduler.state_dict()},
                                 blocking=not self._save_async)

    def _save_scaler(self, output_dir: str) -> None:
        pass  # fp16 loss scaling lives in infinity's optimizer, saved with its checkpoint

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """A normal Hugging Face directory (safetensors, config.json, tokenizer). Collective.
        Inside a checkpoint the weights are in its infinity checkpoint instead (export one
        with ``python -m infinity.export``), unless ``save_only_model``."""
        if engine_of(self.model) is None:
            return super().save_model(output_dir, _internal_call)
        if _internal_call and not self.args.save_only_model:
            return None
        output_dir = output_dir or self.args.output_dir
        export_safetensors(self.model, output_dir)
        if self.args.should_save:
            generation_config = getattr(self.model, "generation_config", None)
            if generation_config is not None:
                generation_config.save_pretrained(output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        return None


_WITH_INFINITY: dict = {}


def with_infinity(trainer_cls: type) -> type:
    """``trainer_cls`` (any ``transformers.Trainer`` subclass: TRL's ``SFTTrainer``,
    ``DPOTrainer``, one of your own) on infinity: the class ``Infinity<Name>(InfinityTrainer,
    trainer_cls)``, constructed as ``trainer_cls`` is, plus ``infinity_config=`` (and
    ``strict=``), with everything of Note [InfinityTrainer seams]. For TRL's trainers the
    class also has ``InfinityTRLMixin`` first (Note [TRL on infinity] in trl.py: the seams
    checked at construction, the reference model partitioned, features that cannot work
    refused). The same class is returned for the same ``trainer_cls``."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise UsageTypeError(f"with_infinity takes a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, InfinityTrainer):
        return trainer_cls
    if trainer_cls not in _WITH_INFINITY:
        bases: tuple = (InfinityTrainer, trainer_cls)
        if any(c.__module__.startswith("trl.") for c in trainer_cls.__mro__):
            from .trl import InfinityTRLMixin  # late: TRL is optional, needed only for its trainers

            bases = (InfinityTRLMixin,) + bases
        _WITH_INFINITY[trainer_cls] = type(f"Infinity{trainer_cls.__name__}", bases,
                                           {"__module__": __name__, "__doc__": with_infinity.__doc__})
    return _WITH_INFINITY[trainer_cls]

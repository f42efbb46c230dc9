"""A zoo of tiny Hugging Face architectures for the Init parity tests (tests/integration/test_model_zoo.py).

Each architecture is named by its ``model_type`` and the auto mapping its model class is taken
from (so the zoo follows transformers as it moves: a model type or class it no longer has is
skipped with that reason, never dropped), with a tiny config (hidden 16-32, 1-2 layers,
vocabulary 96, sequences of 8), every dropout-like probability 0 so that a forward is a function
of the weights and the batch alone. ``batch`` makes the inputs of one step, ``loss`` its loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

VOCAB, SEQ = 96, 8
_DENSE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
_MOE = dict(_DENSE, num_local_experts=4, num_experts_per_tok=2)


@dataclass(frozen=True, eq=False)
class Arch:
    name: str
    model_type: str
    task: str  # causal, masked, seq2seq, speech, image, clip, vlm
    config: dict = field(default_factory=dict)
    checkpointing: bool = True  # supports gradient_checkpointing_enable()
    per_row_loss: bool = True  # the loss of a batch is the mean of its rows' (not CLIP's: in-batch negatives)
    why: str = ""  # what the entry stands for in the zoo

    @property
    def generates(self) -> bool:
        return self.task in ("causal", "seq2seq")


ZOO = [
    # decoder LMs: dense, tied / untied heads, padding indices, soft-capping, sliding windows
    Arch("llama", "llama", "causal", _DENSE, why="dense, untied head"),
    Arch("llama_tied", "llama", "causal", dict(_DENSE, tie_word_embeddings=True), why="tied head"),
    Arch("mistral", "mistral", "causal", dict(_DENSE, sliding_window=4), why="sliding window"),
    Arch("qwen2", "qwen2", "causal", _DENSE),
    Arch("qwen3", "qwen3", "causal", dict(_DENSE, head_dim=16)),
    Arch("gemma", "gemma", "causal", dict(_DENSE, head_dim=16), why="padding idx, tied"),
    Arch("gemma2", "gemma2", "causal", dict(_DENSE, head_dim=16, sliding_window=4, final_logit_softcapping=30.0,
                                            attn_logit_softcapping=50.0), why="soft-capping"),
    Arch("gemma3_text", "gemma3_text", "causal", dict(_DENSE, head_dim=16, sliding_window=4)),
    Arch("phi3", "phi3", "causal", dict(_DENSE, pad_token_id=0), why="padding idx"),
    Arch("phi", "phi", "causal", dict(_DENSE, num_key_value_heads=2)),
    Arch("opt", "opt", "causal", dict(vocab_size=VOCAB, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64,
                                      num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
                                      pad_token_id=1), why="padding idx, learned positions"),
    Arch("gpt2", "gpt2", "causal", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                        bos_token_id=1, eos_token_id=2)),
    Arch("gpt_neox", "gpt_neox", "causal", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=2,
                                                max_position_embeddings=64)),
    Arch("falcon", "falcon", "causal", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=2)),
    Arch("bloom", "bloom", "causal", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2)),
    Arch("gptj", "gptj", "causal", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                        rotary_dim=8)),
    Arch("starcoder2", "starcoder2", "causal", dict(_DENSE, sliding_window=4)),
    Arch("olmo2", "olmo2", "causal", dict(_DENSE, pad_token_id=0), why="padding idx"),
    Arch("stablelm", "stablelm", "causal", dict(_DENSE, num_key_value_heads=2)),
    # encoders
    Arch("bert", "bert", "masked", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=64), why="padding idx"),
    Arch("roberta", "roberta", "masked", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=2, intermediate_size=64,
                                              max_position_embeddings=64)),
    Arch("albert", "albert", "masked", dict(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=64, max_position_embeddings=64),
         checkpointing=False, why="shared layers"),
    # encoder-decoders
    Arch("t5", "t5", "seq2seq", dict(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2,
                                     relative_attention_num_buckets=8, decoder_start_token_id=0)),
    Arch("bart", "bart", "seq2seq", dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                         decoder_ffn_dim=64, max_position_embeddings=64)),
    Arch("whisper", "whisper", "speech", dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                              encoder_attention_heads=2, decoder_attention_heads=2,
                                              encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                                              max_source_positions=8, max_target_positions=32, pad_token_id=0,
                                              decoder_start_token_id=1, eos_token_id=2, bos_token_id=1,
                                              suppress_tokens=None, begin_suppress_tokens=None),
         why="sinusoidal positions copied in"),
    # vision and vision-language
    Arch("vit", "vit", "image", dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, num_labels=4)),
    # logit scale 1 (not 14): the keys' biases, whose true gradient is 0, get rounding noise 14 times smaller
    Arch("clip", "clip", "clip", dict(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=SEQ, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2), projection_dim=16, logit_scale_init_value=0.0),
         per_row_loss=False),
    Arch("llava", "llava", "vlm", dict(
        text_config=dict(model_type="llama", **_DENSE),
        vision_config=dict(model_type="clip_vision_model", image_size=16, patch_size=8, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        image_token_index=VOCAB - 1, vision_feature_layer=-1, image_seq_length=4), why="vision tower"),
    # state-space and hybrid
    Arch("mamba", "mamba", "causal", dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2,
                                          expand=2, conv_kernel=4, pad_token_id=0)),
    Arch("jamba", "jamba", "causal", dict(_MOE, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                          expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                                          mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False)),
    # mixture of experts
    Arch("mixtral", "mixtral", "causal", _MOE),
    Arch("qwen2_moe", "qwen2_moe", "causal", dict(_DENSE, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    Arch("qwen3_moe", "qwen3_moe", "causal", dict(_DENSE, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32)),
    Arch("deepseek_v3", "deepseek_v3", "causal", dict(
        _DENSE, num_key_value_heads=2, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)),
    Arch("gpt_oss", "gpt_oss", "causal", dict(_DENSE, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                              sliding_window=4)),
]
BY_NAME = {a.name: a for a in ZOO}
assert len(BY_NAME) == len(ZOO)

_MAPPINGS = {"causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
             "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
             "speech": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
             "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "clip": "MODEL_MAPPING_NAMES",
             "vlm": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"}


def _no_dropout(cfg) -> None:
    """Every dropout-like probability of a config (and its sub-configs) 0: a forward is then a
    function of weights and batch (layer drop too, which draws from the RNG)."""
    for key, value in list(vars(cfg).items()):
        if isinstance(value, float) and ("drop" in key or key.endswith("_pdrop")):
            setattr(cfg, key, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _no_dropout(value)


def model_class(arch: Arch):
    """The class the auto mapping names for this model type, or the reason there is none."""
    import transformers
    from transformers.models.auto import modeling_auto

    mapping = getattr(modeling_auto, _MAPPINGS[arch.task], {})
    name = mapping.get(arch.model_type)
    if name is None:
        return None, f"transformers {transformers.__version__} maps no {arch.task} model for {arch.model_type!r}"
    cls = getattr(transformers, name, None)
    if cls is None:
        return None, f"transformers {transformers.__version__} has no class {name}"
    return cls, ""


def config(arch: Arch):
    from transformers import AutoConfig

    kw = dict(arch.config)
    cfg = AutoConfig.for_model(arch.model_type, **kw)
    cfg.use_cache = False
    _no_dropout(cfg)
    return cfg


def build(arch: Arch, seed: int = 0, checkpointing: bool = False):
    """The model from its config, seeded; in train mode (no dropout anywhere)."""
    cls, _ = model_class(arch)
    cfg = config(arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def batch(arch: Arch, step: int, rows: int = 4, seed: int = 1) -> dict:
    """The inputs (with labels) of a global batch of ``rows``; each step's different."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ids = torch.randint(3, VOCAB - 1, (rows, SEQ), generator=g)
    if arch.task in ("causal", "masked"):
        return {"input_ids": ids, "labels": ids}
    if arch.task == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(3, VOCAB - 1, (rows, SEQ // 2), generator=g)}
    if arch.task == "speech":
        cfg = arch.config
        feats = torch.randn(rows, cfg["num_mel_bins"], 2 * cfg["max_source_positions"], generator=g)
        return {"input_features": feats, "labels": ids[:, : SEQ // 2]}
    pixels = torch.randn(rows, 3, 16, 16, generator=g)
    if arch.task == "image":
        return {"pixel_values": pixels, "labels": torch.randint(0, 4, (rows,), generator=g)}
    if arch.task == "clip":  # the text is pooled at its end of sequence: the last token, which attends to all
        ids[:, -1] = arch.config["text_config"]["eos_token_id"]
        return {"input_ids": ids, "pixel_values": pixels, "return_loss": True}
    image = torch.full((rows, arch.config["image_seq_length"]), arch.config["image_token_index"])
    text = torch.cat([image, ids], dim=1)
    return {"input_ids": text, "pixel_values": pixels, "labels": torch.where(text == image[0, 0], -100, text)}


def shard(inputs: dict, rank: int, world: int) -> dict:
    """This rank's rows of a global batch (flags stay as they are)."""
    return {k: v.chunk(world)[rank] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def loss(model, inputs: dict) -> torch.Tensor:
    return model(**inputs).loss


def prompt(arch: Arch) -> Optional[torch.Tensor]:
    if not arch.generates:
        return None
    return torch.randint(3, VOCAB - 1, (2, 5), generator=torch.Generator().manual_seed(7))

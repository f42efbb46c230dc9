"""A tiled model saves and exports as the model it was: Note [untiled export] in infinity/_zero/_tiling.py.

Checkpoints keep the tiles (resume needs the same tiling) and record where each sits; the
streamed ``python -m infinity.export`` and the live ``export_safetensors`` write the original
names and shapes, row-interleaving tiles that split the input features. Two gloo ranks, so
every tile's bytes come from both ranks' shard files."""
import os

import pytest
import torch
import torch.nn.functional as F
from _configs import zero_config
from safetensors.torch import load_file
from torch import nn

import infinity
from infinity._checkpoint._safetensors_export import export_safetensors
from infinity.export import export_checkpoint
from infinity.testing import run_ranks
from infinity.tiling import TiledLinear

VOCAB, HIDDEN, LR = 48, 16, 1e-2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        logits = self.head(x + self.down(F.gelu(self.up(x))))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


# down has 65 parameters per output row > 40: it is split along its input features too
TILING = {"enabled": True, "min_params": 100, "max_tile_params": 40}


def _train_save_export(root):
    import torch.distributed as dist

    torch.manual_seed(0)
    model, opt = infinity.initialize(Net(), zero_config(3, lr=LR, prefetch={"persistence_threshold": 0}, tiling=TILING))
    assert isinstance(model.down, TiledLinear) and model.down.in_splits > 1
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (4, 8), generator=g)
        model(ids.chunk(2)[dist.get_rank()]).backward()
        opt.step()
        opt.zero_grad()
    infinity.save_checkpoint(os.path.join(root, "ckpt"), model, opt, tag="t")
    export_safetensors(model, os.path.join(root, "live"))
    with infinity.GatheredParameters(list(model.parameters())):
        return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiled")
    return root, run_ranks(_train_save_export, 2, str(root), timeout=300)[0]


def test_checkpoint_and_live_exports_have_the_untiled_names(saved):
    tmp_path, trained = saved
    untiled = Net().state_dict()
    assert {k: tuple(v.shape) for k, v in trained.items()} == {k: tuple(v.shape) for k, v in untiled.items()}
    export_checkpoint(str(tmp_path / "ckpt" / "t"), str(tmp_path / "streamed"))
    for where in ("streamed", "live"):
        files = load_file(str(tmp_path / where / "model.safetensors"))
        assert set(files) == set(untiled), where
        for k, v in trained.items():
            assert torch.equal(files[k], v), (where, k)
    plain = Net()
    plain.load_state_dict(load_file(str(tmp_path / "streamed" / "model.safetensors")))  # strict: every name matches
    assert torch.equal(plain.down.weight, trained["down.weight"])


def _resume(root):
    torch.manual_seed(0)
    model, opt = infinity.initialize(Net(), zero_config(3, lr=LR, prefetch={"persistence_threshold": 0}, tiling=TILING))
    infinity.load_checkpoint(os.path.join(root, "ckpt"), model, opt, tag="t")
    with infinity.GatheredParameters(list(model.parameters())):
        return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_tiled_checkpoint_resumes_at_another_world_size(saved):
    tmp_path, trained = saved
    resumed = _resume(str(tmp_path))
    for k, v in trained.items():
        assert torch.equal(resumed[k], v), k


def test_hf_save_pretrained_of_a_tiled_gpt2_loads_untiled(tmp_path):
    """The documented way to save a stage-3 model: save_pretrained inside GatheredParameters. The
    tied, tiled embedding and head are written once, as GPT-2 names them, and load into plain GPT-2."""
    from _models import batches, gpt2
    from transformers import GPT2LMHeadModel

    cfg = zero_config(3, lr=LR, prefetch={"persistence_threshold": 0},
                      tiling={"enabled": True, "min_params": 1000, "max_tile_params": 1000})
    model, opt = infinity.initialize(gpt2(), cfg)
    for ids in batches(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    with infinity.GatheredParameters(list(model.parameters())):
        trained = {k: v.clone() for k, v in model.state_dict().items()}
        model.save_pretrained(str(tmp_path))
    assert not list(model.lm_head.named_parameters(recurse=False))  # saving did not re-tie a whole weight onto it
    back = GPT2LMHeadModel.from_pretrained(str(tmp_path)).state_dict()
    assert set(back) == set(trained)
    for k, v in trained.items():
        assert torch.equal(back[k], v), k

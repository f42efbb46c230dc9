"""``python -m infinity.check_model``: a user's model built both ways, compared, one step taken;
the exit status says whether anything differs and the output names what."""
import subprocess
import sys

import torch
from torch import nn

from infinity import check_model


class CopiesThroughNumpy(nn.Module):
    """Initializes a weight by writing into ``weight.data.numpy()``: memory Init cannot see."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.weight.data.numpy()[:] = 0.5

    def forward(self, input_ids):
        return self.lin(torch.nn.functional.one_hot(input_ids % 4, 4).float())


class Fine(CopiesThroughNumpy):
    def __init__(self):
        nn.Module.__init__(self)
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight[0].zero_()


def test_a_hugging_face_config_directory_checks_clean(tmp_path):
    from transformers import OPTConfig

    OPTConfig(vocab_size=64, hidden_size=16, word_embed_proj_dim=16, num_hidden_layers=1, ffn_dim=32,
              num_attention_heads=2, max_position_embeddings=32, pad_token_id=1).save_pretrained(str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "infinity.check_model", str(tmp_path), "--tiny"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all bit-identical" in out.stdout and "one AdamW step: equal within 1e-6" in out.stdout


def test_a_custom_model_is_checked_through_its_step(capsys):
    assert check_model.main([f"{__name__}:Fine"]) == 0
    assert "one AdamW step: equal within 1e-6" in capsys.readouterr().out


def test_what_init_refuses_is_reported_by_name_and_fails(capsys):
    assert check_model.main([f"{__name__}:CopiesThroughNumpy"]) == 1
    out = capsys.readouterr().out
    assert "raised UsageError" in out and "Linear.weight" in out and "numpy" in out


def test_a_difference_says_how_the_tensors_differ():
    plain = {"parameter emb": torch.randn(4, 3), "parameter b": torch.ones(2)}
    other = {"parameter emb": torch.zeros(4, 3), "parameter b": torch.tensor([1.0, 2.0])}
    assert check_model.compare(plain, other) == ["parameter b: 1 of 2 elements differ (max 1), rows [1]",
                                                 "parameter emb: all zero under Init"]


def test_a_bad_argument_exits_2(tmp_path):
    assert check_model.main([str(tmp_path / "missing.json")]) == 2

"""A missing ``nvme_path`` is made one level deep inside an existing directory, never at the
filesystem root and never as a chain of parents (Note [swap directories] in _offload/_swap.py)."""
import os
import uuid

import pytest
import torch

import infinity
from infinity._offload._swap import SwapDir


def _nvme_config(path: str) -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": path},
                     "offload_optimizer": {"device": "nvme", "nvme_path": path}}, "precision": {"dtype": "fp32"}}


def test_a_placeholder_at_the_root_is_refused_not_created():
    placeholder = f"/infinity-placeholder-{uuid.uuid4().hex[:8]}"  # as /local_nvme in the example configs
    with pytest.raises(infinity.InfinityError, match="does not create it at the filesystem root") as info:
        infinity.initialize(torch.nn.Linear(4, 4), _nvme_config(placeholder))
    assert isinstance(info.value, ValueError) and "nvme_path" in str(info.value)
    assert not os.path.exists(placeholder)


def test_a_missing_parent_is_refused_by_name(tmp_path):
    path = tmp_path / "no-such-mount" / "swap"
    with pytest.raises(infinity.InfinityError, match=f"in {tmp_path / 'no-such-mount'}, which does not exist"):
        SwapDir(str(path), rank=0)
    assert not (tmp_path / "no-such-mount").exists()


def test_a_missing_directory_inside_an_existing_one_is_made(tmp_path):
    swap = SwapDir(str(tmp_path / "swap"), rank=0)
    assert os.path.isdir(swap.path) and swap.path.startswith(str(tmp_path / "swap") + os.sep)
    swap.remove()
    assert not (tmp_path / "swap").exists()  # made by this process, gone with its last swap directory


def test_a_made_directory_stays_while_another_swap_directory_is_in_it(tmp_path):
    first = SwapDir(str(tmp_path / "swap"), rank=0)
    second = SwapDir(str(tmp_path / "swap"), rank=0)  # another engine's (Init's, then initialize's)
    first.remove()
    assert os.listdir(tmp_path / "swap") == [os.path.basename(os.path.dirname(second.path))]
    second.remove()
    assert not (tmp_path / "swap").exists()


def test_an_existing_directory_is_never_removed(tmp_path):
    (tmp_path / "swap").mkdir()
    SwapDir(str(tmp_path / "swap"), rank=0).remove()
    assert os.listdir(tmp_path / "swap") == []

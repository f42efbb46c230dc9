"""A client state as a checkpoint holds it: JSON and safetensors, back as it went in, and what
is not data refused naming its key path (Note [data, never code] in infinity/_checkpoint/_files.py)."""
import json

import numpy as np
import pytest
import torch

from infinity._checkpoint._files import (
    CLIENT_JSON,
    CLIENT_TENSORS,
    client_state_files,
    decode_client_state,
    parse_tensors,
)
from infinity.errors import StorageError, UsageError


def _round_trip(value):
    files = client_state_files(value)
    tree = json.loads(files[CLIENT_JSON])  # plain JSON: any reader can read it
    tensors, _ = parse_tensors(files[CLIENT_TENSORS], CLIENT_TENSORS)
    return decode_client_state(tree, tensors, CLIENT_JSON)


def test_values_come_back_with_their_types():
    value = {"a": [1, 2.5, None, True, "s"], "t": (1, (2, [3])), 4: {"x": torch.ones(2, dtype=torch.bfloat16)},
             "floats": [float("inf"), -0.0, 1e-310], "big": -(2 ** 80), "empty": {}, "tensor": torch.arange(4)}
    back = _round_trip(value)
    assert list(back) == list(value)
    assert back["t"] == (1, (2, [3])) and type(back["t"][1]) is tuple
    assert back[4]["x"].dtype == torch.bfloat16 and torch.equal(back[4]["x"], value[4]["x"])
    assert [repr(f) for f in back["floats"]] == ["inf", "-0.0", "1e-310"] and back["big"] == -(2 ** 80)
    assert torch.equal(back["tensor"], value["tensor"]) and back["empty"] == {} and back["a"] == value["a"]
    assert repr(_round_trip([float("nan")])[0]) == "nan"


@pytest.mark.parametrize("value,path,kind", [
    ({"f": lambda: 0}, "client_state['f']", "a function"),
    ({"x": [1, np.float32(1)]}, "client_state['x'][1]", "a numpy.float32"),
    ({"s": {1, 2}}, "client_state['s']", "a builtins.set"),
    ([object()], "client_state[0]", "a builtins.object"),
    ({(1, 2): 3}, "client_state key (1, 2)", "a tuple"),
    ({"z": torch.ones(2, dtype=torch.complex64)}, "client_state['z']", "a torch.strided torch.complex64 tensor"),
])
def test_what_is_not_data_is_refused_naming_it(value, path, kind):
    with pytest.raises(UsageError) as e:
        client_state_files(value)
    assert f"{path} is {kind}" in str(e.value) and "no pickle" in str(e.value)


def test_the_reserved_key_is_refused_and_a_changed_file_is_named():
    with pytest.raises(UsageError, match="reserves"):
        client_state_files({"a": {"__infinity__": 1}})
    with pytest.raises(StorageError, match="client_state.json: a tensor entry is malformed"):
        decode_client_state({"__infinity__": "tensor", "key": "9"}, {}, "client_state.json")

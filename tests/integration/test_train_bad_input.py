"""Bad input to ``python -m infinity.train`` ends in an exit-2 message naming what to change,
never a traceback: an nvme_path that cannot be a directory (below a file, on a read-only
mount), data that is not text (a binary .jsonl line, a binary .txt: Note [binary data] in
_train_data.py), a seq_len the model cannot take or whose activations cannot fit host memory,
and a preflight whose figures show the shortfall."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys

import pytest
from test_aio_errors import mounted

from infinity import train
from infinity._apps._train_data import DataError, read_texts
from infinity._offload._preflight import _amounts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 258, "n_positions": 64}


def _fails(capsys, args) -> str:
    before = signal.getsignal(signal.SIGTERM)
    code = train.main(args)
    assert signal.getsignal(signal.SIGTERM) is before  # the job's SIGTERM handler is its own, not its caller's
    err = capsys.readouterr().err
    assert code == train.EXIT_BAD_INPUT, err
    assert "infinity.train: error:" in err
    return err


def _config(tmp_path, **train_keys) -> str:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"zero": {"stage": 3}, "precision": {"dtype": "fp32"},
                                "train": {"model": TINY, "steps": 1, "save": False, **train_keys}}))
    return str(path)


def test_nvme_path_below_a_regular_file(capsys, tmp_path):
    (tmp_path / "plain").write_text("not a directory")
    err = _fails(capsys, ["--config", _config(tmp_path), "--offload", "nvme", "--nvme-path",
                          str(tmp_path / "plain" / "swap")])
    assert "nvme_path" in err and "plain' is a file" in err


def test_nvme_path_on_a_read_only_mount(capsys, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    with mounted("tmpfs", tmp_path / "ro", "ro,size=16m") as ro:
        for path in (ro, ro / "below" / "swap"):
            err = _fails(capsys, ["--config", _config(tmp_path), "--offload", "nvme", "--nvme-path", str(path)])
            assert "read-only file system" in err and "nvme_path" in err


def test_binary_jsonl_names_file_and_line(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"text": "fine"}\n' + b'{"text": "\xff\xfe\x00 bad"}\n')
    err = _fails(capsys, ["--config", _config(tmp_path), "--data", str(data)])
    assert "d.jsonl:2" in err and "not UTF-8" in err and "0xff" in err


def test_binary_txt_is_refused_with_the_fraction(capsys, tmp_path):
    data = tmp_path / "blob.txt"
    data.write_bytes(bytes(range(256)) * 64)  # half of it is not UTF-8, one byte in 256 is NUL
    err = _fails(capsys, ["--config", _config(tmp_path), "--data", str(data)])
    assert "blob.txt" in err and "does not look like text" in err
    assert "of its 16384 bytes" in err


def test_a_few_bad_bytes_in_a_txt_are_replaced_with_a_warning(tmp_path):
    warnings_seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings_seen.append(record.getMessage())
    logging.getLogger("infinity").addHandler(handler)
    try:
        _few_bad_bytes(tmp_path, warnings_seen)
    finally:
        logging.getLogger("infinity").removeHandler(handler)


def _few_bad_bytes(tmp_path, warnings_seen):
    data = tmp_path / "mostly.txt"
    data.write_bytes(b"plain words " * 1000 + b"\xff\x00")  # 2 of 12002 bytes
    (text,) = read_texts(str(data))
    assert text.endswith("\ufffd\ufffd") and "\x00" not in text
    assert any("mostly.txt" in m and "2 of its 12002 bytes" in m for m in warnings_seen)
    data.write_bytes(b"\x00" * 100)  # valid UTF-8, still not text
    with pytest.raises(DataError, match="100 of its 100 bytes"):
        read_texts(str(data))


def test_seq_len_beyond_the_models_positions_is_refused(capsys, tmp_path):
    err = _fails(capsys, ["--config", _config(tmp_path, model="gpt2-tiny", seq_len=100_000_000)])
    assert "at most 1024 positions" in err and "train.seq_len is 100000000" in err
    err = _fails(capsys, ["--config", _config(tmp_path, seq_len=65)])  # a model dict keeps its n_positions
    assert "at most 64 positions" in err


def test_activations_that_cannot_fit_host_memory_are_refused_before_building(capsys, tmp_path):
    from infinity.testing import peak_rss, reset_peak_rss

    huge = {**TINY, "n_positions": 1_000_000}  # its position table alone would take 256 MB: never built
    reset_peak_rss()
    before = peak_rss()
    err = _fails(capsys, ["--config", _config(tmp_path, model=huge, seq_len=1_000_000, micro_batch_size=64)])
    assert "train.seq_len 1000000 x train.micro_batch_size 64" in err and "of host memory is available" in err
    assert peak_rss() - before < 100 << 20


def test_preflight_figures_show_the_shortfall():
    MiB = 1 << 20
    assert _amounts(50 * MiB, 30 * MiB, 1, "of swap files ") == "50.00 MiB of swap files needed, 30.00 MiB"
    same = _amounts(52_428_800 + 1000, 52_428_800, 1)  # 0.05 GiB both: exact bytes instead
    assert same == "52,429,800 bytes needed, 52,428,800 bytes"
    assert _amounts(3 << 30, 2 << 30, 1) == "3.00 GiB needed, 2.00 GiB"


def test_no_traceback_from_the_command(tmp_path):
    (tmp_path / "plain").write_text("x")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "infinity.train", "--config", _config(tmp_path), "--offload", "nvme",
                           "--nvme-path", str(tmp_path / "plain" / "swap")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == train.EXIT_BAD_INPUT and "Traceback" not in proc.stderr, proc.stderr


HUGE = {"model_type": "gpt2", "n_layer": 24, "n_embd": 16384, "n_head": 64, "vocab_size": 258, "n_positions": 64}


@pytest.mark.parametrize("stage, offload, where", [(1, "cpu", "host memory"), (3, "cpu", "host memory"),
                                                    (3, "nvme", "disk under")])
def test_a_model_too_big_to_build_is_refused_before_building(capsys, tmp_path, stage, offload, where):
    """~77B parameters (308 GB in fp32): counted on the meta device and refused with the
    numbers before a parameter exists, on every path of the train job; peak RSS stays small."""
    from infinity.testing import peak_rss, reset_peak_rss

    if offload == "nvme" and os.geteuid() != 0:
        pytest.skip("a small disk for nvme_path is a tmpfs mount, which needs root")
    nvme = tmp_path / "nvme"
    with (mounted("tmpfs", nvme, "size=64m") if offload == "nvme" else contextlib.nullcontext()):
        reset_peak_rss()
        before = peak_rss()
        err = _fails(capsys, ["--config", _config(tmp_path, model=HUGE, seq_len=32), "--stage", str(stage),
                              "--offload", offload, "--nvme-path", str(nvme)])
        assert "counted before building" in err and where in err
        if stage == 3:  # the advice names the job's flags, not Init's arguments
            assert ("--offload nvme --nvme-path" if offload == "cpu" else "--nvme-path") in err and "Init(" not in err
        assert peak_rss() - before < 200 << 20, f"peak RSS rose by {(peak_rss() - before) >> 20} MiB"
        assert not nvme.exists() or not any(nvme.rglob("*.swp"))

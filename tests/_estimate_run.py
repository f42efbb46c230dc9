"""``python -m infinity.estimate`` run in-process for a test: (exit code, stdout, stderr)."""
from infinity._apps import _estimate_cli


def run_estimate(capsys, *args):
    try:
        code = _estimate_cli.main(list(args))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err

#!/usr/bin/env bash
# The integration tests against the newest releases of the libraries infinity integrates with, before
# they reach CI: run it on a schedule (a weekly job) or before raising a version in constraints.txt.
#
#   bash scripts/check_latest.sh            # the test files that use those libraries
#   bash scripts/check_latest.sh tests/     # any pytest arguments instead
#
# It makes a virtual environment beside the clone (.venv-latest, or $INFINITY_LATEST_VENV) that sees
# this environment's packages (torch, the built package) and upgrades only the integrated libraries
# in it, so the environment scripts/setup_env.sh made keeps the tested versions. It prints which
# package moved (tested -> newest) before the tests, so a failure below names its suspects; the
# exit status is pytest's. Raise a line of constraints.txt only after this passes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup_env.sh
packages=(transformers accelerate trl datasets peft tokenizers safetensors huggingface_hub)
venv=${INFINITY_LATEST_VENV:-.venv-latest}
[ -x "$venv/bin/python" ] || "$PY" -m venv --system-site-packages "$venv"
VPY="$venv/bin/python"
torch_pin="torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
echo "[latest] upgrading ${packages[*]} in $venv (torch kept at ${torch_pin#torch==})"
"$VPY" -m pip install -q --upgrade "${packages[@]}" "$torch_pin"

moved=0
echo "[latest] package          tested      installed   listed"
while read -r name tested; do
  newest=$("$VPY" -c "from importlib import metadata; print(metadata.version('$name'))")
  listed=$("$VPY" -m pip index versions "$name" 2>/dev/null | sed -n 's/^[^ ]* (\(.*\))$/\1/p' | head -1)
  mark=""
  if [ "$newest" != "$tested" ]; then mark="  <- moved"; moved=$((moved + 1)); fi
  if [ -n "$listed" ] && [ "$listed" != "$newest" ]; then
    mark="$mark  (the newest listed, $listed, does not install here: pip install $name==$listed says why)"
  fi
  printf '[latest] %-16s %-11s %-11s %s%s\n' "$name" "$tested" "$newest" "${listed:-?}" "$mark"
done < <("$PY" scripts/_deps.py pins "${packages[@]}")
echo "[latest] $moved of ${#packages[@]} packages moved since constraints.txt"

if [ "$#" -eq 0 ]; then
  mapfile -t files < <(grep -lE "^\s*(from|import) (transformers|trl|peft|datasets|accelerate)\b|importorskip\(\"(transformers|trl|peft|datasets|accelerate)\"" \
                         tests/unit/*.py tests/integration/*.py)
  set -- "${files[@]}"
fi
workers=$("$VPY" -c "import os; print(min(2, len(os.sched_getaffinity(0))))")
parallel=()
if [ "$workers" -ge 2 ]; then parallel=(-n "$workers" --dist loadfile); fi
exec "$VPY" -m pytest -q "${parallel[@]}" "$@"

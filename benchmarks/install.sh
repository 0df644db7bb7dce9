#!/usr/bin/env bash
# The Makefile's install on this machine, timed (BENCHMARKS.md, "Install"): a fresh venv and empty
# caches each, first the way the Makefile does it (pip for the CPU torch and uv, then uv for the
# package and its test extra), then pip alone for both steps, as it did before. Wall seconds per
# step; the two venvs' package lists are compared at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
TORCH=${TORCH_CPU:-torch==2.13.0}
step() {  # $1: name, then the command
  local name=$1 t0
  shift
  t0=$(date +%s.%N)
  "$@" > "$TMP/log" 2>&1 || { echo "$name: FAILED"; tail -5 "$TMP/log"; exit 1; }
  printf '%-34s %6.1f s\n' "$name" "$(python3 -c "print($(date +%s.%N) - $t0)")"
}
for way in uv pip; do
  export XDG_CACHE_HOME="$TMP/cache-$way"
  python3 -m venv "$TMP/$way"
  py="$TMP/$way/bin/python"
  if [ "$way" = uv ]; then
    step "uv: pip install torch uv" "$py" -m pip install -q "$TORCH" "${UV:-uv==0.13.9}"
    step "uv: uv pip install -e .[test]" "$TMP/$way/bin/uv" pip install -q --python "$py" --compile-bytecode -e '.[test]'
  else
    step "pip: pip install torch" "$py" -m pip install -q "$TORCH"
    step "pip: pip install -e .[test]" "$py" -m pip install -q -e '.[test]'
  fi
  "$py" -m pip freeze 2>/dev/null | grep -v '^uv==' | sort > "$TMP/$way.txt"
done
if diff "$TMP/uv.txt" "$TMP/pip.txt" > /dev/null; then echo "the same $(wc -l < "$TMP/pip.txt") packages"
else echo "the package lists differ:"; diff "$TMP/uv.txt" "$TMP/pip.txt" || true; fi

#!/usr/bin/env bash
# Formats the tree: ruff over the Python files (`ruff check --fix`, then
# `ruff format`; settings in pyproject.toml) and clang-format over the C++/CUDA
# sources of csrc/ (settings in .clang-format).
#
#   tools/format.sh            rewrite the files in place
#   tools/format.sh --check    change nothing; exit 1 if a file is not formatted
#                              or ruff reports a problem (the lint step of .ci/run)
#
# Tools: ruff as pinned in tools/requirements-lint.txt (`pip install -r
# tools/requirements-lint.txt`), clang-format 14 (RUFF / CLANG_FORMAT override).
set -uo pipefail
cd "$(dirname "$0")/.."

mode=apply
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: tools/format.sh [--check]" >&2; exit 2 ;;
esac

# The C++/CUDA files: what git tracks under csrc/ with these endings, except
# generated sources whose generator writes lines the formatter would rewrap
# (the asm operand lists of wgmma_ops.cuh; test_tools checks that committed
# generated files equal their generator's output). csrc/cuda/instantiations/*.cu
# are generated too, but already formatted, so they stay in.
CPP_EXCLUDE=(csrc/cuda/hopper/wgmma_ops.cuh)
cpp_files() {
  git ls-files -- 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' | grep -v -x -F "${CPP_EXCLUDE[@]/#/-e}"
}
# The Python files: ruff's own discovery from the repository root (it skips
# what .gitignore ignores and pyproject.toml's extend-exclude).

find_tool() {  # $1: override variable's value, then candidates
  local override=$1; shift
  if [[ -n $override ]]; then echo "$override"; return; fi
  for c in "$@"; do
    if command -v "$c" >/dev/null 2>&1; then echo "$c"; return; fi
  done
  return 1
}
RUFF_BIN=$(find_tool "${RUFF:-}" ruff) || {
  if python3 -m ruff --version >/dev/null 2>&1; then RUFF_BIN="python3 -m ruff"; else
    echo "format.sh: ruff not found; pip install -r tools/requirements-lint.txt" >&2; exit 2
  fi
}
CF_BIN=$(find_tool "${CLANG_FORMAT:-}" clang-format-14 clang-format) || {
  echo "format.sh: clang-format not found; apt-get install clang-format (version 14)" >&2; exit 2
}
want_ruff=$(sed -n 's/^ruff==//p' tools/requirements-lint.txt)
have_ruff=$($RUFF_BIN --version | awk '{print $2}')
[[ $have_ruff == "$want_ruff" ]] || echo "format.sh: warning: ruff $have_ruff, the pinned one is $want_ruff" >&2
cf_major=$($CF_BIN --version | sed -n 's/.*version \([0-9]*\).*/\1/p')
[[ $cf_major == 14 ]] || echo "format.sh: warning: clang-format $cf_major, the project's is 14" >&2

mapfile -t CPP < <(cpp_files)
status=0
if [[ $mode == apply ]]; then
  $RUFF_BIN check --fix --quiet . || status=1   # fixes what it can (import order, ...), reports the rest
  $RUFF_BIN format . || status=1
  $CF_BIN -i --style=file "${CPP[@]}" || status=1
  echo "format.sh: ruff on the Python files, clang-format on ${#CPP[@]} C++/CUDA files"
else
  echo "lint: ruff check"
  $RUFF_BIN check --output-format concise . || status=1
  echo "lint: ruff format --check"
  $RUFF_BIN format --check --output-format concise . || status=1
  echo "lint: clang-format --dry-run -Werror (${#CPP[@]} files)"
  if ! cf_out=$($CF_BIN --dry-run -Werror --style=file "${CPP[@]}" 2>&1); then
    status=1
    echo "$cf_out" | grep "error:" | sed 's/:[0-9]*:[0-9]*: error:.*//' | sort | uniq -c |
      awk '{print "  " $2 ": " $1 " places to reformat"}'
  fi
  if [[ $status != 0 ]]; then echo "lint: FAILED (tools/format.sh rewrites the files; ruff's other findings need a hand)"; fi
fi
exit $status

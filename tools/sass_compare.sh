#!/usr/bin/env bash
# sass_compare.sh: is a refactor of a CUDA kernel code-neutral? Compiles the
# given instantiation files in a baseline tree (the csrc/ of a git ref) and in
# the working tree with the flags setup.py passes to nvcc for sm_90a, dumps the
# SASS of the functions whose (mangled) name matches a pattern, normalizes it
# and diffs baseline against current; also compares ptxas -v's register /
# spill / stack lines of those functions.
#
#   tools/sass_compare.sh [-b REF] [-c REF] [-f REGEX] FILE.cu ...
#     -b REF    the baseline (default HEAD: compare uncommitted edits)
#     -c REF    compare this commit instead of the working tree
#     -f REGEX  which functions (grep -E on the mangled name; default
#               flash_fwd_sm90_ws_kernel, the warp-specialized Hopper forward)
#     FILE.cu   instantiation files, e.g. fwd_hdim64_bf16.cu (looked up in
#               csrc/cuda/instantiations/ when not a path)
#   Env: NVCC (default nvcc), CUOBJDUMP (default cuobjdump on PATH, else
#        triton's copy in the active Python environment), SASS_CACHE (where the
#        baseline dumps are kept, per commit: default /tmp/sass_compare).
#   Exit status 0 when every instance is identical, 1 otherwise.
#
# Normalized: the /*addr*/ comments and the encoding words (/* 0x... */) are
# dropped, the line-info (## File ... / .loc) lines too, whitespace squeezed;
# what is left is the instruction stream, so a moved line of source that
# compiles to the same code compares equal. Compile one file at a time: each
# takes tens of seconds.
set -euo pipefail
ref=HEAD
cur_ref=
fun=flash_fwd_sm90_ws_kernel
while getopts "b:c:f:" o; do
  case $o in b) ref=$OPTARG ;; c) cur_ref=$OPTARG ;; f) fun=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || { sed -n '2,26p' "$0"; exit 2; }
root=$(git rev-parse --show-toplevel)
NVCC=${NVCC:-nvcc}
# cuobjdump: on PATH (a full CUDA toolkit), else the copy triton ships inside torch's environment
# (the dev machine's toolkit has nvcc and ptxas but no cuobjdump).
triton_cuobjdump() {
  python3 -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))' \
    2> /dev/null
}
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || triton_cuobjdump)}
[ -x "$CUOBJDUMP" ] || { echo "sass_compare.sh: no cuobjdump (set CUOBJDUMP)" >&2; exit 2; }
commit=$(git -C "$root" rev-parse "$ref")
cache=${SASS_CACHE:-/tmp/sass_compare}/$commit
flags=(-O3 -std=c++17 --use_fast_math -lineinfo --expt-relaxed-constexpr
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__
  -U__CUDA_NO_BFLOAT16_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__
  -DFLASHATTN_WITH_CUDA '-DFLASHATTN_CUDA_ARCHS="90"' -DFLASHATTN_SM90
  -gencode arch=compute_90a,code=sm_90a -Xptxas -v)

# dump SRCROOT FILE OUTPREFIX: OUTPREFIX.sass (normalized, selected functions) and OUTPREFIX.regs
dump() {
  local src=$1/csrc/cuda/instantiations/$2 out=$3
  (cd "$(dirname "$src")" && "$NVCC" "${flags[@]}" -c "$(basename "$src")" -o "$out.o") 2> "$out.ptxas"
  "$CUOBJDUMP" -sass "$out.o" | awk -v re="$fun" '
    /Function : / { keep = ($3 ~ re) } keep' |
    sed -E 's@/\*[0-9a-f]{4,}\*/@@; s@/\* 0x[0-9a-f]+ \*/@@; /^[[:space:]]*$/d; /## File|\.loc/d; s/[[:space:]]+/ /g; s/ ;/;/' > "$out.sass"
  # ptxas -v: "Compiling entry function 'NAME'" then "Used N registers ..." lines
  awk -v re="$fun" '/Compiling entry function/ { name = $0; keep = (name ~ re) }
    keep && /registers|spill|stack frame/ { print name " :: " $0 }' "$out.ptxas" |
    sed -E 's/^ptxas info *: *//; s/ptxas info *: *//g' > "$out.regs"
}

status=0
for f in "$@"; do
  f=$(basename "$f")
  mkdir -p "$cache"
  if [ ! -s "$cache/$f.sass" ]; then
    tmp=$(mktemp -d)
    git -C "$root" archive "$commit" csrc | tar -x -C "$tmp"
    echo "baseline $f ($ref = ${commit:0:10})..." >&2
    dump "$tmp" "$f" "$cache/$f"
    rm -rf "$tmp"
  fi
  cur=$(mktemp -d)
  src=$root
  if [ -n "$cur_ref" ]; then
    src=$cur/tree && mkdir -p "$src" && git -C "$root" archive "$cur_ref" csrc | tar -x -C "$src"
  fi
  echo "current  $f${cur_ref:+ ($cur_ref)}..." >&2
  dump "$src" "$f" "$cur/$f"
  n=$(grep -c 'Function : ' "$cur/$f.sass" || true)
  if [ "$n" = 0 ]; then echo "$f: no function matches /$fun/" ; status=1; continue; fi
  if diff -q "$cache/$f.sass" "$cur/$f.sass" > /dev/null && diff -q "$cache/$f.regs" "$cur/$f.regs" > /dev/null; then
    echo "$f: IDENTICAL ($n functions, $(grep -vc 'Function :' "$cur/$f.sass") SASS lines)"
  else
    echo "$f: DIFFERENT"; status=1
    diff "$cache/$f.regs" "$cur/$f.regs" | head -20 || true
    diff "$cache/$f.sass" "$cur/$f.sass" | head -40 || true
  fi
  sed 's/^/  /' "$cur/$f.regs"
  rm -rf "$cur"
done
exit $status

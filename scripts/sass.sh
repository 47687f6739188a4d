#!/usr/bin/env bash
# What the compiler made of one CUDA source, without a GPU: compiles it to a cubin for one target
# (default sm_90a) with the library's flags, and prints each kernel's registers and spills (ptxas)
# and its instruction count and most frequent opcodes; the whole SASS goes to out/sass/.
#
#   scripts/sass.sh src/cuda/mla/decode_narrow.cu [ARCH] [KERNEL_REGEX]
#
# cuobjdump comes from the CUDA toolkit where it has one, else from PyPI's nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm (which it runs), installed once into .deps/cuobjdump (git-ignored). The GPU
# machine's equivalent, on the build it runs: scripts/gpu_run.sh build sass.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: scripts/sass.sh SOURCE.cu [ARCH, default 90a] [KERNEL_REGEX]}
arch=${2:-90a}
pattern=${3:-.}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
[ -x "$nvcc" ] || { echo "sass.sh: nvcc not found (the CUDA toolkit is needed to compile)" >&2; exit 1; }
cuobjdump=$(command -v cuobjdump || true)
[ -z "$cuobjdump" ] && [ -x "$(dirname "$nvcc")/cuobjdump" ] && cuobjdump=$(dirname "$nvcc")/cuobjdump
if [ -z "$cuobjdump" ]; then
  cuobjdump=$(find .deps/cuobjdump -name cuobjdump -type f 2>/dev/null | head -1 || true)
  if [ -z "$cuobjdump" ]; then
    echo "installing nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm from PyPI into .deps/cuobjdump" >&2
    python3 -m pip install -q --no-deps --target .deps/cuobjdump nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm >&2
    cuobjdump=$(find .deps/cuobjdump -name cuobjdump -type f | head -1)
  fi
  chmod +x "$cuobjdump" "$(dirname "$cuobjdump")/nvdisasm"
  export PATH="$(dirname "$cuobjdump"):$PATH"  # cuobjdump runs the nvdisasm beside it
fi
defines=(-DLKV_WITH_CUDA=1)
[[ "$arch" == 90a ]] && defines+=(-DLKV_HAVE_SM90A=1)
out=out/sass
mkdir -p "$out"
name=$(basename "$src" .cu)_sm$arch
"$nvcc" "${defines[@]}" -Iinclude -Isrc -O3 -DNDEBUG -std=c++20 --expt-relaxed-constexpr -arch=sm_"$arch" -cubin \
  -Xptxas -v "$src" -o "$out/$name.cubin" 2>"$out/$name.ptxas.txt"
"$cuobjdump" -sass "$out/$name.cubin" >"$out/$name.sass"
python3 - "$out/$name.ptxas.txt" "$out/$name.sass" "$pattern" <<'EOF'
import collections, re, sys
ptxas, sass, pattern = open(sys.argv[1]).read(), open(sys.argv[2]).read(), re.compile(sys.argv[3])
# ptxas -v: "Compiling entry function 'K'", then "Function properties for F" and F's spills, for K
# and for any device function K calls (not inlined), then K's "Used N registers".
usage, name, props = {}, None, None
for line in ptxas.splitlines():
    m = re.search(r"Compiling entry function '(\w+)'", line)
    if m:
        name = m.group(1)
    m = re.search(r"Function properties for (\w+)", line)
    if m:
        props = m.group(1)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and name and props == name:
        usage[name] = [m.group(1), m.group(2)]
    m = re.search(r"Used (\d+) registers", line)
    if m and name in usage:
        usage[name].insert(0, m.group(1))
for part in re.split(r"\n\s*Function : ", sass)[1:]:
    kernel = part.split("\n", 1)[0].strip()
    if not pattern.search(kernel):
        continue
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", part)
    regs, stores, loads = usage.get(kernel, ["?", "?", "?"])
    common = " ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(12))
    print(f"{kernel}\n  {regs} registers, spills {stores} B stored / {loads} B loaded; {len(ops)} instructions: {common}")
EOF
echo "SASS: $out/$name.sass"

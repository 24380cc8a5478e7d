#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) every wheel that the GPU benchmark run needs and the GPU image lacks, for
# Python 3.12 / x86-64 / torch 2.11+cu130 / transformers 5.17. Run here (with internet), then carry .whl to the
# GPU machine; run_gpu.sh installs it with `pip install --no-index --no-deps --target /tmp/site`.
#
#   bash benchmarks/fetch_wheels.sh            # all wheels
#   bash benchmarks/fetch_wheels.sh core       # loralei + PEFT/bnb + Liger only (no Unsloth stack)
#
# Versions, and why (each one read off the wheel's METADATA Requires-Dist; the image's package list is in the
# device notes, KINDS.md):
#   unsloth / unsloth_zoo 2026.10.9  allow transformers <=5.17.0 (the image's), trl <=1.15.0, datasets <5.
#   trl 1.15.0, datasets 4.8.5       newest that unsloth allows; unsloth imports both at import time.
#   dill 0.4.1, multiprocess 0.70.19 newest that datasets 4.8.5 allows (dill <0.4.2, multiprocess <0.70.20).
#   bitsandbytes 0.50.2              has libbitsandbytes_cuda130.so; Unsloth's loader needs it even for bf16.
#   torchao 0.18.0                   its C++ extensions load on torch >= 2.11.0 (its own import check).
#   liger-kernel 0.8.5               needs only torch and triton.
#   pydantic 2.14.4 (+ pydantic-core 2.50.5, annotated-types, typing-inspection, typing-extensions): loralei's
#       config; the image has none of them but typing-extensions, whose version is unknown there while
#       pydantic wants >=4.16, so a known one travels too.
# Not carried, although listed as requirements: xformers (0.0.35 does not load with torch 2.11; Unsloth falls
# back to SDPA), and Unsloth's lazily imported extras (tyro, diffusers, hf_transfer, msgspec, structlog, json5,
# cut_cross_entropy): nothing on the benchmark's path imports them.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
mkdir -p "$dest"
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
  manylinux2014_x86_64 manylinux1_x86_64)
core=(liger-kernel==0.8.5 torchao==0.18.0 bitsandbytes==0.50.2 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.7.0 typing-inspection==0.4.5 typing-extensions==4.16.0)
unsloth=(unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1
  multiprocess==0.70.19)
case ${1:-all} in
  core) wanted=("${core[@]}") ;;
  unsloth) wanted=("${unsloth[@]}" bitsandbytes==0.50.2) ;;
  all) wanted=("${core[@]}" "${unsloth[@]}") ;;
  *) echo "usage: $0 [all|core|unsloth]" >&2; exit 2 ;;
esac

download() {  # one pinned wheel for cp312 / manylinux x86-64, without its dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]/#/--platform=}" -d "$dest" "$1"
}

# Rewrites a wheel without the members matching the given regex (and their RECORD lines), so pip still
# installs it: RECORD must list exactly the files present, with their hashes.
strip_wheel() {
  local wheel=$1 drop=$2
  python3 - "$wheel" "$drop" <<'EOF'
import re, sys, zipfile, os
path, drop = sys.argv[1], re.compile(sys.argv[2])
tmp = path + ".tmp"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
    for info in src.infolist():
        if drop.search(info.filename):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            kept = [l for l in data.decode().splitlines() if l and not drop.search(l.split(",")[0])]
            data = ("\n".join(kept) + "\n").encode()
        out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
os.replace(tmp, path)
EOF
}

# One version of each package: pip refuses an install that has two.
rm -f "$dest"/*.whl
for spec in "${wanted[@]}"; do download "$spec"; done
for w in "$dest"/bitsandbytes-*.whl; do
  [ -e "$w" ] && strip_wheel "$w" 'libbitsandbytes_(cuda1[0-2][0-9]|rocm|xpu)[^/]*\.so$'
done
for w in "$dest"/unsloth-*.whl; do  # the Studio web app (front end and server) is no part of the library
  [ -e "$w" ] && strip_wheel "$w" '^studio/'
done
ls -l "$dest" | awk 'NR > 1 { printf "%8.2f MiB  %s\n", $5 / 2^20, $9 }'
du -cb "$dest"/*.whl | awk 'END { printf "total: %.2f MiB\n", $1 / 2^20 }'
